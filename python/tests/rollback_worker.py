"""An elastic job for the rollback tests: a small linear model trained data-parallel
(plain tensors, the same on every rank, gradients averaged by an all-reduce), saved
every ``--every`` steps with the loss as a health metric, its data cursor beside the
tensors, and a rollback check on every step's loss.

The poison (environment): ``ROLLBACK_NAN_STEP=k`` writes a NaN into rank
``ROLLBACK_NAN_RANK``'s weight after the update of step ``k`` (before step ``k``'s
save, when there is one), once, or at every attempt of step ``k`` with
``ROLLBACK_NAN_EVERY_TIME=1``. ``ROLLBACK_MAX`` is ``run``'s ``max_rollbacks``.

Deterministic: the state after step ``n`` depends on the starting commit and ``n``
only (samples drawn from a generator seeded by their index, one intra-op thread, a
sum of two ranks' gradients), so a run that rolled back ends bitwise equal to one
that never saw the poison. Rank 0 writes the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import ckpt.elastic

BATCH = 8
WIDTH = 16


def samples(cursor: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``[cursor, cursor + count)``: inputs and their targets."""
    xs = [
        torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))
        for i in range(cursor, cursor + count)
    ]
    x = torch.stack(xs)
    return x, x.flip(1) * 0.5 + 0.25


def train(ctx: ckpt.elastic.Context, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDTH, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    poison_step = int(os.environ.get("ROLLBACK_NAN_STEP", "0"))
    poison_rank = int(os.environ.get("ROLLBACK_NAN_RANK", "1"))
    every_time = os.environ.get("ROLLBACK_NAN_EVERY_TIME") == "1"
    poisoned = False
    lo, hi = ctx.rank * BATCH // ctx.world_size, (ctx.rank + 1) * BATCH // ctx.world_size

    # model.state_dict()'s tensors are the parameters: a load writes them in place,
    # and the cursor in this dict.
    state = {"model": model.state_dict(), "data": {"cursor": 0}}
    extra = ctx.resume(args.ckpt, state)
    step = extra.step if extra is not None else 0
    if ctx.rank == 0:
        print(f"gen {ctx.generation}: start at step {step}", flush=True)
    # The parameters are plain tensors that data parallelism keeps the same on
    # every rank: ask for their copies to be compared.
    checkpointer = ctx.checkpointer(args.ckpt, compare_plain_tensors=True)
    while step < args.steps:
        x, y = samples(state["data"]["cursor"], BATCH)
        loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        bad, why = ctx.bad_loss(loss)
        if bad:
            print(f"[rank {ctx.rank}] step {step + 1} loss {loss.item()}", flush=True)
        if ctx.rollback_if(bad, why) is not None:
            step = ctx.restored.step
            continue
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world_size
        optimizer.step()
        step += 1
        state["data"]["cursor"] += BATCH
        if step == poison_step and ctx.rank == poison_rank and (every_time or not poisoned):
            poisoned = True
            with torch.no_grad():
                model.weight[0, 0] = float("nan")
            print(f"[rank {ctx.rank}] poisoned the weight after step {step}", flush=True)
        if ctx.step(step) or step % args.every == 0 or step == args.steps:
            checkpointer.save(step, state, health={"loss": loss.item()}).wait_committed()
            if ctx.stopping:
                return
    if ctx.rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        print(f"done at step {step}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    max_rollbacks = int(os.environ.get("ROLLBACK_MAX", "3"))
    ckpt.elastic.run(lambda ctx: train(ctx, args), backend="gloo", max_rollbacks=max_rollbacks)


if __name__ == "__main__":
    main()
