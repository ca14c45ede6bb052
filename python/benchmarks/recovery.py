"""Recovery of a PyTorch job from a lost rank: ``ckpt launch`` (survivors go on in the
same processes) against ``torchrun --max-restarts 1`` (every worker restarted),
running the same script, ``python/examples/train_gpt.py`` (4 ranks, CPU, gloo), after
the same fault, in one run.

    python python/benchmarks/recovery.py [--reps 3] [--json] [--ckpt-bin target/release/ckpt]
    python python/benchmarks/recovery.py --goodput-minutes 10 --kill-every 120

Faults: SIGKILL of local rank 2 once rank 0 has printed step 30, and SIGSTOP of it.
Figures, per repetition (medians printed):

- ``detect_ms``: from the signal to the failure reaching the survivors (rank 0's
  ``noticed at``); ckpt only (torchrun does not say);
- ``abort_ms``, ``rendezvous_ms``, ``group_ms``, ``load_ms``, ``first_step_ms``: the
  parts of rank 0's ``recovery:`` line;
- ``to_training_ms``: from the signal to the first training step done after the
  recovery (rank 0's first ``step`` line of the new generation): comparable between
  the two launchers.

torchrun after a SIGSTOP waits for the process group's timeout: ``--hang-timeout``
(60 s) sets it for one measurement; with torch's default (1800 s) the run is watched
for ``--hang-cap`` seconds and reported as longer than that.

``--goodput-minutes M --kill-every S``: one elastic job for M minutes (launcher
``--max-restarts``, so killed ranks come back and the world grows again), SIGKILL of a
random rank every S seconds, then a stop; goodput is the training time of the steps
that survived into the final model over the wall time from the first step to the
last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "python" / "examples" / "train_gpt.py"
WORLD = 4
VICTIM = 2
AT_STEP = 30
STEP_LINE = re.compile(r"^\[?(?:rank 0\] )?step (\d+) loss")


class Job:
    """A launcher and its output, each line stamped with when it arrived."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None):
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append((time.time(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self.lines.append((time.time(), "<eof>"))
            self._changed.notify_all()

    def wait_for(self, pattern: str, after: float = 0.0, timeout: float = 600) -> tuple[float, str]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            seen = 0
            while True:
                for at, line in self.lines[seen:]:
                    if at >= after and regex.search(line):
                        return at, line
                seen = len(self.lines)
                if any(line == "<eof>" for _, line in self.lines[-1:]):
                    raise RuntimeError(f"no line matches {pattern!r}:\n{self.text()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(pattern)
                self._changed.wait(left)

    def text(self) -> str:
        with self._changed:
            return "\n".join(line for _, line in self.lines)

    def end(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _descendants(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _worker(root: int, local_rank: int) -> int:
    """The pid of torchrun's worker with ``LOCAL_RANK``."""
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"train_gpt.py" in cmdline and f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    raise RuntimeError(f"no worker with LOCAL_RANK={local_rank} under {root}")


def _script(
    url: str,
    steps: int,
    timeout: float | None = None,
    ckpt_every: int = 10,
    snapshot_every: int = 0,
    host_memory_budget: int = 0,
) -> list[str]:
    args = [str(EXAMPLE), "--ckpt", url, "--steps", str(steps), "--ckpt-every", str(ckpt_every)]
    args += ["--log-every", "1"]
    if snapshot_every:
        args += ["--snapshot-every", str(snapshot_every)]
    if host_memory_budget:
        args += ["--host-memory-budget", str(host_memory_budget)]
    if timeout is not None:
        args += ["--pg-timeout", str(timeout)]
    return args


def _first_step_after(job: Job, since: float) -> float:
    """When rank 0 finished the first step of the generation after ``since``."""
    resumed, _ = job.wait_for(r"gen \d+: resumed step", after=since)
    at, _ = job.wait_for(r"^(\[rank \d+\] )?step \d+ loss", after=resumed)
    return at


def ckpt_once(binary: str, fault: int, workdir: Path) -> dict[str, float]:
    url = f"file://{tempfile.mkdtemp(dir=workdir)}"
    job = Job(
        [binary, "launch", "--nproc", str(WORLD), "--min-ranks", "2", "--", sys.executable]
        + _script(url, AT_STEP + 40)
    )
    try:
        job.wait_for(rf"^\[rank 0\] step {AT_STEP} loss")
        _, line = job.wait_for(rf"^launch: rank {VICTIM} pid (\d+)")
        victim = int(line.rsplit(" ", 1)[1])
        signalled = time.time()
        os.kill(victim, fault)
        _, line = job.wait_for(r"\] recovery: generation", after=signalled, timeout=120)
        trained = _first_step_after(job, signalled)
        parts = {
            "noticed": r"noticed at (\d+) ms",
            "abort_ms": r"aborted \+(\d+) ms",
            "rendezvous_ms": r"rendezvous (\d+) ms",
            "group_ms": r"process group (\d+) ms",
            "load_ms": r"load (\d+) ms",
            "first_step_ms": r"first step (\d+) ms",
        }
        figures = {k: float(re.search(pattern, line).group(1)) for k, pattern in parts.items()}
        figures["detect_ms"] = figures.pop("noticed") - signalled * 1e3
        figures["to_training_ms"] = (trained - signalled) * 1e3
        return figures
    finally:
        job.end()


def torchrun_once(fault: int, workdir: Path, timeout: float, cap: float) -> dict[str, float]:
    url = f"file://{tempfile.mkdtemp(dir=workdir)}"
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    job = Job(
        [torchrun, "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts", "1"]
        + _script(url, AT_STEP + 40, timeout),
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        job.wait_for(rf"^step {AT_STEP} loss")
        victim = _worker(job.process.pid, VICTIM)
        signalled = time.time()
        os.kill(victim, fault)
        try:
            resumed, _ = job.wait_for(r"gen \d+: resumed step", after=signalled, timeout=cap)
        except TimeoutError:
            return {"still_blocked_after_s": cap}
        trained, _ = job.wait_for(r"^step \d+ loss", after=resumed)
        return {"to_training_ms": (trained - signalled) * 1e3}
    finally:
        job.end()


def goodput(
    binary: str,
    minutes: float,
    every: float,
    workdir: Path,
    seed: int,
    log: str | None,
    ckpt_every: int = 10,
    snapshot_every: int = 0,
    host_memory_budget: int = 0,
) -> dict:
    url = f"file://{tempfile.mkdtemp(dir=workdir)}"
    job = Job(
        [
            binary, "launch", "--nproc", str(WORLD), "--min-ranks", "2",
            "--max-restarts", "1000", "--", sys.executable,
        ]
        + _script(
            url, 10**7, ckpt_every=ckpt_every, snapshot_every=snapshot_every,
            host_memory_budget=host_memory_budget,
        )
    )  # fmt: skip
    rng = random.Random(seed)
    kills = []
    try:
        started, _ = job.wait_for(r"^\[rank 0\] step 1 loss")
        end = started + minutes * 60
        while time.time() + every < end:
            time.sleep(every)  # the schedule of the faults, not a wait for an event
            labels = sorted(set(re.findall(r"^launch: rank (\d+) pid", job.text(), re.M)))
            label = rng.choice(labels)
            pids = re.findall(rf"^launch: rank {label} pid (\d+)", job.text(), re.M)
            os.kill(int(pids[-1]), signal.SIGKILL)
            kills.append(time.time())
        time.sleep(max(0.0, end - time.time()))
        os.kill(job.process.pid, signal.SIGTERM)
        job.process.wait(timeout=300)
    finally:
        job.end()
    if log:
        Path(log).write_text(job.text() + "\n")
    # The final lineage: the last time each step was trained is the one that counts.
    # A step's time is from the previous step's line of the same generation; the first
    # step of a generation (after a rendezvous and a load) counts as a median step.
    steps: list[tuple[float, int]] = []
    durations: dict[int, float] = {}
    previous: tuple[float, int] | None = None
    for at, line in job.lines:
        if re.search(r"\] gen \d+: (resumed|from scratch)", line):
            previous = None
            continue
        found = re.match(r"^\[rank \d+\] step (\d+) loss", line)
        if not found:
            continue
        step = int(found.group(1))
        steps.append((at, step))
        if previous is not None and step == previous[1] + 1:
            durations[step] = at - previous[0]  # a re-trained step replaces its earlier time
        else:
            durations.pop(step, None)
        previous = (at, step)
    median = statistics.median(durations.values())
    last = steps[-1][1]
    useful = sum(durations.get(s, median) for s in range(2, last + 1))
    wall = steps[-1][0] - steps[0][0]
    recoveries = re.findall(r"back to training (\d+) ms", job.text())
    # Steps each kill lost: the newest step logged before it, minus the step the next
    # generation started from (a snapshot's, the store's, or 0: from scratch). The
    # script's own line ("gen N: resumed step S" / "gen N: from scratch") closes the
    # search; ckpt.elastic's "resumed from ..." before it names the tier.
    lost: list[int] = []
    tiers: list[str] = []
    for killed in kills:
        before = max((step for at, step in steps if at <= killed), default=0)
        tier = None
        for at, line in job.lines:
            if at <= killed:
                continue
            found = re.search(r"resumed from (snapshot )?step (\d+)", line)
            if found and tier is None:
                tier = "snapshot" if found.group(1) else "store"
            started = re.search(r"\] gen \d+: (resumed step (\d+)|from scratch)", line)
            if started:
                lost.append(before - int(started.group(2) or 0))
                tiers.append(tier if started.group(2) else "scratch")
                break
    return {
        "minutes": minutes,
        "ckpt_every": ckpt_every,
        "snapshot_every": snapshot_every,
        "host_memory_budget": host_memory_budget or None,
        "kills": len(kills),
        "lost_steps": lost,
        "resumed_from": tiers,
        "lost_steps_mean": statistics.mean(lost) if lost else None,
        "final_step": last,
        "median_step_s": median,
        "wall_s": wall,
        "useful_s": useful,
        "goodput": useful / wall,
        "back_to_training_ms": [int(r) for r in recoveries],
        # Rank 0's peak as its save lines logged it (ctx.host_bytes_held).
        "host_peak_mib_logged": max(
            map(float, re.findall(r"; peak ([\d.]+)", job.text())), default=None
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-bin", default=os.environ.get("CKPT_BIN") or shutil.which("ckpt"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hang-timeout", type=float, default=60.0)
    p.add_argument("--hang-cap", type=float, default=150.0)
    p.add_argument("--skip-default-hang", action="store_true")
    p.add_argument("--goodput-minutes", type=float)
    p.add_argument("--kill-every", type=float, default=120.0)
    p.add_argument("--ckpt-every", type=int, default=10, help="--goodput-minutes: store saves")
    p.add_argument(
        "--snapshot-every", type=int, default=0, help="--goodput-minutes: snapshots (0: none)"
    )
    p.add_argument(
        "--host-memory-budget", type=int, default=0, help="--goodput-minutes: bytes per rank"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", help="scratch directory (default: a temporary one)")
    p.add_argument("--log", help="--goodput-minutes: write the job's output here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not args.ckpt_bin:
        p.error("no ckpt binary: --ckpt-bin or CKPT_BIN")
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-recovery-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.goodput_minutes:
        report = goodput(
            args.ckpt_bin,
            args.goodput_minutes,
            args.kill_every,
            workdir,
            args.seed,
            args.log,
            args.ckpt_every,
            args.snapshot_every,
            args.host_memory_budget,
        )
        print(json.dumps(report, indent=1 if not args.json else None))
        return
    runs: dict[str, list[dict[str, float]]] = {}

    def note(name: str, figures: dict[str, float]) -> None:
        runs.setdefault(name, []).append(figures)
        print(f"{name}: {figures}", file=sys.stderr, flush=True)

    for rep in range(args.reps):
        print(f"repetition {rep + 1} of {args.reps}", file=sys.stderr, flush=True)
        note("ckpt_sigkill", ckpt_once(args.ckpt_bin, signal.SIGKILL, workdir))
        note("torchrun_sigkill", torchrun_once(signal.SIGKILL, workdir, 1800, args.hang_cap))
        note("ckpt_sigstop", ckpt_once(args.ckpt_bin, signal.SIGSTOP, workdir))
        note(
            "torchrun_sigstop_timeout",
            torchrun_once(signal.SIGSTOP, workdir, args.hang_timeout, args.hang_cap),
        )
    if not args.skip_default_hang:
        note(
            "torchrun_sigstop_default",
            torchrun_once(signal.SIGSTOP, workdir, 1800, args.hang_cap),
        )
    medians = {
        name: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        for name, reps in runs.items()
    }
    speedup = {
        "sigkill": medians["torchrun_sigkill"]["to_training_ms"]
        / medians["ckpt_sigkill"]["to_training_ms"],
        "sigstop_timeout": medians["torchrun_sigstop_timeout"]["to_training_ms"]
        / medians["ckpt_sigstop"]["to_training_ms"],
    }
    report = {"reps": args.reps, "medians": medians, "speedup": speedup, "runs": runs}
    if args.json:
        print(json.dumps(report))
        return
    for name, figures in medians.items():
        shown = ", ".join(f"{k} {v:.0f}" for k, v in figures.items())
        print(f"{name:26} {shown}")
    print(f"speed-up to training: {speedup}")


if __name__ == "__main__":
    main()
