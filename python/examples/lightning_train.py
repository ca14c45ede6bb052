"""A PyTorch Lightning job that checkpoints through ckpt, on CPUs.

    torchrun --nproc_per_node 2 python/examples/lightning_train.py \\
        --ckpt file:///tmp/ckpt-lightning --steps 40

A small regression MLP on synthetic data (no download), DDP over gloo, or FSDP2
(``--strategy fsdp``: Lightning's ModelParallelStrategy, each Linear sharded over
the data-parallel ranks). Every ``--every`` steps ModelCheckpoint triggers a save,
which the strategy sends to ckpt; started again, with any number of processes, the
job resumes from the newest commit under ``--ckpt`` (or ``--resume-from``),
resharded, at the sample where the epoch stood.

``--record DIR`` writes what the integration tests compare: the samples of every
batch of every rank, and the whole model, optimizer and RNG state at each save and
right after the resume's load.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import DataLoader, Dataset

from ckpt.integrations.lightning import CkptDDPStrategy, CkptModelParallelStrategy


class Synthetic(Dataset):
    """``n`` samples of a noisy linear map, each with its index (to check that a
    resume neither skips nor repeats one)."""

    def __init__(self, n: int, dim: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(
        self, dim: int, hidden: int, lr: float, fsdp: bool, record: str | None, step_ms: int = 0
    ):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.lr, self.fsdp, self.record, self.step_ms = lr, fsdp, record, step_ms

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        idx, x, y = batch
        if self.record:
            self._write(
                f"data-rank{self.global_rank}.jsonl",
                {"epoch": self.current_epoch, "step": self.global_step, "idx": idx.tolist()},
            )
        if self.step_ms:
            time.sleep(self.step_ms / 1000)  # a step that computes longer, for the tests' kills
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    # -- what the tests compare ------------------------------------------------------

    def _write(self, name: str, entry: dict) -> None:
        with open(Path(self.record) / name, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _dump(self, kind: str, step: int) -> None:
        # Whole tensors (a collective under FSDP2: every rank calls it).
        full = StateDictOptions(full_state_dict=True)
        optimizer = self.trainer.optimizers[0]
        state = {
            "model": get_model_state_dict(self, options=full),
            "optim": get_optimizer_state_dict(self, optimizer, options=full),
            "rng": torch.get_rng_state(),
            "lr": self.trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        }
        torch.save(state, self._path(kind, step))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.record:
            self._dump("saved", checkpoint["global_step"])

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Model, optimizer and RNG are back; the LR schedulers come after.
        if self.record and "global_step" in checkpoint:
            self._resumed = step = checkpoint["global_step"]
            self._dump("loaded", step)
            torch.save(torch.get_rng_state(), self._path("rng", step))

    def on_train_start(self) -> None:
        if self.record and getattr(self, "_resumed", None) is not None:
            schedule = self.trainer.lr_scheduler_configs[0].scheduler.state_dict()
            torch.save(schedule, self._path("lr", self._resumed))

    def _path(self, kind: str, step: int) -> Path:
        return Path(self.record) / f"{kind}-step{step}-rank{self.global_rank}.pt"


class Progress(L.Callback):
    def __init__(self, every: int):
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            print(f"step {trainer.global_step} loss {float(outputs['loss']):.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="ckpt URL the job saves to")
    p.add_argument("--resume-from", help="ckpt URL to resume from (default: --ckpt)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-ms", type=int, default=0, help="extra time each step takes (tests)")
    p.add_argument("--record", help="a directory for the tests' records")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    L.seed_everything(0, verbose=False)
    if args.strategy == "fsdp":
        strategy = CkptModelParallelStrategy(
            args.ckpt, keep_last=args.keep_last, data_parallel_size=world, tensor_parallel_size=1
        )
    else:
        strategy = CkptDDPStrategy(args.ckpt, keep_last=args.keep_last)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=-1,
        callbacks=[ModelCheckpoint(every_n_train_steps=args.every), Progress(args.log_every)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.record or None,
    )
    model = Regressor(
        dim=12,
        hidden=30,
        lr=1e-2,
        fsdp=args.strategy == "fsdp",
        record=args.record,
        step_ms=args.step_ms,
    )
    loader = DataLoader(Synthetic(args.samples, 12), batch_size=args.batch_size, shuffle=True)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=args.resume_from or args.ckpt)
    # The last step, unless ModelCheckpoint just saved it.
    trainer.save_checkpoint("last", weights_only=False)
    if trainer.is_global_zero:
        print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
