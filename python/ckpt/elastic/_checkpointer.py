"""The checkpointer ``ctx.checkpointer`` returns: a ``ckpt.torch.Checkpointer`` whose
commits end an agreed regroup and are reported to the control plane, whose saves
stay this rank's in-memory copy, and which saves under a run id of its own after a
rollback.

It imports torch (through ``ckpt.torch``): ``Context.checkpointer`` imports this
module when it is called.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt import _native
from ckpt.elastic._context import WorldChanged
from ckpt.elastic._rollback import rolled_run_id
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
        self._config = {
            k: v
            for k, v in kwargs.items()
            if k
            not in (
                "rank",
                "world_size",
                "store_options",
                "health_check",
                "compare_plain_tensors",
                "_budget_of",
            )
        }
        self._run_id: str | None = kwargs.get("run_id") or os.environ.get("CKPT_RUN_ID")

    def _renew(self, n: int) -> None:
        """After the ``n``-th rollback of this generation: the world saves again
        steps it saved before, each in an attempt directory of its own, so the saves
        from here on use a run id of their own (every rank derives the same; a
        fixed world without a known run id draws one, a collective)."""
        self._native.close()
        if self._run_id is not None:
            run_id = rolled_run_id(self._run_id, n)
        else:
            run_id = _api._shared_run_id(self.world_size) or secrets.token_hex(8)
        config = dict(self._config, run_id=run_id)
        self._native = _native.Checkpointer(
            self.url, self.rank, self.world_size, config, self.store_options, self._ctx._copies
        )

    def save(self, step: int, state_dict: Mapping[str, Any], **kwargs: Any) -> _api.SaveHandle:
        handle = super().save(step, state_dict, **kwargs)
        ctx = self._ctx
        if ctx._copies is not None and self._native_keeps_copies:
            ctx._copies.keep(handle._native, ctx._table, ctx.rank)
        return _SaveHandle(ctx, handle)
