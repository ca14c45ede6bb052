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

Not supported yet: saving or loading Hugging Face safetensors (``last_save_in_hf``,
``initial_load_in_hf``), pipeline parallelism whose stages hold plain (non-DTensor)
tensors, torchtitan's ``async_mode`` (the saves are always overlapped).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

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
        **_unused: Any,
    ) -> None:
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
        self._checkpointer = ckpt.torch.Checkpointer(self.url, **settings)
        log.info("checkpoints are saved to and loaded from %s", self.url)

    def __del__(self) -> None:
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
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        metadata = {}
        if last_step and self.last_save_model_only:
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
        if last_step:
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
        if step == -1:
            step = _common.newest_step(url)
        else:
            exists = _common.on_rank0(
                lambda: any(c["step"] == step and c["committed"] for c in ckpt.torch.list(url))
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
        saved = ckpt.torch.load(url, {}, step=step)
        model_only = model_only or bool(saved.metadata.get(_MODEL_ONLY))
        target = {MODEL: self.states[MODEL].state_dict()}
        if not model_only:
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
        ckpt.torch.load(url, target, step=step)
        _fill_values(target, saved.ranks, _rank())
        self.states[MODEL].load_state_dict(target[MODEL])
        for key, value in target.items():
            if key == MODEL:
                continue
            if key == DATALOADER:
                _check_dataloader(value, self.states[DATALOADER])
            self.states[key].load_state_dict(value)
        log.info("loaded step %d from %s%s", step, url, " (model only)" if model_only else "")
        return True


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
