"""The checkpointer ``ctx.checkpointer`` returns: a ``ckpt.torch.Checkpointer`` whose
commits end an agreed regroup and are reported to the control plane, and whose
saves stay this rank's in-memory copy.

It imports torch (through ``ckpt.torch``): ``Context.checkpointer`` imports this
module when it is called.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt.elastic._context import WorldChanged
from ckpt.torch import _api

if TYPE_CHECKING:
    from ckpt.elastic._context import Context


class _SaveHandle(_api.SaveHandle):
    def __init__(self, ctx: Context, handle: _api.SaveHandle):
        self.__dict__.update(handle.__dict__)
        self._ctx = ctx

    def wait_committed(self) -> None:
        self._ctx._agent.collective_started()
        try:
            super().wait_committed()
        finally:
            self._ctx._agent.collective_done()
        if self._ctx._copies is not None:
            self._ctx._copies.confirm(self._native)
        self._ctx._committed_step(self.step)
        if self._ctx._ending == "regroup" and self.step == self._ctx._agreed:
            # The generation ends at the agreed commit; the next one loads it.
            raise WorldChanged(self._ctx.generation, "regroup at a committed checkpoint")


class FencedCheckpointer(_api.Checkpointer):
    def __init__(self, ctx: Context, url: str | os.PathLike, **kwargs: Any):
        super().__init__(url, **kwargs)
        self._ctx = ctx
        self._native_keeps_copies = bool(kwargs.get("keep_copy"))

    def save(self, step: int, state_dict: Mapping[str, Any], **kwargs: Any) -> _api.SaveHandle:
        handle = super().save(step, state_dict, **kwargs)
        ctx = self._ctx
        if ctx._copies is not None and self._native_keeps_copies:
            ctx._copies.keep(handle._native, ctx._table, ctx.rank)
        return _SaveHandle(ctx, handle)
