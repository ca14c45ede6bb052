"""torchtitan's checkpoint manager over ckpt, with torchtitan from PyPI.

torchtitan's Trainer needs CUDA (scripts/gpu-check runs it on a GPU); here its
components run on CPUs (tests/titan_worker.py). Under torchrun: a job on 2 ranks
saving to the S3 server is SIGKILLed mid-run, then resumed on 2 ranks (model,
optimizer, LR schedule, dataloader and train state carried); on 3, the load refuses
torchtitan's dataloader, which cannot be resharded. Under ``ckpt launch --min-ranks``
with ``ckpt.elastic``: one rank of 3 is SIGKILLed and the 2 survivors recover in
their processes, everything but the dataloader resharded onto them; a stop (SIGTERM)
commits the step the ranks agree on, outside the interval, and ends the loop. The
manager's policies (interval, last step, keep_latest_k, load_only, initial load, step
0, exclude_from_loading) are checked in one process, as torchtitan's own checkpoint
tests check its DCP manager's."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ckpt_cli, need
from frameworks import (
    Job,
    assert_same_tensors,
    batches,
    framework,
    kill_after_a_commit,
    loaded_step,
    verify_all,
)

from ckpt.torch import latest, list_checkpoints

WORKER = Path(__file__).with_name("titan_worker.py")
STEPS, EVERY, BATCH = 20, 5, 4
WORKER_FLAGS = ("--step-ms", "100")  # a step that computes longer, for the kills


def run(nproc: int, url: str, record: Path, *extra: str) -> Job:
    record.mkdir(parents=True, exist_ok=True)
    return Job(WORKER, nproc, url, str(STEPS), str(EVERY), str(record), *WORKER_FLAGS, *extra)


class Elastic(Job):
    """The worker under ckpt.elastic: ``ckpt launch --nproc N --min-ranks 2`` of it
    (which prefixes each rank's lines with ``[rank R]``), or without ``nproc`` one
    process alone (ckpt.elastic's fixed world of one)."""

    def __init__(self, url: str, record: Path, *extra: str, nproc: int = 0, every: int = EVERY):
        record.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, str(WORKER), url, str(STEPS), str(every), str(record)]
        command += [*WORKER_FLAGS, "--elastic", *extra]
        if nproc:
            binary = ckpt_cli()
            if binary is None:
                need("ckpt-cli", "no ckpt binary (set CKPT_BIN or cargo build -p ckpt-cli)")
            command = [binary, "launch", "--nproc", str(nproc), "--min-ranks", "2", "--", *command]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        )


@pytest.mark.serial
def test_survivors_of_a_killed_rank_recover_in_their_processes_under_ckpt_elastic(
    s3_base, tmp_path
):
    framework("torchtitan")
    url, record = f"{s3_base}/titan-elastic", tmp_path / "elastic"
    # Every generation's dataloader lives on another data-parallel degree: left out.
    job = Elastic(url, record, "--exclude", "dataloader", nproc=3)

    def committed(line: str) -> bool:
        return (
            bool(re.match(r"\[rank \d+\] step \d+$", line))
            and (latest(url) or {}).get("step", 0) >= EVERY
        )

    assert job.lines_until(committed), "no commit:\n" + "".join(job.lines)[-6000:]
    victim = re.search(r"^launch: rank 2 pid (\d+)$", "".join(job.lines), re.M)
    os.kill(int(victim.group(1)), signal.SIGKILL)
    out = job.finish()

    # The survivors trained on in the processes they started in: 3 processes in all.
    assert len(re.findall(r"^launch: rank \d+ pid", out, re.M)) == 3, out
    # A survivor's failed collective may restart the generation on 3 before the
    # launcher reaps the victim: the world of 2 is then the next one.
    formed = r"^launch: recovery: generation \d+ ended, generation \d+ formed with world 2 "
    assert re.search(formed, out, re.M), out
    assert re.search(r"^\[rank \d+\] recovery: generation \d+ world 2 ", out, re.M), out
    finished = set(re.findall(rf"done: member (\S+) finished at step {STEPS}", out))
    assert finished == {"n0-l0-i0", "n0-l1-i0"}, out
    # What the recovery loaded is what was saved at that step, resharded 3 -> 2.
    step = int(re.search(r"^\[rank \d+\] resumed step (\d+) on 2 ranks$", out, re.M).group(1))
    assert EVERY <= step < STEPS and step % EVERY == 0
    saved = torch.load(record / f"saved-step{step}-rank0.pt", weights_only=True)
    loaded = torch.load(record / f"loaded-step{step}-rank0.pt", weights_only=True)
    assert_same_tensors(saved, loaded, "state")
    verify_all(url)


def test_a_stop_under_ckpt_elastic_commits_the_agreed_step_and_the_loop_ends(tmp_path):
    framework("torchtitan")
    url = f"file://{tmp_path / 'ck'}"
    # No periodic save before the end: the one commit is the step the stop agreed on.
    job = Elastic(url, tmp_path / "record", every=1000)
    assert job.lines_until(lambda line: line == "step 2\n"), "".join(job.lines)[-6000:]
    job.proc.send_signal(signal.SIGTERM)
    out, _ = job.proc.communicate(timeout=120)
    assert job.proc.returncode == 75, out  # ckpt.elastic.EXIT_STOPPED
    stopped = int(re.search(r"stopped at step (\d+) after a committed checkpoint", out).group(1))
    assert 2 <= stopped < STEPS and committed(url) == [stopped], out


@pytest.mark.serial
def test_a_killed_torchtitan_job_resumes_on_the_same_world_and_another_refuses_its_dataloader(
    s3_base, tmp_path
):
    framework("torchtitan")
    first, on2, on3 = (f"{s3_base}/titan-{n}" for n in ("first", "on2", "on3"))
    kill_after_a_commit(run(2, first, tmp_path / "first"), first, EVERY)

    # Same world: everything carried, the data stream included.
    out = run(2, on2, tmp_path / "on2", "--initial", first).finish()
    assert f"done at step {STEPS}" in out
    step = loaded_step(tmp_path / "on2")
    assert EVERY <= step < STEPS and step % EVERY == 0
    saved = torch.load(tmp_path / "first" / f"saved-step{step}-rank0.pt", weights_only=True)
    loaded = torch.load(tmp_path / "on2" / f"loaded-step{step}-rank0.pt", weights_only=True)
    assert_same_tensors(saved, loaded, "state")
    before = [b for b in batches(tmp_path / "first") if b["step"] <= step]
    after = batches(tmp_path / "on2")
    assert min(b["step"] for b in after) == step + 1
    seen = collections.Counter(i for b in before + after for i in b["idx"])
    assert sorted(seen) == list(range(STEPS * BATCH * 2)) and set(seen.values()) == {1}

    # Another world: torchtitan's dataloader cannot be resharded, and the load says so
    # (left out, everything else loads resharded: the elastic test above).
    refused = run(3, on3, tmp_path / "on3", "--initial", first)
    out, _ = refused.proc.communicate(timeout=600)
    assert refused.proc.returncode != 0
    assert "torchtitan's dataloader cannot be resharded" in out, out[-6000:]
    for url in (first, on2):
        verify_all(url)


# -- the manager's policies, in one process ------------------------------------------


def manager(tmp_path: Path, url: str, **config):
    framework("torchtitan")
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckpt.integrations.torchtitan import CkptCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
        ],
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10
    )
    state = {"step": 0}

    class Train:
        def state_dict(self):
            return dict(state)

        def load_state_dict(self, s):
            state.update(s)

    settings = {
        "enable": True,
        "url": url,
        "interval": 2,
        "keep_latest_k": 0,
        "last_save_model_only": False,
        "initial_load_model_only": False,
    }
    settings.update(config)
    mgr = CkptCheckpointManager.Config(**settings).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": Train()},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    return mgr, model, optimizers, state


def train_step(model, optimizers, mgr) -> None:
    model(torch.ones(3, 4)).sum().backward()
    mgr.maybe_wait_for_staging()
    optimizers.step()
    optimizers.zero_grad()


def committed(url: str) -> list[int]:
    return sorted(c["step"] for c in list_checkpoints(url) if c["committed"])


def test_the_manager_saves_at_its_interval_and_the_last_step_and_keeps_the_latest_k(tmp_path):
    url = f"file://{tmp_path / 'ck'}"
    mgr, model, optimizers, state = manager(
        tmp_path, url, keep_latest_k=2, interval=3, retention_grace=0.0
    )
    for step in range(1, 8):
        state["step"] = step
        train_step(model, optimizers, mgr)
        assert mgr.save(step, last_step=step == 7) == (step % 3 == 0 or step == 7)
    mgr.close()
    assert committed(url) == [6, 7]


def test_a_load_puts_back_the_model_optimizer_and_train_state_of_the_newest_step(tmp_path):
    url = f"file://{tmp_path / 'ck'}"
    mgr, model, optimizers, state = manager(tmp_path, url)
    assert mgr.load() is False  # nothing to resume: a fresh start
    for step in (1, 2):
        state["step"] = step
        train_step(model, optimizers, mgr)
        mgr.save(step)
    mgr.close()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizers.state_dict().items() if torch.is_tensor(v)}

    again, model2, optimizers2, state2 = manager(tmp_path, url)
    assert again.load() is True
    assert state2["step"] == 2
    assert_same_tensors(weights, {k: v for k, v in model2.state_dict().items()})
    assert_same_tensors(
        moments, {k: v for k, v in optimizers2.state_dict().items() if torch.is_tensor(v)}
    )
    again.close()


def test_load_only_never_saves_and_a_missing_step_names_the_flag(tmp_path):
    url = f"file://{tmp_path / 'ck'}"
    mgr, model, optimizers, _ = manager(tmp_path, url, load_only=True)
    train_step(model, optimizers, mgr)
    assert mgr.save(2) is False and committed(url) == []
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
        mgr.load(step=5)
    mgr.close()


def test_the_initial_load_path_is_used_only_without_a_checkpoint_of_the_job(tmp_path):
    seed = f"file://{tmp_path / 'seed'}"
    mgr, model, optimizers, state = manager(tmp_path, seed, last_save_model_only=True)
    state["step"] = 4
    train_step(model, optimizers, mgr)
    mgr.save(4, last_step=True)  # model only, as torchtitan's default last save
    mgr.close()
    seeded = {k: v.clone() for k, v in model.state_dict().items()}

    url = f"file://{tmp_path / 'job'}"
    job, model2, _, state2 = manager(
        tmp_path, url, initial_load_path=seed, initial_load_model_only=True
    )
    assert job.load() is True
    assert_same_tensors(seeded, dict(model2.state_dict()))
    assert state2["step"] == 0  # model only: the train state starts over
    job.close()


def test_excluded_states_are_not_loaded(tmp_path):
    url = f"file://{tmp_path / 'ck'}"
    mgr, model, optimizers, state = manager(tmp_path, url)
    state["step"] = 2
    train_step(model, optimizers, mgr)
    mgr.save(2)
    mgr.close()
    again, _, _, state2 = manager(tmp_path, url, exclude_from_loading=["train_state"])
    assert again.load() is True and state2["step"] == 0
    again.close()
    with pytest.raises(ValueError, match="nothing not found"):
        bad, _, _, _ = manager(tmp_path, url, exclude_from_loading=["nothing"])
        bad.load()
