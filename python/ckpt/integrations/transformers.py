"""ckpt for the Hugging Face ``Trainer``: saves and resumes through ckpt.

::

    from ckpt.integrations.transformers import CkptTrainer

    trainer = CkptTrainer(model=model, args=args, train_dataset=data,
                          ckpt_url="s3://bucket/run1")
    trainer.train(resume_from_checkpoint=True)   # the newest commit, if there is one

Why a ``Trainer`` subclass: the ``Trainer`` has no hook that writes a checkpoint or
chooses what a resume reads (a ``TrainerCallback`` only sees files already written),
and its resume path opens local files by name. ``CkptTrainer`` keeps the Trainer's
loop and its decisions (``save_strategy``, ``save_steps``, ``save_total_limit``) and
replaces what a save writes and what a resume reads:

- model and optimizer as ``torch.distributed.checkpoint.state_dict.get_state_dict``
  gives them (DDP: whole tensors, written once; FSDP2: each rank's shards): tensors,
  resharded by ckpt's planner on load;
- the LR scheduler and gradient scaler (``torch.save`` bytes, read back with
  ``weights_only=True``), the ``TrainerState`` (its JSON), each rank's RNG state,
  and the data position: the epoch and how many samples of its permutation the job
  consumed.

A resume onto another world size continues the epoch at that sample: the Trainer's
sampler deals one seeded permutation per epoch round-robin in batches, so the first
``k·B·W`` samples are exactly what ``k`` batches of ``B`` on ``W`` ranks took, and the
new world skips ``consumed / (B'·W')`` of its own batches (the stock Trainer skips
``global_step``-derived batches, which is right only when the global batch is
unchanged). Ranks with a number the saving world had get their RNG state back.

``save_total_limit`` becomes ckpt's ``keep_last``; no ``checkpoint-N`` folder is
written (``trainer.save_model()`` still writes a Hugging Face model folder when
asked). The save is overlapped: it returns once ckpt's copy of the tensors has
started, and the next optimizer step waits for the copy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

import ckpt.torch
from ckpt import _native
from ckpt.integrations import _common

log = logging.getLogger(__name__)

_MODEL, _OPTIM, _SCHEDULER, _SCALER = "model", "optimizer", "scheduler", "scaler"
_STATE, _RNG, _DATA = "trainer_state", "rng", "data"


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


class _WaitForStaging(TrainerCallback):
    """Before each optimizer step: the previous save's copy of the tensors is done."""

    def __init__(self, trainer: CkptTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pending = self.trainer._ckpt_pending
        if pending is not None:
            pending.wait_staged()


class CkptTrainer(Trainer):
    """The ``Trainer``, checkpointing to ckpt at ``ckpt_url``.

    ``ckpt_config``: settings of ``ckpt.torch.Checkpointer`` (``codec``,
    ``block_size``, …); ``keep_last`` defaults to ``args.save_total_limit``. Every
    other argument is the ``Trainer``'s.

    ``train(resume_from_checkpoint=...)``: ``True`` resumes from the newest commit
    under ``ckpt_url`` and starts from the beginning when there is none; a URL
    resumes from the newest commit under that URL (which must have one).
    """

    def __init__(
        self, *args: Any, ckpt_url: str | os.PathLike, ckpt_config: dict | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.ckpt_url = os.fspath(ckpt_url)
        self._ckpt_config = dict(ckpt_config or {})
        if self.args.save_total_limit is not None:
            self._ckpt_config.setdefault("keep_last", self.args.save_total_limit)
        self._checkpointer: ckpt.torch.Checkpointer | None = None
        self._ckpt_pending: ckpt.torch.SaveHandle | None = None
        self._ckpt_resume: tuple[str, int, Any] | None = None
        self.add_callback(_WaitForStaging(self))

    # -- resume -------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        placeholder = None
        if resume_from_checkpoint:
            url = (
                self.ckpt_url
                if resume_from_checkpoint is True
                else os.fspath(resume_from_checkpoint)
            )
            step = _common.newest_step(url)
            if step is None and resume_from_checkpoint is not True:
                raise _native.NotFoundError(f"no committed checkpoint in {url}")
            if step is None:
                log.info(
                    "no committed checkpoint under %s: training starts from the beginning", url
                )
                resume_from_checkpoint = None
            else:
                # The non-tensor state first (the tensors are loaded once the model
                # and optimizer are prepared): the Trainer reads its TrainerState
                # from a local file before any hook runs, so it gets one.
                extra = ckpt.torch.load(url, {}, step=step, cooperative=True)
                self._ckpt_resume = (url, step, extra)
                placeholder = tempfile.mkdtemp(prefix="ckpt-resume-")
                mine = _common.rank_values(extra, self.args.process_index)
                with open(os.path.join(placeholder, "trainer_state.json"), "w") as f:
                    f.write(mine[_STATE])
                resume_from_checkpoint = placeholder
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
            if self._ckpt_pending is not None:
                self._ckpt_pending.wait_committed()
            return result
        finally:
            self._ckpt_resume = None
            if placeholder is not None:
                shutil.rmtree(placeholder, ignore_errors=True)

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if self._ckpt_resume is None:
            return epochs, batches
        position = _common.subtree(_common.rank_values(self._ckpt_resume[2], 0), _DATA)
        if not position:
            return epochs, batches
        per_batch = self.args.per_device_train_batch_size * self.args.world_size
        samples = position["samples"]
        if samples % per_batch:
            log.warning(
                "resuming at sample %d of epoch %d: not a whole number of batches of %d on %d "
                "ranks; %d samples of the epoch are seen again",
                samples,
                position["epoch"],
                self.args.per_device_train_batch_size,
                self.args.world_size,
                samples % per_batch,
            )
        return position["epoch"], (0 if self.args.ignore_data_skip else samples // per_batch)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        pass  # the tensors are loaded with the optimizer's, once both are prepared

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._ckpt_resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        url, step, _ = self._ckpt_resume
        optimizer = _inner(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        target = {_MODEL: model_sd, _OPTIM: optim_sd}
        extra = ckpt.torch.load(url, target, step=step, cooperative=True)
        _common.fill_values(target, extra.ranks, self.args.process_index)
        set_state_dict(
            self.model, optimizer, model_state_dict=target[_MODEL], optim_state_dict=target[_OPTIM]
        )
        mine = _common.rank_values(extra, self.args.process_index)
        if self.lr_scheduler is not None and _SCHEDULER in mine:
            self.lr_scheduler.load_state_dict(_common.unpickled(mine[_SCHEDULER]))
        log.info(
            "loaded step %d from %s (saved by %d ranks, now %d)",
            extra.step,
            url,
            extra.world_size,
            self.args.world_size,
        )

    def _load_scaler(self, checkpoint):
        if self._ckpt_resume is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        mine = _common.rank_values(self._ckpt_resume[2], self.args.process_index)
        if scaler is not None and _SCALER in mine:
            scaler.load_state_dict(_common.unpickled(mine[_SCALER]))

    def _load_rng_state(self, checkpoint):
        if self._ckpt_resume is None:
            return super()._load_rng_state(checkpoint)
        extra, rank = self._ckpt_resume[2], self.args.process_index
        if rank < len(extra.ranks) and extra.ranks[rank]:
            _common.set_rng_state(_common.subtree(extra.ranks[rank], _RNG))

    # -- save ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        if self.hp_search_backend is None and trial is None:
            self.store_flos()  # a collective under DDP: every rank, as the Trainer does
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                self.state.stateful_callbacks[cb.__class__.__name__] = cb.state()
        optimizer = _inner(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, optimizer)
        state: dict[str, Any] = {
            _MODEL: _common.copy_buffers(self.model, model_sd),
            _OPTIM: optim_sd,
            _STATE: json.dumps(dataclasses.asdict(self.state), sort_keys=True),
            _RNG: _common.rng_state(),
        }
        if self.lr_scheduler is not None:
            state[_SCHEDULER] = _common.pickled(self.lr_scheduler.state_dict())
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state[_SCALER] = _common.pickled(scaler.state_dict())
        position = self._position()
        if position is not None:
            state[_DATA] = position
        if self._checkpointer is None:
            self._checkpointer = ckpt.torch.Checkpointer(self.ckpt_url, **self._ckpt_config)
        if self._ckpt_pending is not None:
            self._ckpt_pending.wait_staged()
        self._ckpt_pending = self._checkpointer.save(self.state.global_step, state)

    def _position(self) -> dict[str, int] | None:
        """The epoch the job is in and how many samples of its permutation the whole
        job consumed (``state.epoch`` is ``epoch + batches / batches_per_epoch``)."""
        loader = self.callback_handler.train_dataloader
        try:
            per_epoch = len(loader)
        except TypeError:  # an IterableDataset: no position to keep
            return None
        epoch = math.floor(self.state.epoch + 1e-9)
        batches = round((self.state.epoch - epoch) * per_epoch)
        return {
            "epoch": int(epoch),
            "samples": int(batches * self.args.per_device_train_batch_size * self.args.world_size),
            "replicas": int(self.args.world_size),
            "batch_size": int(self.args.per_device_train_batch_size),
        }
