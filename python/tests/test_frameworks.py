"""PyTorch Lightning (ckpt's strategies) and the Hugging Face Trainer
(``CkptTrainer``), with their PyPI releases, each running its example under
torchrun: a job on 2 ranks saving to the S3 server is SIGKILLed mid-run, then
resumed on 3 ranks (resharded) and on 2, each trained to the end. (torchtitan's
manager: test_torchtitan.py.)"""

from __future__ import annotations

import pytest
from frameworks import (
    EXAMPLES,
    assert_a_faithful_resume,
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
