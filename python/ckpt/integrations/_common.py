"""What every framework integration needs beside the framework itself.

- **RNG state per rank.** Frameworks keep their RNG state (when they keep it at
  all) as tensors and pickles; a plain tensor in ckpt is one value shared by the
  ranks (rank 0 writes it), which is wrong for a per-rank generator. So the state of
  Python's, NumPy's, torch's and CUDA's generators is kept as JSON-able non-tensor
  values, which ckpt stores per rank and gives back exactly.
- **The data position.** ``DistributedSampler`` deals out one global permutation per
  epoch: with ``W`` replicas, rank ``r`` takes positions ``r, r + W, r + 2W, …``, so
  after ``k`` batches of ``B`` on every rank the job has consumed exactly the first
  ``k·B·W`` positions, whatever ``W`` was. A resume on another world size therefore
  continues the same permutation at that offset, dealt to the new ranks
  (:class:`ResumedSampler`): no sample of the epoch is skipped or seen twice.
"""

from __future__ import annotations

import io
import random
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler

from ckpt.torch import latest


def pickled(value: Any) -> bytes:
    """``value`` as ``torch.save`` bytes (schedulers' and user objects' states, which
    may hold tensors and tuples ckpt's JSON values would not give back as such)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpickled(payload: bytes) -> Any:
    """What :func:`pickled` wrote, read with ``weights_only=True``: plain containers,
    numbers and tensors, never code."""
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def rng_state() -> dict[str, Any]:
    """This process's generator states, as values ckpt keeps exactly."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    try:
        import numpy as np
    except ImportError:  # NumPy is optional for torch
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (
            str(kind),
            [int(k) for k in keys],
            int(pos),
            int(has_gauss),
            float(cached),
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Puts back what :func:`rng_state` returned (generators it names only)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(
                [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in saved]
            )


def on_rank0(compute: Callable[[], Any]) -> Any:
    """What ``compute()`` gives on rank 0 of the default process group, on every rank
    (computed there only: one LIST of the store, not one per rank, and one answer
    for all even while a commit lands); ``compute()`` itself without a group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    box = [compute() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def newest_step(url: str) -> int | None:
    """The newest committed step under ``url``, as rank 0 sees it, on every rank."""

    def newest() -> int | None:
        found = latest(url)
        return None if found is None else found["step"]

    return on_rank0(newest)


def copy_buffers(
    modules: torch.nn.Module | Iterable[torch.nn.Module], state: dict[str, Any]
) -> dict[str, Any]:
    """``state`` (a model state dict of ``modules``) with its buffers copied. A save's tensors are
    read while the next forward and backward run; parameters change only in the
    optimizer step, which waits for the copy, but a forward may write a buffer
    (BatchNorm's running statistics), so buffers, which are small, are copied now."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    buffers = {name for module in modules for name, _ in module.named_buffers()}
    return {
        k: v.detach().clone() if k in buffers and isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def subtree(values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The entries of a rank's flattened non-tensor state under ``prefix.``, with the
    prefix taken off (ckpt returns non-tensor state by flattened name)."""
    start = prefix + "."
    return {k[len(start) :]: v for k, v in values.items() if k.startswith(start)}


def fill_values(target: Any, ranks: list[dict[str, Any]], rank: int) -> None:
    """Puts saved non-tensor values into ``target``'s non-tensor leaves: this rank's
    own, else the first saved rank's that has the name. ``ckpt.torch.load`` fills
    only the rank's own, so a rank that is new after a scale-up would keep the
    values it was built with: an optimizer's learning rate, which would then differ
    from its replicas' and let them drift apart."""
    from ckpt.torch import _state

    order = ([ranks[rank]] if rank < len(ranks) else []) + list(ranks)
    for leaf in _state.leaves(target):
        if isinstance(leaf.value, torch.Tensor):
            continue
        for values in order:
            if leaf.fqn in values:
                leaf.container[leaf.key] = values[leaf.fqn]
                break


def rank_values(extra: Any, rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s non-tensor state, or saved rank 0's when the saving
    world was smaller (a rank that is new after a scale-up starts from rank 0's)."""
    if rank < len(extra.ranks) and extra.ranks[rank]:
        return extra.ranks[rank]
    return extra.ranks[0] if extra.ranks else {}


def sampler_position(sampler: Any, batches: int, batch_size: int) -> dict[str, int] | None:
    """Where a job stands in the epoch that ``sampler`` deals, after ``batches``
    batches of ``batch_size`` on every rank; None when the sampler is not a
    ``DistributedSampler`` (then no position is kept)."""
    if not isinstance(sampler, DistributedSampler):
        return None
    return {
        "epoch": int(sampler.epoch),
        "samples": int(batches * batch_size * sampler.num_replicas),
        "replicas": int(sampler.num_replicas),
        "batch_size": int(batch_size),
        "dataset": len(sampler.dataset),
    }


def _permutation(sampler: DistributedSampler, epoch: int) -> list[int]:
    """The global order ``sampler`` deals in ``epoch``, before padding: the same
    seeded permutation ``DistributedSampler`` draws (or the identity)."""
    n = len(sampler.dataset)
    if not sampler.shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(sampler.seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


class ResumedSampler(Sampler[int]):
    """``base`` (a ``DistributedSampler``) that, in epoch ``epoch`` only, deals the
    epoch's permutation from global position ``offset`` on, to ``base``'s replicas;
    every other epoch is ``base``'s own. The epoch is read from ``base`` when an
    iteration starts, so frameworks that call ``base.set_epoch`` drive it."""

    def __init__(self, base: DistributedSampler, epoch: int, offset: int):
        self.base = base
        self.epoch = epoch
        self.offset = offset

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self) -> Iterator[int]:
        if self.base.epoch != self.epoch or self.offset == 0:
            return iter(self.base)
        base = self.base
        order = _permutation(base, self.epoch)[self.offset :]
        if base.drop_last:
            keep = len(order) - len(order) % base.num_replicas
            dropped = len(order) - keep
            order = order[:keep]
        else:
            dropped = 0
            missing = -len(order) % base.num_replicas
            # Every rank must take as many batches: the last ranks repeat the
            # first samples of the rest, as DistributedSampler pads its tail.
            order += (order * (missing // max(len(order), 1) + 1))[:missing]
            if missing:
                warnings.warn(
                    f"resuming at sample {self.offset} of epoch {self.epoch} on "
                    f"{base.num_replicas} replicas: {missing} samples are seen twice this epoch "
                    "(the position is not a multiple of the number of replicas)",
                    stacklevel=2,
                )
        if dropped:
            warnings.warn(
                f"resuming at sample {self.offset} of epoch {self.epoch} on {base.num_replicas} "
                f"replicas with drop_last: {dropped} samples are left out this epoch",
                stacklevel=2,
            )
        return iter(order[base.rank :: base.num_replicas])
