"""ckpt for PyTorch.

``Checkpointer`` saves and loads state dicts of tensors and DTensors (FSDP2
``fully_shard`` models, optimizer state from
``torch.distributed.checkpoint.state_dict.get_state_dict``) through ckpt's library:
zero-copy, verified block by block, resharded onto whatever world loads them::

    from ckpt.torch import Checkpointer

    ckpt = Checkpointer("file:///checkpoints/run1")      # rank, world from torch.distributed
    handle = ckpt.save(step, {"model": model_sd, "optim": optim_sd, "cursor": 4096})
    ...                                                   # forward, backward
    handle.wait_staged()                                  # before optimizer.step()
    optimizer.step()

    extra = ckpt.load({"model": model_sd, "optim": optim_sd})   # in place, any world size

Each save records the checkpoint's health (non-finite tensors, replicas that
disagree, the ``health=`` metrics and ``health_check``); loads and ``latest`` without
a step take the newest checkpoint not judged unhealthy. ``health(url, step)`` reads it.

``ckpt.torch.dcp`` plugs the same format and commit into ``torch.distributed.checkpoint``;
it is imported on first use, so ``ckpt.torch.dcp.StorageWriter(url)`` works after a
plain ``import ckpt.torch``.
"""

from ckpt.torch._api import (
    Checkpointer,
    ExtraState,
    SaveHandle,
    SnapshotHandle,
    UnhealthyCheckpointWarning,
    UnhealthySkippedWarning,
    health,
    latest,
    list_checkpoints,
    load,
)
from ckpt.torch._cooperative import PeerLostError

__all__ = [
    "Checkpointer",
    "ExtraState",
    "PeerLostError",
    "SaveHandle",
    "SnapshotHandle",
    "UnhealthyCheckpointWarning",
    "UnhealthySkippedWarning",
    "health",
    "latest",
    "list_checkpoints",
    "load",
]


def __getattr__(name: str):
    # `ckpt.torch.dcp` without importing it by name: loaded (with DCP) on first use.
    if name == "dcp":
        import importlib

        return importlib.import_module("ckpt.torch.dcp")
    # The old name of `list_checkpoints`, which shadowed the builtin; warned on every
    # use (attribute or `from ckpt.torch import list`), never star-imported.
    if name == "list":
        import warnings

        warnings.warn(
            "ckpt.torch.list is deprecated (it shadows the builtin list): "
            "use ckpt.torch.list_checkpoints",
            DeprecationWarning,
            stacklevel=2,
        )
        return list_checkpoints
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
