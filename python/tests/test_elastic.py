"""PyTorch elastic recovery end to end: ``ckpt launch`` running
``python/examples/train_gpt.py`` (FSDP2, AdamW, gloo) as real processes, faults
injected with real signals, every run judged by the oracle:

- every commit verifies (``ckpt verify --all``) and none is lost (every periodic
  step up to the last is committed);
- no sample is skipped or repeated: every saved rank's data cursor at step ``s`` is
  ``s × batch``;
- the final weights and optimizer state are bitwise those of a failure-free
  reference that runs the same schedule: the world sizes the job trained with,
  each resumed from the same commit (fixed-world launches, no faults). Float sums
  differ across world sizes, not across runs of one schedule (``test_oracle.py``
  shows it), so a faulty run that lost or replayed anything would differ.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, ckpt_cli, need

import ckpt.torch
from ckpt import _native
from ckpt.torch import _api

# Whole elastic jobs (ckpt launch, heartbeats): nothing runs beside them
# (scripts/test runs the `serial` files one test at a time).
pytestmark = pytest.mark.serial

EXAMPLE = REPO / "python" / "examples" / "train_gpt.py"
STEPS = 60
EVERY = 10
BATCH = 24  # the example's default global batch


def _binary() -> str:
    binary = ckpt_cli()
    if binary is None:
        need("ckpt-cli", "no ckpt binary (set CKPT_BIN or cargo build -p ckpt-cli)")
    return binary


class Launch:
    """One `ckpt launch` of the example, its output collected line by line so that a
    test waits for what the job prints, never for time."""

    def __init__(
        self, url: str, nproc: int, *flags: str, steps: int = STEPS, script: tuple[str, ...] = ()
    ):
        command = [
            _binary(),
            "launch",
            "--nproc",
            str(nproc),
            *flags,
            "--",
            sys.executable,
            str(EXAMPLE),
            "--ckpt",
            url,
            "--steps",
            str(steps),
            "--ckpt-every",
            str(EVERY),
            "--log-every",
            "5",
            *script,
        ]
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<eof>")
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180, after: int = 0) -> re.Match:
        """The first line matching ``pattern`` (printed already, or next), from line
        ``after`` on (a `mark()`)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            seen = after
            while True:
                for line in self.lines[seen:]:
                    found = regex.search(line)
                    if found:
                        return found
                seen = len(self.lines)
                if "<eof>" in self.lines or time.monotonic() > deadline:
                    raise AssertionError(f"no line matches {pattern!r}:\n{self.text()}")
                self._changed.wait(deadline - time.monotonic())

    def pid(self, rank: int) -> int:
        return int(self.wait_for(rf"^launch: rank {rank} pid (\d+)$").group(1))

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise AssertionError(f"the job did not finish in {timeout} s:\n{self.text()}") from None
        self.wait_for("<eof>")
        return code

    def text(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def mark(self) -> int:
        """Where the output is now: `wait_for(..., after=mark)` sees only what follows."""
        with self._changed:
            return len(self.lines)

    def kill_all(self) -> None:
        """SIGKILL the launcher and every rank (a node lost whole)."""
        pids = [int(p) for p in re.findall(r"^launch: rank \d+ pid (\d+)", self.text(), re.M)]
        for pid in [self.process.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def schedule(*logs: str) -> list[tuple[int, int]]:
    """(first step, world size) of each generation, from rank 0's lines."""
    out = []
    for log in logs:
        for line in log.splitlines():
            resumed = re.search(
                r"gen \d+: resumed step (\d+) \(saved on \d+ ranks\) on (\d+) ranks", line
            )
            scratch = re.search(r"gen \d+: from scratch .* on (\d+) ranks", line)
            if resumed:
                out.append((int(resumed.group(1)), int(resumed.group(2))))
            elif scratch:
                out.append((0, int(scratch.group(1))))
    return out


def launches(plan: list[tuple[int, int]], steps: int = STEPS) -> list[tuple[int, int, int]]:
    """The fixed-world launches (start, until, world) that replay ``plan``: each world
    size from its first step to the next generation's; a generation that committed
    nothing new is left out, and generations in a row on one world are one launch (a
    resume on the same world continues bitwise as if never stopped: the replay
    checks that too)."""
    out: list[tuple[int, int, int]] = []
    for i, (start, world) in enumerate(plan):
        until = plan[i + 1][0] if i + 1 < len(plan) else steps
        if until <= start:
            continue
        if out and out[-1][2] == world and out[-1][1] == start:
            out[-1] = (out[-1][0], until, world)
        else:
            out.append((start, until, world))
    return out


def test_a_replay_is_one_launch_per_change_of_world():
    assert launches([(0, 4), (20, 3)]) == [(0, 20, 4), (20, 60, 3)]
    assert launches([(0, 4), (25, 4)]) == [(0, 60, 4)]
    assert launches([(0, 4), (20, 3), (20, 4), (40, 4)]) == [(0, 60, 4)]
    assert launches([(0, 2), (60, 3)]) == [(0, 60, 2)]


def reference(
    url: str, plan: list[tuple[int, int]], steps: int = STEPS, script: tuple[str, ...] = ()
) -> None:
    """The failure-free run of ``plan``, in fixed-world launches (``launches``)."""
    for _, until, world in launches(plan, steps):
        job = Launch(url, world, steps=until, script=script)
        assert job.finish() == 0, job.text()


# The replays judge() made in this session, by what decides their bits (the schedule,
# the steps, the script's flags): a replay is bitwise reproducible (what
# test_oracle.py shows), so a test whose job took a schedule already replayed is
# compared with that replay instead of paying a second one (several tests here end
# on the same one: 4 ranks, then 3 from step 20).
_REPLAYS: dict[tuple, str] = {}


def judge(
    url: str, reference_url: str, *logs: str, steps: int = STEPS, script: tuple[str, ...] = ()
) -> list[tuple[int, int]]:
    """The oracle; returns the schedule it checked."""
    plan = schedule(*logs)
    assert plan and plan[0] == (0, plan[0][1]), "\n".join(logs)
    commits = [e for e in ckpt.torch.list_checkpoints(url) if e["committed"]]
    steps_committed = sorted({e["step"] for e in commits})
    assert steps_committed[-1] == steps, steps_committed
    missing = set(range(EVERY, steps + 1, EVERY)) - set(steps_committed)
    assert not missing, f"periodic commits lost: {sorted(missing)}"
    verify = subprocess.run(
        [_binary(), "verify", "--all", url], capture_output=True, text=True, timeout=300
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    for step in steps_committed:
        reader = _native.Reader(url, step)
        decode = _api._decoder(json.loads(reader.metadata))
        cursors = {decode(*values["data.cursor"]) for _, values in reader.rank_states()}
        assert cursors == {step * BATCH}, f"step {step}: cursors {cursors}"
    replayed = (tuple(launches(plan, steps)), steps, script)
    if replayed not in _REPLAYS:
        reference(reference_url, plan, steps, script)
        _REPLAYS[replayed] = reference_url
    diff = subprocess.run(
        [_binary(), "diff", _REPLAYS[replayed], url], capture_output=True, text=True, timeout=300
    )
    assert diff.returncode == 0 and "identical" in diff.stdout, diff.stdout + diff.stderr
    return plan


@pytest.fixture
def urls(tmp_path: Path) -> tuple[str, str]:
    return f"file://{tmp_path / 'job'}", f"file://{tmp_path / 'reference'}"


def test_sigkill_mid_step_survivors_finish_on_three(urls):
    url, ref = urls
    job = Launch(url, 4, "--min-ranks", "2")
    job.wait_for(r"^\[rank 0\] step 25 loss")
    os.kill(job.pid(2), signal.SIGKILL)
    assert job.finish() == 0, job.text()
    text = job.text()
    assert "launch: recovery: generation 1 ended, generation 2 formed with world 3" in text
    # The same processes trained on: no rank was started again (4 pids in all), and
    # the first incarnations of local ranks 0, 1 and 3 finished.
    assert len(re.findall(r"^launch: rank \d+ pid", text, re.M)) == 4
    finished = set(re.findall(r"done: member (\S+) finished at step 60", text))
    assert finished == {"n0-l0-i0", "n0-l1-i0", "n0-l3-i0"}, text
    recovery = re.search(r"recovery: generation 2 world 3 .*back to training (\d+) ms", text)
    assert recovery, text
    # Rebuilt from the survivors' in-memory copies (the victim's rows from its
    # successor's replica), nothing read from the store.
    assert "rows from memory" in recovery.group(0), recovery.group(0)
    assert "from the store" not in recovery.group(0), recovery.group(0)
    plan = judge(url, ref, text)
    assert plan[0] == (0, 4) and plan[1] in ((10, 3), (20, 3)) and len(plan) == 2, plan


def test_sigkill_during_a_save(urls):
    url, ref = urls
    job = Launch(url, 4, "--min-ranks", "2")
    # The save of step 20 is in flight (copied, being written and committed). Step 20
    # is where the mid-step kill resumes too: when it commits, this job's replay is
    # that one (judge's cache).
    job.wait_for(r"^\[rank 0\] step 20: saving")
    os.kill(job.pid(1), signal.SIGKILL)
    assert job.finish() == 0, job.text()
    plan = judge(url, ref, job.text())
    assert [w for _, w in plan] == [4, 3]
    assert plan[1][0] in (10, 20), plan  # step 20 committed, or fell back to 10


def test_sigstop_is_dropped_by_heartbeat_fenced_and_killed(urls):
    url, ref = urls
    job = Launch(url, 4, "--min-ranks", "2", "--grace-secs", "1")
    job.wait_for(r"^\[rank 0\] step 25 loss")
    stopped = job.pid(2)
    os.kill(stopped, signal.SIGSTOP)
    job.wait_for(r"generation 2 formed with world 3 .*no heartbeat")
    assert job.finish() == 0, job.text()
    text = job.text()
    assert re.search(rf"rank 2 pid {stopped} still running .*state T: stopped.*SIGKILL", text)
    plan = judge(url, ref, text)
    assert [w for _, w in plan] == [4, 3]
    # Fenced: nothing of generation 1 was committed after the re-formation.
    later = [
        e for e in ckpt.torch.list_checkpoints(url) if e["committed"] and e["step"] > plan[1][0]
    ]
    assert later and all(e["dir"].endswith("-e2") for e in later), later


def test_sigcont_after_the_drop_leaves_as_stale(urls):
    url, ref = urls
    job = Launch(url, 4, "--min-ranks", "2")
    job.wait_for(r"^\[rank 0\] step 25 loss")
    stopped = job.pid(3)
    os.kill(stopped, signal.SIGSTOP)
    job.wait_for(r"^\[rank 0\] recovery: generation 2 world 3")
    os.kill(stopped, signal.SIGCONT)
    # It learns it is stale (and leaves), or, if its rendezvous comes first, joins again
    # as a new member at the next checkpoint; either way it writes nothing for its old
    # generation.
    job.wait_for(
        r"^\[rank 3\] member \S+: stale: this member's generation is over"
        r"|^launch: regroup: .* formed with world 4 "
    )
    assert job.finish() == 0, job.text()
    plan = judge(url, ref, job.text())
    later = [
        e for e in ckpt.torch.list_checkpoints(url) if e["committed"] and e["step"] > plan[1][0]
    ]
    # After the recovery the survivors commit as generation 2; once the woken rank has
    # joined again (the second path above), the four of them as the generation that
    # regroup formed. Nothing is ever committed for generation 1, the one it was
    # dropped from.
    rejoined = re.search(
        r"^launch: regroup: .* generation (\d+) formed with world 4 ", job.text(), re.M
    )
    generations = ("-e2", f"-e{rejoined[1]}") if rejoined else ("-e2",)
    assert all(e["dir"].endswith(generations) for e in later), later


def test_a_stale_member_whose_training_thread_stays_blocked_leaves_at_once():
    """Found by CI: a rank stopped inside a gloo all-gather, dropped, then continued,
    stayed blocked in it although the abort shut its sockets down; the watcher gave
    it ``STUCK_AFTER_ABORT`` (15 s), past the launcher's patience once the job ended.
    A stale member leaves whatever happens, so the watcher ends it after
    ``LEAVING_AFTER_ABORT``. Here the training thread never returns and the 15 s are
    made endless: only the stale path can end the process."""
    script = """
import threading
from ckpt.elastic import _watch

class Agent:
    def wait_abort(self, generation, timeout):
        return True

    def directive(self):
        return {"kind": "stale", "current": 2}

_watch.STUCK_AFTER_ABORT = 1e9
_watch.watch(Agent(), "n0-l3-i0", 1, "gloo", threading.Event(), {}, 0)
print("the watcher returned")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "member n0-l3-i0: stale: this member's generation is over" in done.stderr
    assert "still blocked; leaving now" in done.stderr


_TWO_RANKS = """
import datetime, sys, threading, time
import torch.distributed as dist
from ckpt.elastic import _watch

rank = int(sys.argv[1])
if rank == 0:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    print(store.port, flush=True)
else:
    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, is_master=False)
dist.init_process_group(
    "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600)
)
if rank == 1:
    time.sleep(600)  # never reaches the barrier

class Agent:  # aborted at once, by a restart: this rank survives the failure
    def wait_abort(self, generation, timeout):
        return True

    def directive(self):
        return {"kind": "restart", "generation": 1}

_watch.STUCK_AFTER_ABORT = 1e9
trainer = threading.get_ident()
threading.Thread(
    target=_watch.watch,
    args=(Agent(), "n0-l0-i0", 1, "gloo", threading.Event(), {}, trainer),
    daemon=True,
).start()
dist.barrier()  # the abort reaches no socket of it: wedged until the group's timeout
print("the barrier returned")
"""


def test_a_survivor_wedged_in_a_collective_exits_for_a_fresh_process():
    """Found by CI: after a peer's loss, a survivor's gloo all-gather kept waiting
    on connections gloo had already closed itself (nothing left for the abort to
    shut down) until the group's timeout, and the join timeout dropped the rank.
    The watcher sees the training thread still inside torch.distributed and exits
    with EXIT_WEDGED, which ``ckpt launch`` answers with a fresh process (tested in
    cli/tests/launch.rs). Here a real gloo barrier that the peer never reaches
    stands for the wedged collective."""
    from ckpt import elastic

    first = subprocess.Popen(
        [sys.executable, "-c", _TWO_RANKS, "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    port = first.stdout.readline().strip()
    second = subprocess.Popen(
        [sys.executable, "-c", _TWO_RANKS, "1", port],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out, err = first.communicate(timeout=120)
    finally:
        second.kill()
        first.kill()
    assert first.returncode == elastic.EXIT_WEDGED, (out, err)
    assert "still inside a collective" in err, err
    assert "the barrier returned" not in out


def test_an_abort_while_the_group_forms_ends_the_formation():
    """Found by the same CI run: survivors of a generation whose third rank never
    came (wedged in the one before) waited in init_process_group for the group's
    timeout (600 s) after the control plane had ended the generation, and the job
    shut down for want of ranks. The abort now shuts the store's connections down,
    which fails the formation at once; and the next generation forms with a fresh
    peer (a formation that failed inside init_process_group had advanced torch's
    group counter, so this rank named the next group differently from its peers and
    the formation deadlocked)."""
    script = r"""
import datetime, subprocess, sys, time
import torch.distributed as dist
from ckpt.elastic._group import form_group


store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
started = time.monotonic()

class Agent:  # rank 0 never shows up; the generation is aborted after a second
    def member(self):
        return {"host": "127.0.0.1"}

    def kv_get(self, key, timeout):
        return f"127.0.0.1:{store.port}"

    def wait_abort(self, generation, timeout):
        time.sleep(min(timeout, 0.05))
        return time.monotonic() - started > 1.0

a = {"rank": 1, "world_size": 2, "generation": 1}
try:
    form_group(Agent(), a, "gloo", datetime.timedelta(seconds=600))
    print("formed?!")
except Exception as e:
    print(f"raised after {time.monotonic() - started:.1f} s: {type(e).__name__}")

# The next generation, with a peer that is a fresh process: the failed formation
# must not have changed how this process names the group (torch's group counter).
PEER = (
    "import datetime, sys\n"
    "import torch, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, is_master=False)\n"
    "dist.init_process_group('gloo', store=dist.PrefixStore('ckpt-g2', store), rank=1,"
    " world_size=2, timeout=datetime.timedelta(seconds=60))\n"
    "dist.all_reduce(torch.zeros(1))\n"
)

class Next:
    def member(self):
        return {"host": "127.0.0.1"}

    def kv_set(self, key, value):
        self.peer = subprocess.Popen([sys.executable, "-c", PEER, value.rsplit(":", 1)[1]])

    def wait_abort(self, generation, timeout):
        time.sleep(timeout)
        return False

agent = Next()
a = {"rank": 0, "world_size": 2, "generation": 2}
form_group(agent, a, "gloo", datetime.timedelta(seconds=60))
print("the next generation formed")
agent.peer.wait(60)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    found = re.search(r"raised after ([\d.]+) s", done.stdout)
    assert found, (done.stdout, done.stderr)
    # Without the abort it would wait for the 600 s timeout.
    assert float(found.group(1)) < 120, done.stdout
    assert "the next generation formed" in done.stdout, (done.stdout, done.stderr)


def test_a_node_killed_whole_and_started_again_grows_back_to_four(urls, tmp_path):
    url, ref = urls
    from conftest import free_port

    rdzv = f"tcp://127.0.0.1:{free_port()}"
    common = ["--nnodes", "1:2", "--min-ranks", "2", "--job-id", "two-nodes", "--rdzv", rdzv]
    # Enough steps for node 1 to come back (a process and a torch import per rank)
    # while node 0 trains on: the world grew back at step 131 here, 4 s after the
    # kill, when 2 ranks train about 30 steps a second. Once it has, both nodes are
    # stopped (SIGTERM: an agreed step, saved), so that no step past that is paid
    # twice (the job and its replay).
    steps = 400
    node0 = Launch(url, 2, *common, "--node-id", "0", "--host-rdzv", steps=steps)
    node0.wait_for(r"coordinator 127\.0\.0\.1")
    node1 = Launch(url, 2, *common, "--node-id", "1", steps=steps)
    node0.wait_for(r"generation 1 formed with world 4")
    node0.wait_for(r"^\[rank 0\] step 25 loss")
    node1.kill_all()
    node0.wait_for(r"generation 2 formed with world 2")
    node0.wait_for(r"^\[rank 0\] recovery: generation 2 world 2")
    again = Launch(url, 2, *common, "--node-id", "1", steps=steps)
    # Its ranks join at the next checkpoints (together, or one at a time as each is
    # ready: a Python rank takes seconds to import torch).
    node0.wait_for(r"^launch: regroup: .* formed with world 4 ")
    node0.wait_for(r"^\[rank \d+\] gen \d+: resumed step \d+ .* on 4 ranks")
    for launcher in (node0, again):
        os.kill(launcher.process.pid, signal.SIGTERM)  # forwarded to its ranks
    assert node0.finish() == 75, node0.text()
    assert again.finish() == 75, again.text()
    stopped = re.findall(r"stopped at step (\d+) after a committed checkpoint", node0.text())
    stopped += re.findall(r"stopped at step (\d+) after a committed checkpoint", again.text())
    assert len(stopped) == 4 and len(set(stopped)) == 1, (node0.text(), again.text())
    plan = judge(url, ref, node0.text(), steps=int(stopped[0]))
    worlds = [w for _, w in plan]
    assert worlds[:2] == [4, 2] and worlds[-1] == 4 and set(worlds[2:-1]) <= {3}, plan


def test_sigterm_drains_at_an_agreed_step_and_the_job_resumes(urls):
    url, ref = urls
    job = Launch(url, 4, "--min-ranks", "2")
    job.wait_for(r"^\[rank 0\] step 25 loss")
    os.kill(job.process.pid, signal.SIGTERM)  # the launcher forwards it to every rank
    assert job.finish() == 75, job.text()
    text = job.text()
    stopped = re.findall(r"stopped at step (\d+) after a committed checkpoint", text)
    assert len(stopped) == 4 and len(set(stopped)) == 1, text
    agreed = int(stopped[0])
    assert ckpt.torch.latest(url)["step"] == agreed
    again = Launch(url, 4, "--min-ranks", "2")
    assert again.finish() == 0, again.text()
    plan = judge(url, ref, text, again.text())
    assert plan == [(0, 4), (agreed, 4)]


def test_a_stale_generation_cannot_commit_over_a_newer_one(tmp_path):
    """The fence ctx.checkpointer relies on: a save with an older generation's
    checkpoint generation and run id is refused once a newer generation committed."""
    import torch

    url = f"file://{tmp_path / 'fence'}"
    state = {"w": torch.arange(8.0)}
    newer = ckpt.torch.Checkpointer(url, rank=0, world_size=1, generation=2, run_id="job-e2")
    newer.save(20, state).wait_committed()
    newer.close()
    stale = ckpt.torch.Checkpointer(url, rank=0, world_size=1, generation=1, run_id="job-e1")
    with pytest.raises(ckpt.FencedError):
        stale.save(30, state).wait_committed()
    assert [e["step"] for e in ckpt.torch.list_checkpoints(url) if e["committed"]] == [20]


def test_a_fixed_world_drains_on_sigterm_too(urls):
    """Without elastic flags (torchrun's world), a stop still saves an agreed step."""
    url, _ = urls
    job = Launch(url, 2)
    job.wait_for(r"^\[rank 0\] step 15 loss")
    os.kill(job.pid(1), signal.SIGTERM)  # one rank only: both save and stop
    assert job.finish() == 75, job.text()
    agreed = {int(s) for s in re.findall(r"stopped at step (\d+)", job.text())}
    assert len(agreed) == 1 and ckpt.torch.latest(url)["step"] == agreed.pop(), job.text()


def test_a_transient_checkpoint_error_re_forms_the_world_instead_of_dropping_the_rank():
    """The chaos harness found it: a store that reset connections made a rank's
    wait_committed raise a transient StorageError, which used to count as a bug in the
    script (the rank left, the job fell under its minimum)."""
    from ckpt.elastic._ending import transient

    reset = ckpt.StorageError("list s3://b/step-30: connection reset by peer")
    reset.transient = True
    corrupt = ckpt.CorruptionError("step-30/0.safetensors: block 0 fails its CRC32")
    corrupt.transient = False
    assert transient(reset)
    assert not transient(corrupt)
    assert not transient(ValueError("a bug in the script"))


def test_finished_decides_the_exit_of_a_member_without_a_control_plane():
    """The chaos soak found it: a node started again after the job finished found
    no coordinator (it had exited with the job) and its ranks exited 1. The script's
    ``finished`` says whether the job is over; no answer, or a failed look, is no."""
    from ckpt.elastic._ending import over_without_us

    gone = ckpt.ElasticError("control plane unreachable: cannot reach the coordinator")
    assert over_without_us(lambda: True, gone)
    assert not over_without_us(lambda: False, gone)
    assert not over_without_us(None, gone)

    def broken() -> bool:
        raise ckpt.StorageError("list file:///nowhere: not found")

    assert not over_without_us(broken, gone)


def test_a_rank_that_moves_within_one_world_size_saves_its_own_shards(urls):
    """Found by the goodput run: local rank 1 was rank 0 of a world of 3, then, after
    a regroup to 4 and another loss, rank 1 of a world of 3; torch's sharding cache
    handed its state dict DTensors the older mesh, whose coordinate was rank 0's, and
    the save claimed rank 0's boxes (the commit refused the overlap)."""
    url, ref = urls
    # Steps enough for the second loss (near step 70 here) and, after it, for a wedged
    # survivor's fresh process to join at a commit: the job is stopped before its end.
    job = Launch(url, 4, "--min-ranks", "2", "--max-restarts", "1", steps=250)
    job.wait_for(r"^\[rank 0\] step 25 loss")
    os.kill(job.pid(0), signal.SIGKILL)  # local rank 1 becomes rank 0 of 3
    job.wait_for(r"^launch: regroup: .* formed with world 4 ")  # the relaunched one is back
    after = job.wait_for(
        r"^\[rank \d+\] gen \d+: resumed step (\d+) \(saved on \d+ ranks\) on 4 ranks"
    )
    job.wait_for(rf"^\[rank \d+\] step {(int(after.group(1)) // EVERY + 2) * EVERY}: saving")
    mark = job.mark()
    victim = re.findall(r"^launch: rank 2 pid (\d+)", job.text(), re.M)[-1]
    os.kill(int(victim), signal.SIGKILL)  # local rank 1 is rank 1 of 3 now
    # Once the world of 3 has committed a step of its own, the job is stopped: what
    # the test is about has happened, and every later step would be paid twice (the
    # job, then its replay). A wedged survivor's fresh process joins before that.
    on_three = job.wait_for(
        r"^\[rank \d+\] gen \d+: resumed step (\d+) \(saved on \d+ ranks\) on 3 ranks",
        after=mark,
    )
    job.wait_for(
        rf"^\[rank \d+\] step {(int(on_three.group(1)) // EVERY + 1) * EVERY}: saving", after=mark
    )
    os.kill(job.process.pid, signal.SIGTERM)
    # 75, not the 137 of the rank lost for good: the job survived that loss.
    assert job.finish() == 75, job.text()
    stopped = set(re.findall(r"stopped at step (\d+) after a committed checkpoint", job.text()))
    assert len(stopped) == 1, job.text()
    plan = judge(url, ref, job.text(), steps=int(stopped.pop()))
    widths = [w for _, w in plan]
    if "could not leave its process group" in job.text():
        # A survivor wedged in gloo after the second loss (EXIT_WEDGED): its fresh
        # process joins the world of the other two at their next commit.
        assert widths[:3] == [4, 3, 4] and widths[-1] == 3, (plan, job.text())
    else:
        assert widths == [4, 3, 4, 3], (plan, job.text())


def test_a_peer_lost_during_a_cooperative_resume_re_forms_and_loads_again(urls, monkeypatch):
    """A fresh start resumes cooperatively (no rank holds an in-memory copy): rank 0
    alone looks at the store, each byte is read once and passed between the ranks.
    Rank 2 dies between reading its share and sending it: the survivors name it,
    re-form on two ranks and load again, cooperatively, and train on."""
    url, _ = urls
    first = Launch(url, 3, steps=EVERY)
    assert first.finish() == 0, first.text()
    monkeypatch.setenv("CKPT_TEST_COOPERATIVE_EXIT", "2")
    job = Launch(url, 3, "--min-ranks", "2", steps=2 * EVERY)
    assert job.finish() == 0, job.text()
    text = job.text()
    assert "rank 2 died or stopped answering during the exchange" in text, text
    assert re.search(r"generation \d+ formed with world 2", text), text
    loaded = re.findall(rf"loaded step {EVERY}: cooperative: the job read ([\d.]+) MB", text)
    assert loaded, text
    assert f"finished at step {2 * EVERY}" in text, text
    verify = subprocess.run(
        [_binary(), "verify", "--all", url], capture_output=True, text=True, timeout=300
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
