"""A Hugging Face Trainer job that checkpoints through ckpt, on CPUs.

    torchrun --nproc_per_node 2 python/examples/hf_trainer.py \\
        --ckpt file:///tmp/ckpt-hf --steps 40

A two-layer Llama built from a config (random weights, no download) learns
synthetic token sequences with DDP over gloo. Every ``--every`` steps the Trainer
saves, through ``CkptTrainer``, to ckpt; started again, with any number of
processes, it resumes from the newest commit under ``--ckpt`` (or
``--resume-from``), at the sample where the epoch stood.

``--record DIR`` writes what the integration tests compare: the samples of every
batch of every rank, and the whole model, optimizer and RNG state at each save and
right after the resume's load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, TrainerCallback, TrainingArguments

from ckpt.integrations.transformers import CkptTrainer


class Tokens(Dataset):
    """``n`` random sequences, each with its index (to check that a resume neither
    skips nor repeats one)."""

    def __init__(self, n: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "idx": i}


class RecordingTrainer(CkptTrainer):
    """Writes what the tests compare when ``record`` is set."""

    def __init__(self, *args, record: str | None = None, step_ms: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.record, self.step_ms = record, step_ms

    def compute_loss(self, model, inputs, *args, **kwargs):
        idx = inputs.pop("idx")
        if self.record:
            rank = self.args.process_index
            with open(Path(self.record) / f"data-rank{rank}.jsonl", "a") as f:
                entry = {"epoch": int(self.state.epoch or 0), "step": self.state.global_step}
                f.write(json.dumps({**entry, "idx": idx.tolist()}) + "\n")
        if self.step_ms:
            time.sleep(self.step_ms / 1000)  # a step that computes longer, for the tests' kills
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _path(self, kind: str) -> Path:
        rank = self.args.process_index
        return Path(self.record) / f"{kind}-step{self.state.global_step}-rank{rank}.pt"

    def _dump(self, kind: str, **extra) -> None:
        full = StateDictOptions(full_state_dict=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer.optimizer, options=full)
        torch.save({"model": model_sd, "optim": optim_sd, **extra}, self._path(kind))

    def _save_checkpoint(self, model, trial):
        if self.record:
            self._dump("saved", rng=torch.get_rng_state(), lr=self.lr_scheduler.state_dict())
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Model, optimizer and LR scheduler are back; the RNG comes at the first batch.
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.record and checkpoint is not None:
            self._dump("loaded")
            torch.save(self.lr_scheduler.state_dict(), self._path("lr"))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if self.record and checkpoint is not None:
            torch.save(torch.get_rng_state(), self._path("rng"))


class Progress(TrainerCallback):
    def __init__(self, every: int):
        self.every = every

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step % self.every == 0:
            print(f"step {state.global_step}", flush=True)


def collate(items: list[dict]) -> dict:
    return {
        "input_ids": torch.stack([x["input_ids"] for x in items]),
        "labels": torch.stack([x["labels"] for x in items]),
        "idx": torch.tensor([x["idx"] for x in items]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="ckpt URL the job saves to")
    p.add_argument("--resume-from", help="ckpt URL to resume from (default: --ckpt)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--step-ms", type=int, default=0, help="extra time each step takes (tests)")
    p.add_argument("--record", help="a directory for the tests' records")
    args = p.parse_args()
    if args.record:
        os.makedirs(args.record, exist_ok=True)

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    training = TrainingArguments(
        output_dir=args.record or tempfile.mkdtemp(prefix="hf-trainer-"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        save_strategy="steps",
        save_steps=args.every,
        save_total_limit=args.keep_last,
        learning_rate=1e-3,
        logging_steps=args.log_every,
        report_to="none",
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = RecordingTrainer(
        model=model,
        args=training,
        train_dataset=Tokens(args.samples, 16, config.vocab_size),
        data_collator=collate,
        callbacks=[Progress(args.log_every)],
        ckpt_url=args.ckpt,
        record=args.record,
        step_ms=args.step_ms,
    )
    trainer.train(resume_from_checkpoint=args.resume_from or True)
    if trainer.is_world_process_zero():
        print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
