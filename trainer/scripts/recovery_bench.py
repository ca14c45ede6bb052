#!/usr/bin/env python3
"""Recovery figures of docs/BENCHMARKS.md ("Elastic recovery").

For each fault (SIGKILL, SIGSTOP) and repetition: start an elastic 4-rank job of
`ckpt-train` (preset small by default), wait until it has committed a checkpoint and
trained a few more steps, hit rank 2, and read the recovery line that rank 0 of the new
generation prints (`recovery: generation G world W (...): noticed at T ms, aborted +A ms,
rendezvous R ms, ring B ms, load L ms, first step F ms; back to training X ms after the
failure was noticed`). Detection is the time from the fault to `noticed`.

In the same run, the baseline every current tool uses: kill every rank and start the
job again on 3 ranks from the newest checkpoint (what torchrun does on a failure), timed
from the fault to the first completed step of the restarted job.

    cargo build --release -p ckpt-trainer
    python3 trainer/scripts/recovery_bench.py [--reps 5] [--preset small] [--json out.json]
    python3 trainer/scripts/recovery_bench.py --goodput [--minutes 10 --kill-every 120]
        [--ckpt-every 100 --snapshot-every 5]
    cargo build --release -p ckpt-trainer --features etcd
    python3 trainer/scripts/recovery_bench.py --etcd etcd://H:P,H:P,H:P/bench [--reps 5]

Goodput: useful steps per second of an elastic job that loses one rank every two minutes
(relaunched by the launcher, so the world grows back), relative to the same job without
failures measured in the same session.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import queue

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "ckpt-train")
RECOVERY = re.compile(
    r"recovery: generation (\d+) world (\d+) \((.*)\): noticed at (\d+) ms, aborted \+(\d+) ms, "
    r"rendezvous (\d+) ms, ring (\d+) ms, load (\d+) ms, first step (\d+) ms; "
    r"back to training (\d+) ms"
)


class Job:
    """A launcher whose output lines arrive on a queue with their arrival time."""

    def __init__(self, args):
        self.proc = subprocess.Popen(
            [BIN, "launch"] + args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put((time.time(), line.rstrip("\n")))
        self.lines.put((time.time(), None))

    def expect(self, pattern, timeout=300):
        deadline = time.time() + timeout
        while True:
            try:
                at, line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise SystemExit(f"timed out waiting for {pattern!r}:\n" + "\n".join(self.seen[-40:]))
            if line is None:
                raise SystemExit(f"job ended before {pattern!r}:\n" + "\n".join(self.seen[-40:]))
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return at, m, line

    def pid(self, label):
        for line in reversed(self.seen):
            m = re.match(rf"launch: rank {label} pid (\d+)", line)
            if m:
                return int(m.group(1))
        raise SystemExit(f"no pid for rank {label}")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for line in reversed(self.seen):
            m = re.match(r"launch: .*process group (\d+)", line)
            if m:
                try:
                    os.killpg(int(m.group(1)), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait()


def train_args(ckpt, preset, steps, resume=False):
    args = ["--preset", preset, "--steps", str(steps), "--ckpt", f"file://{ckpt}",
            "--ckpt-every", "10", "--log-every", "1", "--keep", "2"]
    if resume:
        args.append("--resume")
    return args


def plane_args(etcd):
    """Launcher flags for the control plane: the hosted coordinator, or etcd."""
    if not etcd:
        return []
    return ["--rdzv", etcd, "--job-id", f"bench-{os.getpid()}-{time.time_ns()}"]


def elastic_once(fault, scratch, preset, steps, etcd=None):
    shutil.rmtree(scratch, ignore_errors=True)
    job = Job(["--nproc", "4", "--min-ranks", "3"] + plane_args(etcd) + ["--"]
              + train_args(scratch, preset, steps))
    try:
        job.expect(r"\] step 13 loss")
        pid = job.pid(2)
        t_fault = time.time()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        _, m, _ = job.expect(r"\] recovery: generation")
        m = RECOVERY.search(m.string)
        detect = int(m.group(4)) - t_fault * 1e3
        abort, rendezvous, ring, load, first = (float(m.group(i)) for i in range(5, 10))
        sources = [re.search(r"; rows (.*)\)$", l) for l in job.seen if "resumed from step" in l]
        return {
            "read_from": sources[-1].group(1) if sources and sources[-1] else "?",
            "detect_ms": detect,
            "abort_ms": abort,
            "rendezvous_ms": rendezvous,
            "ring_ms": ring,
            "load_ms": load,
            "first_step_ms": first,
            # Training again: the survivors start their first step at N-1.
            "to_training_ms": detect + abort + rendezvous + ring + load,
            "to_first_step_ms": detect + float(m.group(10)),
        }
    finally:
        if fault == "stop":
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, UnboundLocalError):
                pass
        job.kill()


def restart_once(scratch, preset, steps, fault="kill"):
    """The torchrun way: the launcher sees the failure and stops every rank; the job
    is started again on the surviving size and resumes from the newest checkpoint.
    A stopped (hung) rank is seen only when the survivors' collectives time out
    (`--timeout-secs`, 60 s by default), as NCCL's watchdog does, and the launcher
    kills it (it ignores SIGTERM while stopped) after its grace period (10 s)."""
    shutil.rmtree(scratch, ignore_errors=True)
    job = Job(["--nproc", "4", "--"] + train_args(scratch, preset, steps))
    job.expect(r"\] step 13 loss")
    pid = job.pid(2)
    t_fault = time.time()
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    try:
        job.proc.wait(timeout=600)
    finally:
        if fault == "stop":
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.kill()
    again = Job(["--nproc", "3", "--"] + train_args(scratch, preset, steps, resume=True))
    try:
        at_loaded, m, _ = again.expect(r"resumed from step (\d+)")
        resumed = int(m.group(1))
        at_step, _, _ = again.expect(rf"\] step {resumed + 1} loss")
        return {
            "to_training_ms": (at_loaded - t_fault) * 1e3,
            "to_first_step_ms": (at_step - t_fault) * 1e3,
        }
    finally:
        again.kill()


def last_step(job):
    """The highest step any rank logged so far (reads what arrived)."""
    step = getattr(job, "last_step", 0)
    while True:
        try:
            _, line = job.lines.get_nowait()
        except queue.Empty:
            break
        if line is None:
            break
        job.seen.append(line)
        m = re.search(r"\[rank \d+\] step (\d+) loss", line)
        if m:
            step = max(step, int(m.group(1)))
    job.last_step = step
    return step


RESUMED = re.compile(r"resumed from (snapshot )?step (\d+)")
START = re.compile(r"\] start: .* step (\d+) of ")


def goodput(scratch, preset, minutes, every, free_secs, ckpt_every=10, snapshot_every=0,
            budget=None):
    """Useful steps per second of an elastic 4-rank job that loses a rank every
    `every` seconds (relaunched: --max-restarts), relative to a failure-free run of the
    same job measured for `free_secs` in the same session; and the steps each kill
    lost: the newest step logged before the kill minus the step the next resume
    started from (a snapshot's or the store's)."""
    import random

    rng = random.Random(1)
    args = ["--preset", preset, "--steps", "100000000", "--log-every", "1", "--keep", "2",
            "--ckpt-every", str(ckpt_every)]
    if snapshot_every:
        args += ["--snapshot-every", str(snapshot_every)]
    if budget:
        args += ["--host-memory-budget", str(budget)]
    shutil.rmtree(scratch, ignore_errors=True)
    free = Job(["--nproc", "4", "--min-ranks", "2", "--"] + args + ["--ckpt", f"file://{scratch}"])
    free.expect(r"\] step 1 loss")
    t0 = time.time()
    s0 = last_step(free)
    time.sleep(free_secs)
    rate_free = (last_step(free) - s0) / (time.time() - t0)
    free.kill()
    shutil.rmtree(scratch, ignore_errors=True)
    job = Job(["--nproc", "4", "--min-ranks", "2", "--max-restarts", "100", "--"] + args
              + ["--ckpt", f"file://{scratch}"])
    job.expect(r"\] step 1 loss")
    t0 = time.time()
    s0 = last_step(job)
    kills = 0
    # (index in job.seen when the rank was killed, the newest step logged then)
    killed_at = []
    deadline = t0 + minutes * 60
    next_kill = t0 + every
    while time.time() < deadline:
        time.sleep(max(0.0, min(next_kill, deadline) - time.time()))
        last_step(job)
        if time.time() >= next_kill and time.time() < deadline:
            label = rng.randrange(4)
            killed_at.append((len(job.seen), last_step(job)))
            os.kill(job.pid(label), signal.SIGKILL)
            kills += 1
            print(f"goodput: killed rank {label} at {time.time() - t0:.0f} s", file=sys.stderr)
            next_kill += every
    steps = last_step(job) - s0
    wall = time.time() - t0
    job.kill()
    recoveries = sum(1 for l in job.seen if "launch: recovery: generation" in l)
    lost, tiers = [], []
    for at, step in killed_at:
        # The next generation's first line names the step it starts from, whether
        # it resumed (from a snapshot or the store) or started over.
        after = job.seen[at:]
        start = next((i for i, l in enumerate(after) if START.search(l)), None)
        if start is None:
            continue
        lost.append(step - int(START.search(after[start]).group(1)))
        resumed = next((RESUMED.search(l) for l in after[:start] if RESUMED.search(l)), None)
        tiers.append(("snapshot" if resumed.group(1) else "store") if resumed else "scratch")
    peaks = [int(m.group(1)) for m in (re.search(r"host_bytes_held .*\"peak\":(\d+)", l) for l in job.seen) if m]
    return {
        "minutes": minutes,
        "kill_every_s": every,
        "ckpt_every": ckpt_every,
        "snapshot_every": snapshot_every,
        "kills": kills,
        "recoveries": recoveries,
        "lost_steps": lost,
        "resumed_from": tiers,
        "lost_steps_mean": statistics.mean(lost) if lost else None,
        "lost_steps_max": max(lost) if lost else None,
        "failure_free_steps_per_s": rate_free,
        "steps_per_s": steps / wall,
        "goodput": (steps / wall) / rate_free,
        "host_peak_bytes_logged": max(peaks) if peaks else None,
    }


def etcd_metrics(etcd):
    """Messages every member of the etcd cluster received, per gRPC method, summed."""
    import urllib.request
    hosts = etcd[len("etcd://"):].split("/")[0].split(",")
    total = {}
    for host in hosts:
        text = urllib.request.urlopen(f"http://{host}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            m = re.match(r'grpc_server_msg_received_total\{.*grpc_method="(\w+)".*\} (\S+)', line)
            if m:
                total[m.group(1)] = total.get(m.group(1), 0) + float(m.group(2))
    return total


def request_rate(scratch, preset, etcd, secs):
    """Requests per second one agent sends etcd in steady state: a 4-rank job trains
    for `secs` seconds after its first checkpoint; the cluster's received-message
    counters before and after, over 4 agents (the launcher only watches)."""
    shutil.rmtree(scratch, ignore_errors=True)
    job = Job(["--nproc", "4"] + plane_args(etcd) + ["--"]
              + train_args(scratch, preset, 100000000))
    try:
        job.expect(r"\] step 13 loss")
        before, t0 = etcd_metrics(etcd), time.time()
        time.sleep(secs)
        after, t1 = etcd_metrics(etcd), time.time()
    finally:
        job.kill()
    per_method = {k: (after.get(k, 0) - before.get(k, 0)) / (t1 - t0) / 4 for k in after}
    per_method = {k: v for k, v in per_method.items() if v > 0}
    return {"per_agent_per_s": sum(per_method.values()), "by_method": per_method, "secs": t1 - t0}


def compare_backends(a):
    """Detection and re-formation on the hosted coordinator and on etcd, alternating
    in one run, and the steady-state request rate one agent puts on etcd."""
    runs = {f"{fault}_{plane}": [] for fault in ("kill", "stop") for plane in ("coordinator", "etcd")}
    for rep in range(a.reps):
        for fault in ("kill", "stop"):
            for plane, etcd in (("coordinator", None), ("etcd", a.etcd)):
                r = elastic_once(fault, a.scratch, a.preset, a.steps, etcd)
                runs[f"{fault}_{plane}"].append(r)
                print(f"rep {rep + 1} {fault} on {plane}: " + ", ".join(
                    f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), file=sys.stderr)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "read_from"}
        for name, rs in runs.items()
    }
    for fault in ("kill", "stop"):
        for key in ("detect_ms", "rendezvous_ms", "to_training_ms"):
            med[f"{fault}_etcd_over_coordinator_{key[:-3]}"] = (
                med[f"{fault}_etcd"][key] / max(med[f"{fault}_coordinator"][key], 1e-9))
    rate = request_rate(a.scratch, a.preset, a.etcd, a.rate_secs)
    print(json.dumps({"median": med, "request_rate": rate, "runs": runs}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": med, "request_rate": rate, "runs": runs}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--scratch", default="/tmp/ckpt-recovery-bench")
    ap.add_argument("--json")
    ap.add_argument("--goodput", action="store_true",
                    help="instead: goodput of a run with a kill every --kill-every seconds")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--kill-every", type=float, default=120)
    ap.add_argument("--free-secs", type=float, default=120)
    ap.add_argument("--ckpt-every", type=int, default=10, help="with --goodput: store saves every N steps")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="with --goodput: snapshots every N steps (0: store only)")
    ap.add_argument("--host-memory-budget", type=int, help="with --goodput: bytes per rank")
    ap.add_argument("--restart-stop", action="store_true",
                    help="instead: the full-restart baseline for a stopped (hung) rank")
    ap.add_argument("--etcd", metavar="URL",
                    help="instead: compare the hosted coordinator with etcd://HOST:PORT[,…]/PREFIX "
                         "(binary built with --features etcd), and measure one agent's request rate")
    ap.add_argument("--rate-secs", type=float, default=30)
    ap.add_argument("--rate-only", action="store_true",
                    help="with --etcd: only the steady-state request rate")
    a = ap.parse_args()
    if not os.path.exists(BIN):
        sys.exit(f"{BIN} missing: cargo build --release -p ckpt-trainer")
    if a.restart_stop:
        runs = [restart_once(a.scratch, a.preset, a.steps, fault="stop") for _ in range(a.reps)]
        for r in runs:
            print("full restart after a hang: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()), file=sys.stderr)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(json.dumps({"median": med, "runs": runs}, indent=1))
        return
    if a.etcd and a.rate_only:
        print(json.dumps(request_rate(a.scratch, a.preset, a.etcd, a.rate_secs), indent=1))
        return
    if a.etcd:
        compare_backends(a)
        return
    if a.goodput:
        print(json.dumps(goodput(a.scratch, a.preset, a.minutes, a.kill_every, a.free_secs,
                                 a.ckpt_every, a.snapshot_every, a.host_memory_budget), indent=1))
        return
    runs = {"kill": [], "stop": [], "restart": []}
    for rep in range(a.reps):
        for fault in ("kill", "stop"):
            r = elastic_once(fault, a.scratch, a.preset, a.steps)
            runs[fault].append(r)
            print(f"rep {rep + 1} {fault}: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()), file=sys.stderr)
        r = restart_once(a.scratch, a.preset, a.steps)
        runs["restart"].append(r)
        print(f"rep {rep + 1} full restart: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()), file=sys.stderr)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "read_from"}
        for name, rs in runs.items()
    }
    for fault in ("kill", "stop"):
        for key in ("to_training_ms", "to_first_step_ms"):
            med[fault][f"restart_over_elastic_{key[:-3]}"] = med["restart"][key] / med[fault][key]
    print(json.dumps({"median": med, "runs": runs}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"median": med, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
