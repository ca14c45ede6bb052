"""PyTorch Lightning (ckpt's strategies) and the Hugging Face Trainer
(``CkptTrainer``), with their PyPI releases, each running its example under
torchrun: a job on 2 ranks saving to the S3 server is SIGKILLed mid-run, then
resumed on 3 ranks (resharded) and on 2, each trained to the end. Accelerate's
``save_state``/``load_state`` through ``CkptAccelerator``: 2 processes to 3.
(torchtitan's manager: test_torchtitan.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from frameworks import (
    EXAMPLES,
    Job,
    assert_a_faithful_resume,
    assert_same_tensors,
    example,
    framework,
    kill_after_a_commit,
    verify_all,
)

pytestmark = pytest.mark.serial

SAMPLES, BATCH, STEPS, EVERY = 96, 4, 30, 6
JOBS = {
    # name: (modules it needs, example, its arguments)
    "lightning-ddp": (("lightning",), "lightning_train.py", ("--strategy", "ddp")),
    "lightning-fsdp2": (("lightning",), "lightning_train.py", ("--strategy", "fsdp")),
    "hf-trainer-ddp": (("transformers", "accelerate"), "hf_trainer.py", ()),
}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_killed_job_resumes_resharded_with_its_state_data_and_rng(name, s3_base, tmp_path):
    modules, script, options = JOBS[name]
    for module in modules:
        framework(module)
    shape = ("--steps", str(STEPS), "--every", str(EVERY), "--samples", str(SAMPLES))
    shape += ("--batch-size", str(BATCH), "--log-every", "1", *options)
    first, on3, on2 = (f"{s3_base}/{name}-{run}" for run in ("first", "on3", "on2"))
    killed = example(EXAMPLES / script, 2, first, tmp_path / "first", *shape, "--step-ms", "100")
    kill_after_a_commit(killed, first, EVERY)

    for nproc, url, run in ((3, on3, "on3"), (2, on2, "on2")):
        record = tmp_path / run
        out = example(EXAMPLES / script, nproc, url, record, *shape, "--resume-from", first)
        assert f"done at step {STEPS}" in out.finish()
        assert_a_faithful_resume(tmp_path / "first", record, nproc, 2, SAMPLES, EVERY, STEPS)
        verify_all(url)
    verify_all(first)


def test_accelerate_save_state_and_load_state_go_through_ckpt_onto_another_world(s3_base, tmp_path):
    """``CkptAccelerator``: a save on 2 processes (the training goes on past it,
    BatchNorm writing its buffers beside the save's copy) loads on 3, bitwise."""
    framework("accelerate")
    worker = Path(__file__).with_name("accelerate_worker.py")
    url = f"{s3_base}/accelerate"
    Job(worker, 2, "save", url, str(tmp_path / "save")).finish()
    Job(worker, 3, "load", url, str(tmp_path / "load")).finish()
    saved = torch.load(tmp_path / "save" / "saved-rank0.pt", weights_only=True)
    for rank in range(3):
        loaded = torch.load(tmp_path / "load" / f"loaded-rank{rank}.pt", weights_only=True)
        assert_same_tensors(saved["model"], loaded["model"], "model")
        assert_same_tensors(saved["optim"], loaded["optim"], "optimizer")
        assert (loaded["lr"], loaded["counter"], loaded["step"]) == (
            saved["lr"],
            saved["counter"],
            saved["step"],
        )
        if rank < 2:
            mine = torch.load(tmp_path / "save" / f"saved-rank{rank}.pt", weights_only=True)
            assert torch.equal(mine["rng"], loaded["rng"]), f"rank {rank}'s RNG state"
    verify_all(url)
