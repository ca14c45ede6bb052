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

``ckpt.torch.dcp`` plugs the same format and commit into ``torch.distributed.checkpoint``;
it is imported on first use, so ``ckpt.torch.dcp.StorageWriter(url)`` works after a
plain ``import ckpt.torch``.
"""

from ckpt.torch._api import Checkpointer, ExtraState, SaveHandle, latest, list, load

__all__ = ["Checkpointer", "ExtraState", "SaveHandle", "latest", "list", "load"]


def __getattr__(name: str):
    # `ckpt.torch.dcp` without importing it by name: loaded (with DCP) on first use.
    if name == "dcp":
        import importlib

        return importlib.import_module("ckpt.torch.dcp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
