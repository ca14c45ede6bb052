"""Every place ``ckpt.elastic`` reaches into torch's private state, in one module.

torch assumes one process group per process lifetime; ``ckpt.elastic`` forms a new
one in the same process for every generation, which leaves caches and counters of
the previous one behind, and aborts groups that torch offers no public call to
abort. Each function here uses one private name; those that reset state look their
name up first and do nothing on a torch release without it. A torch upgrade is
checked against this module alone.

Each docstring names the torch release whose code was read for it: 2.15.0, the
release the package is tested with. The ``torch`` extra allows 2.6 and later; for
those releases nothing more is claimed than the look-ups above.
"""

from __future__ import annotations


def forget_meshes() -> None:
    """Empties torch's DTensor caches, which are keyed by specs that hold device
    meshes; meshes compare equal whatever rank built them, so after a re-formation a
    cached result could hand a DTensor the mesh of an earlier generation, with this
    process's rank there.

    torch 2.15: ``DTensor._op_dispatcher.sharding_propagator`` keeps
    ``propagate_op_sharding`` (a ``LocalLRUCache``) and
    ``_propagate_tensor_meta_cached`` (``functools.lru_cache``), and
    ``torch.distributed.tensor._redistribute._gen_transform_infos`` is a
    ``functools.cache``."""
    try:
        from torch.distributed.tensor import DTensor, _redistribute

        propagator = DTensor._op_dispatcher.sharding_propagator
        for cached in (
            getattr(propagator.propagate_op_sharding, "cache", None),
            getattr(propagator, "_propagate_tensor_meta_cached", None),
            getattr(_redistribute, "_gen_transform_infos", None),
        ):
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()
    except (ImportError, AttributeError):
        pass


def reset_group_names() -> None:
    """Names the next default group as a fresh process would. torch names groups by
    a process-wide counter (``str(group_count)``, also the store prefix of its
    keys) that only a successful ``destroy_process_group`` resets: after a
    formation that failed inside ``init_process_group`` (aborted), this rank would
    name the next group "1" while its peers name it "0", and each would wait for
    the others' keys under its own prefix until the timeout.

    torch 2.15: ``torch.distributed.distributed_c10d._world`` (a ``_World``) has a
    settable ``group_count`` property over the module's ``_group_count``."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def abort_process_group() -> None:
    """Aborts every process group of this process, which fails the collectives
    blocked in them (on NCCL: its communicators; gloo has no abort, the agent shuts
    its connections down instead, see ``_sockets``).

    torch 2.15: ``torch.distributed.distributed_c10d._abort_process_group``,
    documented there as experimental and NCCL-only."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()
