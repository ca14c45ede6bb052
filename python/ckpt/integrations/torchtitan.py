"""ckpt for torchtitan: a checkpoint manager that torchtitan builds from its config.

torchtitan picks its checkpoint manager by the type of ``Trainer.Config.checkpoint``
(a ``BaseCheckpointManager.Config`` subclass builds its own manager), so a job
switches to ckpt with a config change and nothing else::

    from ckpt.integrations.torchtitan import CkptCheckpointManager

    config.checkpoint = CkptCheckpointManager.Config(
        enable=True, url="s3://bucket/run1", interval=500, keep_latest_k=3)

or, with torchtitan's stock configs, from the command line::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --checkpoint.enable --checkpoint.folder s3://bucket/run1 \\
        --override.imports ckpt.integrations.torchtitan.use_ckpt

What it does with what torchtitan calls:

- ``save(step, last_step)``: at ``interval``, the last step and (with
  ``enable_first_step_checkpoint``) step 1, the model (``ModelWrapper``'s flat FQNs;
  DTensors under FSDP/TP, each rank writing its shards), the optimizers'
  flat state, LR schedulers, dataloader and train state go to ckpt as one commit.
  The save is overlapped: ``maybe_wait_for_staging()``, which torchtitan calls right
  before the optimizer step, waits for ckpt's copy of the tensors; checksumming,
  upload and the commit run behind the next steps. One save is in flight at a time
  (the next waits for the previous commit), and the last step's is synchronous,
  as with torchtitan's DCP manager. ``last_save_model_only`` saves only the model,
  cast to ``export_dtype``.
- ``keep_latest_k`` is ckpt's retention (0 keeps all).
- ``load(step)``: the newest commit (or ``step``), loaded in place and resharded
  onto the mesh the job has now. Without a commit of its own, ``initial_load_path``
  (a ckpt URL, its newest commit) is loaded, the model only if
  ``initial_load_model_only``; ``exclude_from_loading`` and ``load_only`` as
  torchtitan defines them; step 0 (a seed checkpoint) is the model only.
- The dataloader's state is kept per data-parallel rank (torchtitan's own format):
  it loads onto the same data-parallel degree only, as with DCP; on another degree
  the load says so and tells how to leave it out.

Under ``ckpt launch`` with ``ckpt.elastic`` (survivors of a lost rank train on in
the same processes), the manager is built in ``train(ctx)`` with ``elastic=ctx``::

    def train(ctx):
        ...model parts on a mesh of ctx.world_size, optimizers, schedulers, dataloader...
        manager = CkptCheckpointManager.Config(
            enable=True, url=url, interval=500, exclude_from_loading=["dataloader"]
        ).build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=...,
                states={"train_state": train_state}, elastic=ctx)
        manager.load()
        while train_state.step < steps:
            ...one step (maybe_wait_for_staging before the optimizer step)...
            manager.save(train_state.step, last_step=train_state.step == steps)
            if ctx.stopping:
                break
        manager.close()

    ckpt.elastic.run(train, backend="gloo")

With it, ``save`` calls ``ctx.step(step)`` at every step (progress, and whether the
ranks agreed on a checkpoint: a stop or a regroup); an agreed step is saved in full
whatever the interval and its commit waited for, after which a regroup ends the
generation (``WorldChanged`` out of ``save``) and a stop makes ``ctx.stopping``
true, for the loop to end. Saves go through ``ctx.checkpointer`` (fenced by the
generation); ``load()`` is ``ctx.resume``: the newest commit, resharded onto this
generation's world, from the ranks' in-memory copies where they hold it. The
dataloader rule stays: after a lost rank the data-parallel degree differs, so an
elastic job leaves the dataloader out (``exclude_from_loading``) or its recovery
stops with that error.

Not supported yet: saving or loading Hugging Face safetensors (``last_save_in_hf``,
``initial_load_in_hf``), pipeline parallelism whose stages hold plain (non-DTensor)
tensors, torchtitan's ``async_mode`` (the saves are always overlapped),
torchtitan's ``Trainer`` class under ``ckpt.elastic`` (it builds its manager without
the context).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.override import derive, override
from torchtitan.tools import filesystem

import ckpt.torch
from ckpt import _native
from ckpt.integrations import _common

if TYPE_CHECKING:
    from ckpt.elastic import Context

log = logging.getLogger(__name__)

# In the manifest's metadata of a save that holds the model only.
_MODEL_ONLY = "torchtitan.model_only"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _as_url(location: str) -> str:
    return location if "://" in location else "file://" + os.path.abspath(location)


class CkptCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager over ckpt: see the module's doc."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        url: str | None = None
        """ckpt URL (s3://, gs://, az://, file://) the job saves to and resumes from.
        Default: ``folder`` under the dump folder (``folder`` may be a URL)."""

        retention_grace: float | None = None
        """Seconds a checkpoint that ``keep_latest_k`` supersedes stays readable
        before it is deleted (a job still loading it finishes); ckpt's default
        when unset (600)."""

        def __post_init__(self) -> None:
            # Slotted dataclasses: super() does not work here.
            BaseCheckpointManager.Config.__post_init__(self)
            if self.last_save_in_hf or self.initial_load_in_hf:
                raise ValueError(
                    "CkptCheckpointManager does not save or load Hugging Face safetensors yet: "
                    "unset checkpoint.last_save_in_hf and checkpoint.initial_load_in_hf"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        elastic: Context | None = None,
        **_unused: Any,
    ) -> None:
        # Set first: __del__ reads it, even after an __init__ that raised.
        self._elastic = elastic
        if elastic is not None and (not config.enable or config.load_only):
            raise ValueError(
                "under ckpt.elastic the manager must save (checkpoint.enable and not "
                "checkpoint.load_only): a stop or a regroup ends a generation at a commit"
            )
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: ckpt.torch.SaveHandle | None = None
        self._staging: ckpt.torch.SaveHandle | None = None
        self.url = _as_url(config.url or filesystem.join(base_folder, config.folder))
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.interval = config.interval
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        settings: dict[str, Any] = {}
        if config.keep_latest_k > 0:
            settings["keep_last"] = config.keep_latest_k
        if config.retention_grace is not None:
            settings["retention_grace"] = config.retention_grace
        if elastic is None:
            self._checkpointer = ckpt.torch.Checkpointer(self.url, **settings)
        else:
            # Fenced by the generation; its commits let waiting ranks in.
            self._checkpointer = elastic.checkpointer(self.url, **settings)
        log.info("checkpoints are saved to and loaded from %s", self.url)

    def __del__(self) -> None:
        if getattr(self, "_elastic", None) is not None:
            # A generation that ended (a lost rank) drops its manager: the commit in
            # flight may wait for that rank, and the next generation must not.
            return
        self.close()

    # -- saving -------------------------------------------------------------------

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        return (
            (step == 1 and self.enable_first_step_checkpoint)
            or last_step
            or step % self.interval == 0
        )

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # Under ckpt.elastic, every step: progress, and whether the ranks agreed on a
        # checkpoint now (a stop, or ranks waiting to join). Raises WorldChanged
        # when the generation is over.
        agreed = self._elastic is not None and self._elastic.step(curr_step)
        if not agreed and not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        metadata = {}
        # An agreed step is saved in full: the next generation resumes from it.
        if last_step and self.last_save_model_only and not agreed:
            model = self.states[MODEL].state_dict()
            state = {
                MODEL: {
                    k: v.to(self.export_dtype)
                    if torch.is_tensor(v) and v.is_floating_point()
                    else v
                    for k, v in model.items()
                }
            }
            metadata[_MODEL_ONLY] = True
        else:
            state = {k: v.state_dict() for k, v in self.states.items() if v is not None}
            # ModelWrapper's tensors are the live ones: a forward may write a buffer.
            state[MODEL] = _common.copy_buffers(self.states[MODEL].model, state[MODEL])
        handle = self._checkpointer.save(curr_step, state, metadata=metadata)
        if last_step or agreed:
            # At an agreed regroup this raises WorldChanged once committed: the
            # generation ends here. After a stop's commit, ctx.stopping is true.
            handle.wait_committed()
            return True
        self._staging = self.save_future = handle
        return True

    def _maybe_wait_for_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.wait_staged()

    def _wait_for_saving(self) -> None:
        pending, self.save_future = self.save_future, None
        self._staging = None
        if pending is not None:
            pending.wait_committed()

    def _close(self) -> None:
        try:
            if getattr(self, "save_future", None) is not None:
                self._wait_for_saving()
        finally:
            if getattr(self, "_checkpointer", None) is not None:
                self._checkpointer.close()
                self._checkpointer = None

    # -- loading ------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        url, model_only = self.url, False
        if self._elastic is not None:
            if step != -1:
                raise ValueError(
                    "under ckpt.elastic the manager loads the newest commit (ctx.resume): "
                    "unset --checkpoint.load_step"
                )
            if self._resume():
                return True
            step = None  # nothing committed yet: the initial load, if any
        elif step == -1:
            step = _common.newest_step(url)
        else:
            exists = _common.on_rank0(
                lambda: any(
                    c["step"] == step and c["committed"] for c in ckpt.torch.list_checkpoints(url)
                )
            )
            if not exists:
                raise FileNotFoundError(f"--checkpoint.load_step={step} not found at {url}")
        if step is None:
            if not self.initial_load_path:
                log.info("No checkpoint was provided, this is a fresh start.")
                return False
            url, model_only = _as_url(self.initial_load_path), self.initial_load_model_only
            step = _common.newest_step(url)
            if step is None:
                raise FileNotFoundError(f"checkpoint.initial_load_path {url} holds no commit")
        elif step == 0:
            model_only = True  # a seed checkpoint
        # The manifest first: whether it holds the model only, and every rank's
        # non-tensor state (the dataloader's is keyed by data-parallel rank).
        saved = ckpt.torch.load(url, {}, step=step, cooperative=True)
        model_only = model_only or bool(saved.metadata.get(_MODEL_ONLY))
        target = self._target(model_only)
        ckpt.torch.load(url, target, step=step, cooperative=True)
        self._put_back(target, saved.ranks)
        log.info("loaded step %d from %s%s", step, url, " (model only)" if model_only else "")
        return True

    def _resume(self) -> bool:
        """``ctx.resume``: the newest commit (every rank the same one), resharded,
        from the in-memory copies where the ranks hold it; False when there is none."""
        chosen: dict[str, Any] = {}

        def target() -> dict[str, Any]:
            # Called once ctx.resume chose the commit; nothing commits while every
            # rank of the job resumes, so the newest one is that commit.
            chosen["saved"] = saved = ckpt.torch.load(self.url, {}, cooperative=True)
            # Step 0 is a seed checkpoint; a last save may hold the model only.
            model_only = saved.step == 0 or bool(saved.metadata.get(_MODEL_ONLY))
            chosen["target"] = self._target(model_only)
            return chosen["target"]

        extra = self._elastic.resume(self.url, target)
        if extra is None:
            return False
        if extra.step != chosen["saved"].step:
            raise RuntimeError(
                f"{self.url}: ctx.resume loaded step {extra.step}, the manifest read was "
                f"step {chosen['saved'].step} (a commit landed during the resume)"
            )
        self._put_back(chosen["target"], extra.ranks)
        log.info(
            "resumed step %d from %s on %d ranks", extra.step, self.url, self._elastic.world_size
        )
        return True

    def _target(self, model_only: bool) -> dict[str, Any]:
        """The state dicts a load fills in place: the model's, and unless
        ``model_only`` every other state's not in ``exclude_from_loading``."""
        target = {MODEL: self.states[MODEL].state_dict()}
        if model_only:
            return target
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        target.update(
            {
                k: v.state_dict()
                for k, v in self.states.items()
                if k != MODEL and v is not None and k not in self.exclude_from_loading
            }
        )
        return target

    def _put_back(self, target: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
        """The loaded ``target`` into the live states, with the saved non-tensor
        values (``ranks``: every saved rank's)."""
        _fill_values(target, ranks, _rank())
        self.states[MODEL].load_state_dict(target[MODEL])
        for key, value in target.items():
            if key == MODEL:
                continue
            if key == DATALOADER:
                _check_dataloader(value, self.states[DATALOADER])
            self.states[key].load_state_dict(value)


def _fill_values(target: dict[str, Any], ranks: list[dict[str, Any]], rank: int) -> None:
    """The saved non-tensor values into ``target`` (see ``_common.fill_values``),
    and the dataloader's entries of the other data-parallel ranks (torchtitan keys
    them by rank and checks the degree)."""
    _common.fill_values(target, ranks, rank)
    loader = target.get(DATALOADER)
    if isinstance(loader, dict):
        prefix = DATALOADER + "."
        for values in ranks:
            for name, value in values.items():
                if name.startswith(prefix) and name[len(prefix) :] not in loader:
                    loader[name[len(prefix) :]] = value


def _check_dataloader(saved: dict[str, Any], dataloader: Any) -> None:
    degree = getattr(dataloader, "dp_world_size", None)
    if degree is not None and saved.get("world_size") not in (None, degree):
        raise _native.MismatchError(
            f"the dataloader's state was saved on {saved['world_size']} data-parallel ranks and "
            f"this job has {degree}: torchtitan's dataloader cannot be resharded; load without it "
            "(--checkpoint.exclude_from_loading dataloader) to start its data from the beginning"
        )


@override(
    target=BaseCheckpointManager.Config,
    description="checkpoints through ckpt (atomic object-store commits, CRC32-verified loads)",
)
def use_ckpt(
    config: BaseCheckpointManager.Config, url: str | None = None
) -> CkptCheckpointManager.Config:
    """``--override.imports ckpt.integrations.torchtitan.use_ckpt``: the job's
    checkpoint config as a ``CkptCheckpointManager.Config``, its policy fields
    kept; ``url`` (``'...use_ckpt={"url": "s3://..."}'``) or, by default,
    ``checkpoint.folder`` says where."""
    return derive(config, CkptCheckpointManager.Config, url=url)
