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
