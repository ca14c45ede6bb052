"""A toy elastic training script for the memory tier's end-to-end tests (run by
``ckpt launch``): a DTensor of float64 rows sharded over the world, updated each
step by whole numbers that depend on the whole state (its global sum, one
all-reduce), so every value stays exact whatever the world size and the final
state is a pure function of the number of steps. A resume that lost or replayed a
step, or loaded any rank's rows wrong, ends with other values.

Every step: ``ctx.step(n)``, a store save every ``--every`` steps, a snapshot every
step (``ctx.snapshot``). ``--die R@S`` makes rank R of the first generation SIGKILL
itself after ``ctx.step(S)`` (which committed the snapshot of step S - 1) and
before its snapshot of S: a failure between store saves at a known point.

Rank 0 prints ``gen G: resumed step S (saved on W ranks) on N ranks`` or ``gen G:
from scratch on N ranks``, ``step S`` every step, and ``final w DIGEST``."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

ROWS = 1 << 16  # 512 KiB of float64 a world


def digest(rows: list[int]) -> str:
    """SHA-256 of the rows as little-endian float64."""
    import struct

    return hashlib.sha256(struct.pack(f"<{len(rows)}d", *rows)).hexdigest()


def expected(steps: int) -> str:
    """The digest of the final rows after ``steps`` steps (what any run, resumed or
    not, ends with): row i is i plus the same whole number for every row."""
    added = 0
    for step in range(1, steps + 1):
        g = ROWS * (ROWS - 1) // 2 + ROWS * added
        added += g % 13 + step
    return digest([i + added for i in range(ROWS)])


def train(ctx, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = ctx.rank, ctx.world_size
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.arange(ROWS, dtype=torch.float64), mesh, [Shard(0)])
    state = {"w": w, "data": {"cursor": 0}}

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    extra = ctx.resume(args.ckpt, state)
    start = 0
    if extra is not None:
        start = extra.step
        cursors = {r.get("data.cursor") for r in extra.ranks}
        if cursors != {start}:
            raise RuntimeError(f"resumed step {start}: saved cursors {cursors}")
        state["data"]["cursor"] = start
        log(
            f"gen {ctx.generation}: resumed step {start} (saved on {extra.world_size} ranks) "
            f"on {world} ranks"
        )
    else:
        log(f"gen {ctx.generation}: from scratch on {world} ranks")
    checkpointer = ctx.checkpointer(
        args.ckpt, **({"host_memory_budget": args.budget} if args.budget else {})
    )
    die_rank, die_step = (int(v) for v in args.die.split("@")) if args.die else (-1, -1)
    victims = {die_rank} | ({die_rank + 1} if args.neighbours else set())
    for step in range(start + 1, args.steps + 1):
        local = w.to_local()
        g = local.sum()
        dist.all_reduce(g)
        ctx.snapshot_staged()  # the last snapshot's copy is done: w may change
        with torch.no_grad():
            local += torch.remainder(g, 13) + step
        state["data"]["cursor"] = step
        asked = ctx.step(step)  # a stop or a regroup asks for a save now
        if ctx.generation == 1 and rank in victims and step == die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if asked or step % args.every == 0 or step == args.steps:
            checkpointer.save(step, state).wait_committed()
            log(f"step {step}: saved; host memory {ctx.host_bytes_held()['summary']}")
        if asked and ctx.stopping:
            checkpointer.close()
            return
        # Both ways: blocking, and overlapped until `snapshot_staged` above.
        ctx.snapshot(step, state, overlapped=step % 2 == 1)
        log(f"step {step}")
    checkpointer.close()
    full = w.full_tensor()
    log(f"final w {digest([int(v) for v in full.tolist()])}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--die", default="", help="R@S: rank R kills itself at step S")
    parser.add_argument("--neighbours", action="store_true", help="rank R + 1 dies too")
    parser.add_argument("--budget", type=int, default=0)
    args = parser.parse_args()
    from ckpt import elastic

    elastic.run(lambda ctx: train(ctx, args), backend="gloo")


if __name__ == "__main__":
    main()
