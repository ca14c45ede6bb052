"""ckpt for Hugging Face Accelerate's ``save_state`` / ``load_state``.

::

    from ckpt.integrations.accelerate import CkptAccelerator

    accelerator = CkptAccelerator(ckpt_url="s3://bucket/run1")   # was: Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.load_state()           # the newest commit under ckpt_url, if there is one
    ...
    accelerator.save_state()           # a ckpt commit (step: the save iteration, or step=)

Accelerate's hooks cannot take a save over (they may only filter the model weights,
the directory is created regardless, and under FSDP the weights are written before
the hook runs), so ``CkptAccelerator`` overrides ``save_state`` and ``load_state``:
with a ckpt URL (``ckpt_url``, or a URL given as the directory) they save and load
through ckpt, and with a local directory they are Accelerate's own.

A save holds every prepared model and optimizer (``torch.distributed.checkpoint``
state dicts: whole tensors under DDP, shards under FSDP2), the schedulers, the
gradient scaler and the objects given to ``register_for_checkpointing`` (their
``state_dict()`` as ``torch.save`` bytes, per rank, read back with
``weights_only=True``), each rank's RNG state, ``accelerator.step`` and, with
``use_stateful_dataloader``, each rank's dataloader state. A load reshards the
tensors onto the current world; per-rank values go to the rank with the same
number (a rank new after a scale-up gets rank 0's schedulers and objects, and
keeps its own RNG and dataloader state).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckpt.torch
from ckpt import _native
from ckpt.integrations import _common

log = logging.getLogger(__name__)


class CkptAccelerator(Accelerator):
    """An ``Accelerator`` whose ``save_state``/``load_state`` go to ckpt at
    ``ckpt_url`` (or at a URL given as their directory). ``ckpt_config``: settings
    of ``ckpt.torch.Checkpointer``; ``keep_last`` defaults to the project
    configuration's ``total_limit``."""

    def __init__(self, *args: Any, ckpt_url: str | None = None, ckpt_config: dict | None = None,
                 **kwargs: Any):  # fmt: skip
        super().__init__(*args, **kwargs)
        self.ckpt_url = None if ckpt_url is None else os.fspath(ckpt_url)
        self._ckpt_config = dict(ckpt_config or {})
        limit = self.project_configuration.total_limit
        if limit is not None:
            self._ckpt_config.setdefault("keep_last", limit)
        self._checkpointers: dict[str, ckpt.torch.Checkpointer] = {}
        self._ckpt_pending: ckpt.torch.SaveHandle | None = None
        self._ckpt_hooked: set[int] = set()

    def _ckpt_target(self, directory: Any) -> str | None:
        if directory is not None:
            directory = os.fspath(directory)
            return directory if "://" in directory else None
        return self.ckpt_url

    # -- state --------------------------------------------------------------------

    def _owner(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The prepared model whose parameters ``optimizer`` steps."""
        first = next(p for group in optimizer.param_groups for p in group["params"])
        for model in self._models:
            inner = self.unwrap_model(model)
            if any(p is first for p in inner.parameters()):
                return inner
        raise _native.InvalidError("an optimizer steps parameters of no prepared model")

    def _tensors(self) -> dict[str, Any]:
        models = {
            str(i): get_model_state_dict(self.unwrap_model(m)) for i, m in enumerate(self._models)
        }
        optimizers = {}
        for i, wrapped in enumerate(self._optimizers):
            optimizer = getattr(wrapped, "optimizer", wrapped)
            optimizers[str(i)] = get_optimizer_state_dict(self._owner(optimizer), optimizer)
        return {"models": models, "optimizers": optimizers}

    # -- save ---------------------------------------------------------------------

    def save_state(self, output_dir: Any = None, *args: Any, step: int | None = None, **kwargs):
        url = self._ckpt_target(output_dir)
        if url is None:
            return super().save_state(output_dir, *args, **kwargs)
        step = self.save_iteration if step is None else step
        state = self._tensors()
        for i, model in enumerate(self._models):
            models = state["models"]
            models[str(i)] = _common.copy_buffers(self.unwrap_model(model), models[str(i)])
        state["schedulers"] = {
            str(i): _common.pickled(s.state_dict()) for i, s in enumerate(self._schedulers)
        }
        state["custom"] = {
            str(i): _common.pickled(o.state_dict()) for i, o in enumerate(self._custom_objects)
        }
        if self.scaler is not None:
            state["scaler"] = _common.pickled(self.scaler.state_dict())
        loaders = {
            str(i): _common.pickled(dl.state_dict())
            for i, dl in enumerate(self._dataloaders)
            if getattr(dl, "use_stateful_dataloader", False)
        }
        if loaders:
            state["dataloaders"] = {**loaders, "world_size": self.num_processes}
        state["rng"] = _common.rng_state()
        state["step"] = self.step
        checkpointer = self._checkpointers.get(url)
        if checkpointer is None:
            checkpointer = ckpt.torch.Checkpointer(url, **self._ckpt_config)
            self._checkpointers[url] = checkpointer
        if self._ckpt_pending is not None:
            self._ckpt_pending.wait_committed()  # one save in flight
        self._ckpt_pending = checkpointer.save(step, state)
        self._wait_before_steps()
        self.project_configuration.iteration = step + 1
        return url

    def _wait_before_steps(self) -> None:
        """The save copies the tensors while the caller computes on; each
        optimizer's next step waits for the copy (a step pre-hook)."""
        for wrapped in self._optimizers:
            optimizer = getattr(wrapped, "optimizer", wrapped)
            if id(optimizer) not in self._ckpt_hooked:
                optimizer.register_step_pre_hook(self._staged_before_step)
                self._ckpt_hooked.add(id(optimizer))

    def _staged_before_step(self, *_: Any) -> None:
        if self._ckpt_pending is not None:
            self._ckpt_pending.wait_staged()

    def wait_for_checkpoint(self) -> None:
        """Waits until the last ``save_state`` to ckpt is committed (``end_training``
        does too)."""
        if self._ckpt_pending is not None:
            pending, self._ckpt_pending = self._ckpt_pending, None
            pending.wait_committed()

    def end_training(self) -> None:
        self.wait_for_checkpoint()
        super().end_training()

    # -- load ---------------------------------------------------------------------

    def load_state(self, input_dir: Any = None, *args: Any, step: int | None = None, **kwargs):
        url = self._ckpt_target(input_dir)
        if url is None:
            return super().load_state(input_dir, *args, **kwargs)
        self.wait_for_checkpoint()
        if step is None:
            step = _common.newest_step(url)
            if step is None:
                if input_dir is not None:
                    raise _native.NotFoundError(f"no committed checkpoint in {url}")
                log.info("no committed checkpoint under %s: nothing loaded", url)
                return None
        target = self._tensors()
        extra = ckpt.torch.load(url, target, step=step, cooperative=True)
        rank = self.process_index
        _common.fill_values(target, extra.ranks, rank)
        for i, model in enumerate(self._models):
            set_model_state_dict(self.unwrap_model(model), target["models"][str(i)])
        for i, wrapped in enumerate(self._optimizers):
            optimizer = getattr(wrapped, "optimizer", wrapped)
            set_optimizer_state_dict(
                self._owner(optimizer), optimizer, target["optimizers"][str(i)]
            )
        mine = _common.rank_values(extra, rank)
        for i, scheduler in enumerate(self._schedulers):
            scheduler.load_state_dict(_common.unpickled(mine[f"schedulers.{i}"]))
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(_common.unpickled(mine[f"custom.{i}"]))
        if self.scaler is not None and "scaler" in mine:
            self.scaler.load_state_dict(_common.unpickled(mine["scaler"]))
        own = extra.ranks[rank] if rank < len(extra.ranks) else {}
        if own.get("dataloaders.world_size") == self.num_processes:
            for i, dl in enumerate(self._dataloaders):
                if f"dataloaders.{i}" in own:
                    dl.load_state_dict(_common.unpickled(own[f"dataloaders.{i}"]))
        elif any(k.startswith("dataloaders.") for k in mine):
            log.warning(
                "the dataloaders' state was saved on %s processes and this job has %d: "
                "it is not restored",
                mine.get("dataloaders.world_size"),
                self.num_processes,
            )
        if own:
            _common.set_rng_state(_common.subtree(own, "rng"))
        self.step = int(mine.get("step", 0))
        self.project_configuration.iteration = step + 1
        log.info(
            "loaded step %d from %s (saved by %d processes, now %d)",
            step,
            url,
            extra.world_size,
            self.num_processes,
        )
        return None
