"""One rank of a torchtitan-shaped job on CPUs (started by torchrun): torchtitan's
own components (ModelWrapper through the manager, OptimizersContainer,
LRSchedulersContainer, ParallelAwareDataloader over a stateful dataset) around an
FSDP2-sharded model on a gloo mesh, driven the way torchtitan's Trainer drives its
checkpoint manager: ``load`` first, ``maybe_wait_for_staging`` before each
optimizer step, ``save(step, last_step)`` after it, ``close`` at the end.

torchtitan's Trainer itself needs CUDA (it sets the device before anything else);
this is everything of it that runs without one.

With ``--elastic`` the same loop runs under ``ckpt.elastic.run`` (started by ``ckpt
launch --min-ranks``), one ``train(ctx)`` per generation, the manager built with
``elastic=ctx``; rank 0 prints ``resumed step S on W ranks`` after each load.

    worker.py URL STEPS EVERY RECORD [--initial URL] [--exclude dataloader] [--elastic]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

import ckpt.elastic
from ckpt.integrations.torchtitan import CkptCheckpointManager

DIM = 12


class Samples(IterableDataset, Stateful):
    """This data-parallel rank's samples ``rank, rank + W, …``, resumable the way
    torchtitan's datasets are (a ``state_dict`` with the position)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.position = rank, world, 0
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(4096, DIM, generator=g)

    def __iter__(self):
        while True:
            i = self.rank + self.world * self.position
            self.position += 1
            yield {"idx": i, "x": self.x[i]}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class TrainState(Stateful):
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def train(args: argparse.Namespace, ctx: ckpt.elastic.Context | None = None) -> None:
    """The job on the process group's world, to ``args.steps``; under ckpt.elastic
    (``ctx``) one generation of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 30), nn.ReLU(), nn.Linear(30, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={
                    "lr": 1e-2,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                },
            )
        ],
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps
    )
    loader = ParallelAwareDataloader(
        Samples(rank, world), dp_rank=rank, dp_world_size=world, batch_size=4
    )
    train_state = TrainState()
    manager = CkptCheckpointManager.Config(
        enable=True,
        url=args.url,
        interval=args.every,
        keep_latest_k=0,
        last_save_model_only=False,
        initial_load_path=args.initial,
        initial_load_model_only=False,
        exclude_from_loading=args.exclude,
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=args.record,
        elastic=ctx,
    )
    record = Path(args.record)

    def dump(kind: str) -> None:
        full = StateDictOptions(full_state_dict=True)
        state = {
            "model": get_model_state_dict(model, options=full),
            "optim": {k: v for k, v in optimizers.state_dict().items() if k.startswith("state.")},
            "lr": schedulers.state_dict(),
            "train_state": train_state.state_dict(),
        }
        if rank == 0:
            # Optimizer moments are DTensors: whole tensors for the comparison.
            state["optim"] = {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in state["optim"].items()
            }
        else:
            for v in state["optim"].values():
                if hasattr(v, "full_tensor"):
                    v.full_tensor()  # a collective: every rank joins
        torch.save(state, record / f"{kind}-step{train_state.step}-rank{rank}.pt")

    if manager.load(step=-1):
        dump("loaded")
        if rank == 0:
            print(f"resumed step {train_state.step} on {world} ranks", flush=True)
    iterator = iter(loader)
    while train_state.step < args.steps:
        train_state.step += 1
        batch = next(iterator)
        with open(record / f"data-rank{rank}.jsonl", "a") as f:
            entry = {"epoch": 0, "step": train_state.step, "idx": batch["idx"].tolist()}
            f.write(json.dumps(entry) + "\n")
        if args.step_ms:
            time.sleep(args.step_ms / 1000)  # a step that computes longer, for the kills
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        last = train_state.step == args.steps
        if last or train_state.step % args.every == 0:
            dump("saved")
        manager.save(train_state.step, last_step=last)
        if rank == 0:
            print(f"step {train_state.step}", flush=True)
        if ctx is not None and ctx.stopping:
            break  # the agreed step is committed: this rank leaves
    manager.close()
    if rank == 0:
        print(f"done at step {train_state.step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("steps", type=int)
    p.add_argument("every", type=int)
    p.add_argument("record")
    p.add_argument("--initial")
    p.add_argument("--exclude", action="append", default=[])
    p.add_argument("--step-ms", type=int, default=0)
    p.add_argument("--elastic", action="store_true")
    args = p.parse_args()
    if args.elastic:
        ckpt.elastic.run(lambda ctx: train(args, ctx), backend="gloo")  # exits the process
    else:
        dist.init_process_group("gloo")
        train(args)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
