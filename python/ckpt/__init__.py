"""ckpt: fault-tolerant sharded checkpointing for distributed training.

The Python package binds ckpt's Rust library (``ckpt._native``); nothing of the
format, the commit protocol or the load planner is written twice. ``ckpt.torch`` is
the PyTorch face: a native ``Checkpointer`` for state dicts of tensors and DTensors,
and a storage plugin for ``torch.distributed.checkpoint`` (``ckpt.torch.dcp``).

Errors are ``CkptError`` subclasses keyed by what the caller can do, with the
library's message and a ``kind`` attribute (``"corrupt"``, ``"not_found"``, …).
"""

from ckpt._native import (
    CkptError,
    CommitTimeoutError,
    CorruptionError,
    DeviceError,
    ElasticError,
    FencedError,
    InvalidError,
    MismatchError,
    MutatedError,
    NotFoundError,
    OverBudgetError,
    SaveFailedError,
    StorageError,
    __version__,
)

__all__ = [
    "CkptError",
    "CommitTimeoutError",
    "CorruptionError",
    "DeviceError",
    "ElasticError",
    "FencedError",
    "InvalidError",
    "MismatchError",
    "MutatedError",
    "NotFoundError",
    "OverBudgetError",
    "SaveFailedError",
    "StorageError",
    "__version__",
]
