"""What the framework integration tests share: jobs started with torchrun (real
processes, gloo), killed with SIGKILL at a moment they announce, and the checks of
a resume: the state loaded equals the state saved, bitwise; no sample skipped or
seen twice; every generator's state carried to the rank with the same number.

The examples' ``--record DIR`` writes, per rank ``r``:

- ``saved-step{S}-rank{r}.pt``: ``model``, ``optim`` (whole tensors), ``rng`` (torch's
  generator) and ``lr`` (the LR scheduler's state) when step ``S`` is saved;
- ``loaded-step{S}-rank{r}.pt``: ``model`` and ``optim`` right after a resume loaded
  step ``S``; ``rng-step{S}-rank{r}.pt`` and ``lr-step{S}-rank{r}.pt`` once the
  framework restored those;
- ``data-rank{r}.jsonl``: ``{"epoch", "step", "idx"}`` for every batch."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, need, run_cli

from ckpt.torch import latest

EXAMPLES = REPO / "python" / "examples"


def framework(module: str, capability: str = "frameworks"):
    """Imports a framework the tests need, or skips loudly (fails when required)."""
    try:
        return pytest.importorskip(module)
    except pytest.skip.Exception:
        need(capability, f"the {module} package (pip install './python[{module}]')")


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts each rank in a session of
    its own, so a kill of torchrun's process group misses them)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children[int(fields[1])].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Job:
    """``torchrun --standalone --nproc_per_node N script args``."""

    def __init__(self, script: Path, nproc: int, *args: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                str(script),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    def lines_until(self, predicate) -> str | None:
        """Reads the job's output line by line until ``predicate(line)``; None if
        the job ended first."""
        for line in self.proc.stdout:
            self.lines.append(line)
            if predicate(line):
                return line
        return None

    def kill(self) -> None:
        """SIGKILLs every process of the job at once, as a lost node would be."""
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)

    def finish(self, timeout: float = 600) -> str:
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines.append(out)
        text = "".join(self.lines)
        assert self.proc.returncode == 0, f"job failed ({self.proc.returncode}):\n{text[-6000:]}"
        return text


def example(script: Path, nproc: int, url: str, record: Path, *args: str) -> Job:
    """One of python/examples' jobs, saving to ``url`` and recording into ``record``."""
    record.mkdir(parents=True, exist_ok=True)
    return Job(script, nproc, "--ckpt", url, "--record", str(record), *args)


def kill_after_a_commit(job: Job, url: str, at_least: int) -> None:
    """Lets ``job`` train until a checkpoint of step ``at_least`` or later is
    committed under ``url`` (checked at each step it prints), then SIGKILLs it
    mid-run. Which commit is the newest is for the resumed job to find: a write the
    killed job had sent may still land in the store after the kill."""

    def committed(line: str) -> bool:
        if not line.startswith("step "):
            return False
        newest = latest(url)
        return newest is not None and newest["step"] >= at_least

    seen = job.lines_until(committed)
    assert seen is not None, "the job ended before a commit:\n" + "".join(job.lines)[-6000:]
    job.kill()


def loaded_step(record: Path) -> int:
    """The step a resumed job loaded, from the state it recorded after the load."""
    steps = {int(p.name.split("-")[1].removeprefix("step")) for p in record.glob("loaded-step*")}
    assert len(steps) == 1, f"one load expected, found {sorted(steps)}"
    return steps.pop()


def verify_all(url: str) -> None:
    result = run_cli("verify", "--all", url)
    assert result.returncode == 0, result.stdout + result.stderr


def assert_same_tensors(saved, loaded, where: str = "") -> None:
    """Equal structure and bitwise-equal tensors (same dtype and shape)."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(loaded, torch.Tensor), where
        assert saved.dtype == loaded.dtype and saved.shape == loaded.shape, where
        assert torch.equal(
            saved.view(torch.uint8) if saved.dtype == torch.bool else saved,
            loaded.view(torch.uint8) if loaded.dtype == torch.bool else loaded,
        ), where
    elif isinstance(saved, dict):
        assert isinstance(loaded, dict) and set(saved) == set(loaded), (where, saved, loaded)
        for k in saved:
            assert_same_tensors(saved[k], loaded[k], f"{where}.{k}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            assert_same_tensors(a, b, f"{where}[{i}]")
    else:
        assert saved == loaded, (where, saved, loaded)


def batches(record: Path) -> list[dict]:
    """Every batch the ranks recorded: ``{"rank", "epoch", "step", "idx"}``."""
    out = []
    for path in sorted(record.glob("data-rank*.jsonl")):
        rank = int(path.stem.removeprefix("data-rank"))
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the line a SIGKILL cut short
                continue
            out.append({"rank": rank, **entry})
    return out


def assert_each_sample_once(before: list[dict], after: list[dict], samples: int) -> int:
    """Every epoch the resumed job finished saw each sample exactly once, counting
    the batches the first job trained before the resumed step and those of the
    resumed job; returns how many epochs that covers."""
    last_epoch = max(b["epoch"] for b in after)
    checked = 0
    for epoch in range(last_epoch):  # the last one may be cut by the step limit
        seen = collections.Counter(
            i for b in before + after if b["epoch"] == epoch for i in b["idx"]
        )
        twice = sorted(i for i, n in seen.items() if n > 1)
        missing = sorted(set(range(samples)) - set(seen))
        assert not twice and not missing, (
            f"epoch {epoch}: samples seen twice {twice}, never seen {missing}"
        )
        checked += 1
    return checked


def assert_a_faithful_resume(
    first: Path, record: Path, nproc: int, saved_world: int, samples: int, every: int, steps: int
) -> int:
    """The checks of a job resumed (records in ``record``, ``nproc`` ranks) from a
    killed one (records in ``first``, ``saved_world`` ranks); returns the step."""
    step = loaded_step(record)
    assert every <= step < steps and step % every == 0
    # The state loaded at the resume is the state saved at that step, bitwise, on
    # every rank (a rank new after the scale-up included: its optimizer's settings
    # come from the checkpoint too).
    saved = torch.load(first / f"saved-step{step}-rank0.pt", weights_only=True)
    for rank in range(nproc):
        loaded = torch.load(record / f"loaded-step{step}-rank{rank}.pt", weights_only=True)
        assert_same_tensors(saved["model"], loaded["model"], f"rank {rank}: model")
        assert_same_tensors(saved["optim"], loaded["optim"], f"rank {rank}: optimizer")
        assert saved["lr"] == torch.load(record / f"lr-step{step}-rank{rank}.pt"), rank
    # Each rank with a number the saving world had continues its own generator.
    for rank in range(min(saved_world, nproc)):
        mine = torch.load(first / f"saved-step{step}-rank{rank}.pt", weights_only=True)["rng"]
        again = torch.load(record / f"rng-step{step}-rank{rank}.pt", weights_only=True)
        assert torch.equal(mine, again), f"rank {rank}'s RNG state"
    # No sample skipped or seen twice across the kill.
    before = [b for b in batches(first) if b["step"] < step]
    after = batches(record)
    assert min(b["step"] for b in after) == step
    assert {b["rank"] for b in after} == set(range(nproc))
    assert assert_each_sample_once(before, after, samples) >= 1
    return step
