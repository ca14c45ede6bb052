"""One rank of a job that uses Accelerate's ``save_state``/``load_state`` through
``CkptAccelerator`` (started by torchrun, gloo on CPUs).

    accelerate_worker.py save URL RECORD   trains 4 steps, saves at step 3, trains on
    accelerate_worker.py load URL RECORD   loads the newest commit

Each writes what the test compares: the whole model and optimizer state, the
scheduler's and the registered object's state, ``accelerator.step`` and the RNG.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckpt.integrations.accelerate import CkptAccelerator


class Counter:
    """A user object registered for checkpointing."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def main() -> None:
    mode, url, record = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    record.mkdir(parents=True, exist_ok=True)
    accelerator = CkptAccelerator(cpu=True, ckpt_url=url)
    torch.manual_seed(0)
    # BatchNorm: a buffer each forward writes, beside the save's copy.
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counter = Counter()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(counter)
    rank = accelerator.process_index

    def dump(kind: str) -> None:
        full = StateDictOptions(full_state_dict=True)
        inner = accelerator.unwrap_model(model)
        model_sd, optim_sd = get_state_dict(inner, optimizer.optimizer, options=full)
        state = {
            "model": model_sd,
            "optim": optim_sd,
            "lr": scheduler.state_dict(),
            "counter": counter.state_dict(),
            "step": accelerator.step,
            "rng": torch.get_rng_state(),
        }
        torch.save(state, record / f"{kind}-rank{rank}.pt")

    if mode == "load":
        accelerator.load_state()
        dump("loaded")
        return
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 5):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.seen += 16
        accelerator.step = step
        if step == 3:
            dump("saved")
            accelerator.save_state(step=step)
    accelerator.end_training()


if __name__ == "__main__":
    main()
