"""ckpt for PyTorch Lightning: strategies that save and resume through ckpt.

::

    from ckpt.integrations.lightning import CkptDDPStrategy

    trainer = L.Trainer(
        strategy=CkptDDPStrategy("s3://bucket/run1", keep_last=3),
        callbacks=[ModelCheckpoint(every_n_train_steps=100, save_last=True)],
    )
    trainer.fit(model, ckpt_path="s3://bucket/run1")   # the newest commit, if any

Why strategies and not a ``CheckpointIO`` plugin: Lightning hands a ``CheckpointIO``
the checkpoint on global rank 0 only (DDP), and its sharded strategies (FSDP,
``ModelParallelStrategy``) never call one; ckpt's save is a commit that every rank
joins with its own shard, so the strategy is where a save must go.

What a save holds:

- the model and every optimizer as ``torch.distributed.checkpoint.state_dict``
  gives them (names of the LightningModule, DTensors under FSDP2): tensors, each
  rank writing its shards, resharded by ckpt's planner on load;
- the rest of Lightning's checkpoint (loops' progress, callbacks, LR schedulers,
  hyper-parameters, precision state) as ``torch.save`` bytes of each rank, read
  back with the ``weights_only`` the caller gives ``fit`` (Lightning's own rule);
- each rank's RNG state (Lightning keeps none), and where the job stands in its
  ``DistributedSampler``'s epoch.

A resume (``fit(ckpt_path=URL)``: the newest commit under URL; the strategy's own
URL or any other) loads model and optimizers in place, resharded onto the current
world, and continues the epoch at the exact sample it reached: on another number of
data-parallel replicas, the same permutation is dealt to the new ranks from that
position, and Lightning's batch counters are rescaled to match. Ranks with a number
the saving world had get their RNG state back.

Saves are overlapped: ``save_checkpoint`` returns once ckpt's copy of the tensors
has started, the next forward and backward run beside it, and the optimizer step
waits for the copy (the strategy wraps the step's closure). Lightning's
``ModelCheckpoint`` decides when to save (its ``dirpath`` stays local and unused);
``keep_last`` is ckpt's retention, so ``save_top_k`` removes nothing.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import ckpt.torch
from ckpt.integrations import _common

log = logging.getLogger(__name__)

# Keys of a ckpt checkpoint written by these strategies.
_MODEL, _OPTIMIZERS, _REST, _RNG, _DATA = "model", "optimizers", "lightning", "rng", "data"


def _options() -> StateDictOptions:
    # Sharded (DTensor) state as it lies: ckpt copies device tensors itself.
    return StateDictOptions(full_state_dict=False)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps it


class _CkptStrategy:
    """What both strategies add to Lightning's: see the module's doc."""

    def __init__(
        self,
        url: str | os.PathLike,
        *args: Any,
        keep_last: int | None = None,
        ckpt_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.ckpt_url = os.fspath(url)
        self._ckpt_config = dict(ckpt_config or {})
        if keep_last is not None:
            self._ckpt_config["keep_last"] = keep_last
        self._checkpointer: ckpt.torch.Checkpointer | None = None
        self._pending: ckpt.torch.SaveHandle | None = None
        self._last_saved_step: int | None = None
        self._resume_position: dict[str, int] | None = None

    # Lightning restores the model and optimizers from what `load_checkpoint`
    # returns unless told the strategy did it; ckpt's load does it, in place, after
    # the optimizers exist.
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.lightning_module, options=_options())
        return _common.copy_buffers(self.lightning_module, state)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return get_optimizer_state_dict(
            self.lightning_module, _inner(optimizer), options=_options()
        )

    # -- saving -------------------------------------------------------------------

    def _ckpt(self) -> ckpt.torch.Checkpointer:
        if self._checkpointer is None:
            # Built on first use: every rank saves, so every rank builds it at once
            # (the run id is agreed over the process group).
            self._checkpointer = ckpt.torch.Checkpointer(self.ckpt_url, **self._ckpt_config)
        return self._checkpointer

    def _wait_staged(self) -> None:
        if self._pending is not None:
            self._pending.wait_staged()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} saves through ckpt: storage_options is unused")
        step = int(checkpoint["global_step"])
        if step == self._last_saved_step:
            return  # ModelCheckpoint's "last" save of the step it just saved
        trainer = self.lightning_module.trainer
        rest = dict(checkpoint)
        model = rest.pop("state_dict")
        optimizers = rest.pop("optimizer_states", [])
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        state: dict[str, Any] = {
            _MODEL: model,
            _OPTIMIZERS: {str(i): s for i, s in enumerate(optimizers)},
            _REST: buffer.getvalue(),
            _RNG: _common.rng_state(),
        }
        position = self._position(trainer)
        if position is not None:
            state[_DATA] = position
        if self._pending is not None:
            # One save in flight: the previous one must be staged (it is, unless no
            # optimizer step ran since) before its buffers are reused.
            self._pending.wait_staged()
        self._pending = self._ckpt().save(step, state)
        self._last_saved_step = step
        if not (
            trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        ):
            # A save outside the fit loop (after fit, from user code) is whole when
            # it returns: no later step will wait for it.
            self._pending.wait_committed()

    def _position(self, trainer: pl.Trainer) -> dict[str, int] | None:
        loader = getattr(trainer.fit_loop, "_combined_loader", None)
        if loader is None or len(loader.flattened) != 1:
            return None
        dl = loader.flattened[0]
        if not isinstance(dl, DataLoader) or dl.batch_size is None:
            return None
        sampler = dl.sampler
        if isinstance(sampler, _common.ResumedSampler):
            sampler = sampler.base
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return _common.sampler_position(sampler, batches, dl.batch_size)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        def staged_closure() -> Any:
            # Forward and backward ran beside the save's copy; the parameters and
            # the optimizer's state change only after it.
            result = closure()
            self._wait_staged()
            return result

        return super().optimizer_step(optimizer, staged_closure, model, **kwargs)

    def remove_checkpoint(self, filepath: Any) -> None:
        pass  # ckpt's retention (keep_last) removes checkpoints

    def teardown(self) -> None:
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.wait_committed()
        finally:
            super().teardown()

    # -- loading ------------------------------------------------------------------

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        url = os.fspath(checkpoint_path)
        trainer = self.lightning_module.trainer
        step = _common.newest_step(url)
        if step is None:
            log.info("no committed checkpoint under %s: training starts from the beginning", url)
            return {"pytorch-lightning_version": pl.__version__, "lr_schedulers": []}
        target: dict[str, Any] = {
            _MODEL: get_model_state_dict(self.lightning_module, options=_options())
        }
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            target[_OPTIMIZERS] = {
                str(i): get_optimizer_state_dict(
                    self.lightning_module, _inner(o), options=_options()
                )
                for i, o in enumerate(self.optimizers)
            }
        extra = ckpt.torch.load(url, target, step=step, cooperative=True)
        _common.fill_values(target, extra.ranks, self.global_rank)
        set_model_state_dict(self.lightning_module, target[_MODEL], options=_options())
        for i, optimizer in enumerate(self.optimizers if fitting else []):
            set_optimizer_state_dict(
                self.lightning_module,
                _inner(optimizer),
                target[_OPTIMIZERS][str(i)],
                options=_options(),
            )
        mine = _common.rank_values(extra, self.global_rank)
        from lightning.fabric.utilities.cloud_io import _load

        rest = _load(io.BytesIO(mine[_REST]), map_location="cpu", weights_only=weights_only)
        position = _common.subtree(mine, _DATA)
        self._resume_position = position or None
        if self.global_rank < len(extra.ranks):
            _common.set_rng_state(_common.subtree(extra.ranks[self.global_rank], _RNG))
        log.info(
            "loaded step %d from %s (saved by %d ranks, now %d)",
            extra.step,
            url,
            extra.world_size,
            self.world_size,
        )
        return rest

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        position, trainer = self._resume_position, self.lightning_module.trainer
        if position is None or not trainer.training:
            return dataloader
        self._resume_position = None  # the training loader is the first one set up
        if not (
            isinstance(dataloader, DataLoader)
            and isinstance(dataloader.sampler, DistributedSampler)
            and isinstance(dataloader.batch_sampler, BatchSampler)
        ):
            log.warning(
                "the training DataLoader has no DistributedSampler: its position is not restored"
            )
            return dataloader
        _resume_at(trainer, dataloader, position)
        return dataloader


def _resume_at(trainer: pl.Trainer, dataloader: DataLoader, position: dict[str, int]) -> None:
    """Continues ``dataloader``'s epoch at the saved sample, and gives Lightning's
    batch counters the number of batches of this world that those samples make."""
    sampler: DistributedSampler = dataloader.sampler  # type: ignore[assignment]
    if position["dataset"] != len(sampler.dataset):
        log.warning(
            "the dataset has %d samples, the saved position counts %d: it is not restored",
            len(sampler.dataset),
            position["dataset"],
        )
        return
    samples, epoch = position["samples"], position["epoch"]
    per_step = dataloader.batch_size * sampler.num_replicas
    progress = trainer.fit_loop.epoch_loop.batch_progress
    saved_batches = progress.current.processed
    if samples >= len(sampler.dataset):
        batches = len(dataloader)  # a whole epoch: Lightning moves on to the next
    elif samples == 0:
        batches = 0
    else:
        batches = samples // per_step
        if samples % per_step:
            log.warning(
                "resuming at sample %d of epoch %d: not a whole number of batches of %d on %d "
                "replicas; the epoch's batches are counted from %d",
                samples,
                epoch,
                dataloader.batch_size,
                sampler.num_replicas,
                batches,
            )
        dataloader.batch_sampler.sampler = _common.ResumedSampler(sampler, epoch, samples)
        # Lightning warns that a loader without state_dict cannot resume mid-epoch;
        # this one now does.
        warnings.filterwarnings(
            "ignore",
            message="You're resuming from a checkpoint that ended before the epoch ended",
            category=PossibleUserWarning,
        )
    shift = batches - saved_batches
    if shift:
        for tracker in (progress.current, progress.total):
            tracker.ready += shift
            tracker.started += shift
            tracker.processed += shift
            tracker.completed += shift


class CkptDDPStrategy(_CkptStrategy, DDPStrategy):
    """Lightning's ``DDPStrategy``, saving to and resuming from ckpt at ``url``.

    ``keep_last``: the commits ckpt keeps (default: all); ``ckpt_config``: other
    settings of ``ckpt.torch.Checkpointer`` (``codec``, ``block_size``, …); every
    other argument is ``DDPStrategy``'s."""


class CkptModelParallelStrategy(_CkptStrategy, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism set up in
    ``configure_model``), saving to and resuming from ckpt at ``url``: each rank
    writes its shards, and a load reshards onto whatever mesh the job has now.

    ``keep_last`` and ``ckpt_config`` as for :class:`CkptDDPStrategy`; every other
    argument is ``ModelParallelStrategy``'s."""
