"""CUDA tensors staged through the library's pinned buffers and loaded back to the
device (cargo feature `cuda`). Skipped loudly without a GPU, or on a build without
the feature; run them where a GPU is lent (docs/GPU.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import need

from ckpt import _native
from ckpt.torch import Checkpointer, load


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        need("gpu", "torch.cuda.is_available() is False")
    if not _native.HAS_CUDA:
        need("gpu", "the package was built without the cargo feature cuda")
    return torch.device("cuda", 0)


def test_cuda_tensors_round_trip_bitwise_through_pinned_staging(root, cuda):
    state = {
        "w": torch.randn(1024, 512, device=cuda),
        "b": torch.randn(512, device=cuda).bfloat16(),
        "host": torch.arange(10),
    }
    expected = {k: v.cpu().clone() for k, v in state.items()}
    c = Checkpointer(root)
    handle = c.save(1, state)
    handle.wait_staged()
    state["w"].add_(1.0)  # the optimizer step, after the device copy
    handle.wait_committed()
    c.close()
    into = {k: torch.zeros_like(v) for k, v in expected.items()}
    into["w"] = into["w"].to(cuda)
    into["b"] = into["b"].to(cuda)
    load(root, into)
    for name, tensor in expected.items():
        assert torch.equal(
            into[name].cpu().reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name
    assert into["w"].device.type == "cuda"


def test_elastic_nccl_rank_killed_and_relaunched_resumes_bitwise_on_the_gpu(cuda, tmp_path):
    """ckpt.elastic on NCCL: the example trains on the GPU (FSDP2, CUDA DTensors saved
    through the pinned staging), its one rank is SIGKILLed, the launcher relaunches
    it, and the new process resumes from the newest commit into device memory; the
    oracle of test_elastic holds (one GPU: NCCL before 2.30 runs one rank per GPU)."""
    import os
    import signal

    from test_elastic import Launch, judge

    url, ref = f"file://{tmp_path / 'job'}", f"file://{tmp_path / 'reference'}"
    script = ("--backend", "nccl")
    job = Launch(url, 1, "--min-ranks", "1", "--max-restarts", "1", script=script)
    job.wait_for(r"^\[rank 0\] step 25 loss")
    os.kill(job.pid(0), signal.SIGKILL)
    assert job.finish() == 0, job.text()
    text = job.text()
    assert "launch: rank 0 pid" in text and "(restart 1)" in text, text
    plan = judge(url, ref, text, script=script)
    assert plan == [(0, 1), (20, 1)], plan
