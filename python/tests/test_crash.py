"""A rank process SIGKILLed in the middle of a save: nothing is committed, and the
previous step loads."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import torch
from conftest import run_cli

from ckpt.torch import latest, load

# One rank of a 2-rank world: its dim-0 shard of "w" as a DTensor, saved natively.
SAVE = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from ckpt.torch import Checkpointer
    url, store, rank, step, rows, wait = sys.argv[1:7]
    rank, step, rows = int(rank), int(step), int(rows)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store}")
    mesh = init_device_mesh("cpu", (2,))
    shard = torch.full((rows, 1024), float(step * 10 + rank))
    w = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)
    c = Checkpointer(url, run_id=f"crash-{step}")
    handle = c.save(step, {"w": w})
    print("saving", flush=True)
    getattr(handle, wait)()
    print("done", flush=True)
    """
)


def start(url: str, store: str, rank: int, step: int, rows: int, wait: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SAVE, url, store, str(rank), str(step), str(rows), wait],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rank_killed_mid_save_leaves_nothing_committed_and_the_previous_step_loads(
    root, tmp_path
):
    # Step 1: both ranks save and it commits.
    first = [start(root, str(tmp_path / "s1"), r, 1, 64, "wait_committed") for r in (0, 1)]
    for p in first:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert latest(root)["step"] == 1

    # Step 2: rank 0's part becomes durable; rank 1 is killed while its 256 MiB save
    # is being staged and written.
    survivor = start(root, str(tmp_path / "s2"), 0, 2, 64 * 1024, "wait_durable")
    victim = start(root, str(tmp_path / "s2"), 1, 2, 64 * 1024, "wait_committed")
    assert victim.stdout.readline().strip() == "saving"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    out, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, err

    assert latest(root)["step"] == 1
    into = {"w": torch.zeros(128, 1024)}
    extra = load(root, into)
    assert extra.step == 1
    assert torch.all(into["w"][:64] == 10.0) and torch.all(into["w"][64:] == 11.0)
    verified = run_cli("verify", root)
    assert verified.returncode == 0, verified.stdout + verified.stderr
