"""The memory tier end to end: ``ckpt launch`` running ``snapshot_train.py`` (a
toy model whose every value is a whole number, so its final state is a pure
function of the step count, whatever the worlds and resumes) with a snapshot every
step and a store save every 10, ranks lost to a real SIGKILL between store saves:

- one rank lost: the survivors resume from the newest committed snapshot (the
  step before the failure), not the store's older commit, and finish bitwise;
- two ring neighbours lost: the snapshot is not covered (a file's owner and its
  replica's holder are gone), so the job resumes from the store commit.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO, ckpt_cli, need

pytestmark = pytest.mark.serial

SCRIPT = REPO / "python" / "tests" / "snapshot_train.py"
sys.path.insert(0, str(SCRIPT.parent))
from snapshot_train import expected  # noqa: E402

STEPS = 30


def launch(url: str, nproc: int, *script: str) -> str:
    binary = ckpt_cli()
    if binary is None:
        need("ckpt-cli", "no ckpt binary (set CKPT_BIN or cargo build -p ckpt-cli)")
    command = [
        binary,
        "launch",
        "--nproc",
        str(nproc),
        "--min-ranks",
        "1",
        "--",
        sys.executable,
        str(SCRIPT),
        "--ckpt",
        url,
        "--steps",
        str(STEPS),
        *script,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    return text


def final(text: str) -> str:
    found = re.findall(r"final w ([0-9a-f]{64})", text)
    assert found, text
    return found[-1]


def test_one_rank_lost_between_store_saves_resumes_from_the_snapshot(tmp_path):
    # A host memory budget of about 15 times a rank's share of the state (split
    # between the generation's checkpointer and the copies holder).
    text = launch(f"file://{tmp_path / 'job'}", 3, "--die", "1@15", "--budget", str(4_000_000))
    # Rank 1 died at step 15's boundary, whose vote committed the snapshot of step
    # 14 (13 when a replica was late for that vote, on a loaded machine): newer than
    # the store's step 10 either way.
    resumed = re.search(
        r"resumed from snapshot step (\d+) in memory \(snapshot step-\d+/g\d+-snap-\S+; saved "
        r"by 3 ranks, resharded onto 2; .*host memory .* held",
        text,
    )
    assert resumed, text
    step = int(resumed.group(1))
    assert step in (13, 14), resumed.group(0)
    assert re.search(rf"gen \d+: resumed step {step} \(saved on 3 ranks\) on 2 ranks", text), text
    assert "resuming from the store" not in text, text
    assert final(text) == expected(STEPS)
    # The store saves printed what the rank held: never past the budget.
    held = re.findall(
        r"step \d+: saved; host memory .* peak ([\d.]+) of a ([\d.]+) MiB budget", text
    )
    assert len(held) == 3, text
    assert all(float(peak) <= float(budget) for peak, budget in held), held


def test_two_ring_neighbours_lost_resume_from_the_store(tmp_path):
    url = f"file://{tmp_path / 'job'}"
    text = launch(url, 3, "--die", "1@15", "--neighbours")
    assert re.search(
        r"snapshot of step 1[34] passed over: no survivor holds the files of ranks 1 ", text
    ), text
    assert re.search(
        rf"resumed from step 10 of {re.escape(url)} \(saved by 3 ranks, resharded onto 1;", text
    ), text
    assert "resumed from snapshot" not in text, text
    assert final(text) == expected(STEPS)
