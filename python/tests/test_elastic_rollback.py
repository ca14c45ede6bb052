"""Rollback on a bad step, and resumes from the newest healthy commit, in real
``ckpt launch`` elastic jobs (2 ranks, gloo) of ``rollback_worker.py``: a linear
model trained data-parallel, saved every 4 steps with its loss as a health metric,
a NaN written into one rank's weight at a step chosen by the environment.

The oracle is a run that never saw the NaN: the worker is deterministic, so a job
that rolled back to the newest healthy commit and trained on ends with the same
bits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, ckpt_cli, need

import ckpt.torch
from ckpt.elastic._context import _no_healthy
from ckpt.elastic._rollback import RollbackLoop, Rollbacks, bad_loss, rolled_run_id

# Whole elastic jobs (ckpt launch, heartbeats): nothing runs beside them.
pytestmark = pytest.mark.serial

WORKER = REPO / "python" / "tests" / "rollback_worker.py"


def launch(url: str, out: Path, steps: int = 12, **env: str) -> subprocess.CompletedProcess:
    """One elastic job of the worker to ``steps``, its output (both streams) whole."""
    binary = ckpt_cli()
    if binary is None:
        need("ckpt-cli", "no ckpt binary (set CKPT_BIN or cargo build -p ckpt-cli)")
    command = [binary, "launch", "--nproc", "2", "--min-ranks", "2", "--"]
    command += [sys.executable, str(WORKER), "--ckpt", url, "--out", str(out)]
    command += ["--steps", str(steps)]
    return subprocess.run(
        command,
        # The ranks import ckpt as this process does (the installed package, or the
        # PYTHONPATH the suite runs under).
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def bitwise_equal(a: Path, b: Path) -> None:
    left, right = torch.load(a), torch.load(b)
    assert left.keys() == right.keys()
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        assert torch.equal(left[name].view(torch.uint8), right[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The final weights of a job that never saw the NaN."""
    where = tmp_path_factory.mktemp("reference")
    job = launch(f"file://{where / 'ckpt'}", where / "final.pt")
    assert job.returncode == 0, job.stdout
    assert "rolled back" not in job.stdout, job.stdout
    return where / "final.pt"


def test_a_nan_rolls_the_job_back_to_the_newest_healthy_commit(tmp_path, reference):
    # The NaN lands on rank 1's copy after step 8's update: step 8's save carries
    # it, step 9's loss shows it, and the job goes back to step 4.
    url = f"file://{tmp_path / 'ckpt'}"
    job = launch(url, tmp_path / "final.pt", ROLLBACK_NAN_STEP="8", ROLLBACK_NAN_RANK="1")
    assert job.returncode == 0, job.stdout
    assert "[rank 1] step 9 loss nan" in job.stdout, job.stdout
    assert re.search(r"passing over unhealthy step 8 \(step-00000008/\S+\): .*rank 1", job.stdout)
    assert "rolled back from step 9 to step 4: rank 1: loss is nan" in job.stdout, job.stdout
    assert len(re.findall("rolled back", job.stdout)) == 1, job.stdout
    # Step 8 committed twice: the poisoned save, unhealthy, and the one after the
    # rollback, healthy, under a run id of its own.
    eights = [e for e in ckpt.torch.list_checkpoints(url) if e["step"] == 8 and e["committed"]]
    assert len(eights) == 2, eights
    assert eights[1]["dir"].endswith("-r1"), eights
    assert ckpt.torch.health(url, 12)["healthy"] is True
    bitwise_equal(tmp_path / "final.pt", reference)


def test_a_poison_at_every_attempt_stops_the_job_and_a_restart_passes_over_its_commits(
    tmp_path, reference
):
    # The NaN comes back at every attempt of step 8: each save of step 8 is
    # unhealthy, step 9 asks for a rollback to step 4 each time, and the third
    # time (max_rollbacks 2) every rank stops with RollbackLoop.
    url = f"file://{tmp_path / 'ckpt'}"
    job = launch(
        url,
        tmp_path / "final.pt",
        ROLLBACK_NAN_STEP="8",
        ROLLBACK_NAN_EVERY_TIME="1",
        ROLLBACK_MAX="2",
    )
    assert job.returncode != 0, job.stdout
    assert len(re.findall(r"\[rank 0\] rolled back from step 9 to step 4", job.stdout)) == 2
    loop = "RollbackLoop: step 9 asked for a rollback to step 4 for the 3rd time in a row"
    assert len(re.findall(loop, job.stdout)) == 2, job.stdout  # one line per rank
    assert not (tmp_path / "final.pt").exists()
    assert ckpt.torch.latest(url, healthy=False)["step"] == 8
    assert ckpt.torch.health(url, 8)["healthy"] is False
    assert ckpt.torch.latest(url)["step"] == 4
    # A restart (no poison now) passes over the three unhealthy saves of step 8,
    # resumes from step 4 and ends where a job that never saw the NaN ends.
    job = launch(url, tmp_path / "final.pt")
    assert job.returncode == 0, job.stdout
    passed = re.findall(
        r"passing over unhealthy step 8 \(step-00000008/\S+\): .*rank 1", job.stdout
    )
    assert len(passed) == 3, job.stdout
    assert "gen 1: start at step 4" in job.stdout, job.stdout
    assert "rolled back" not in job.stdout
    bitwise_equal(tmp_path / "final.pt", reference)


def test_rollbacks_in_a_row_count_to_one_commit_until_a_commit_past_the_step():
    rollbacks = Rollbacks(2)
    assert rollbacks.count(9, 4, "r") == 1
    rollbacks.committed(8)  # before the step that asked: still in a row
    assert rollbacks.count(9, 4, "r") == 2
    with pytest.raises(RollbackLoop, match="step 9 .* to step 4 for the 3rd time"):
        rollbacks.count(9, 4, "r")
    rollbacks = Rollbacks(1)
    assert rollbacks.count(9, 4, "r") == 1
    rollbacks.committed(12)  # got past it
    assert rollbacks.count(15, 12, "r") == 1
    assert rollbacks.count(13, 8, "r") == 1  # another commit: a new count


def test_bad_loss_and_rolled_run_ids():
    assert bad_loss(float("nan")) == (True, "loss is nan")
    assert bad_loss(torch.tensor(float("inf")))[0]
    assert bad_loss(1.0, spike=2.0, previous=0.4)[0]
    assert bad_loss(1.0, spike=2.0, previous=0.6) == (False, "")
    assert bad_loss(1.0, spike=lambda v: "too high" if v > 0.5 else None) == (True, "too high")
    assert rolled_run_id("job-e3", 2) == "job-e3-r2"
    long = rolled_run_id("j" * 46 + "-e3", 1)
    assert len(long) == 48 and long.endswith("-r1") and long != rolled_run_id("k" * 46 + "-e3", 1)


def test_a_root_of_unhealthy_commits_only_is_said_to_have_none_healthy(tmp_path, capsys):
    url = f"file://{tmp_path / 'ckpt'}"
    with ckpt.torch.Checkpointer(url, rank=0, world_size=1) as saver:
        saver.save(4, {"w": torch.tensor([1.0, float("nan")])}).wait_committed()
    assert ckpt.torch.latest(url) is None
    _no_healthy(url, None)
    said = capsys.readouterr().out
    assert said.startswith("no healthy commit under ") and "(step 4)" in said, said
    assert 'tensor "w" holds 1 non-finite element' in said, said
