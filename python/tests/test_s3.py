"""The native API and the DCP plugin against the loopback S3 server scripts/test
starts (moto): ckpt's create-if-absent commit, no rename."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt.torch import Checkpointer, latest, load
from ckpt.torch.dcp import StorageReader, StorageWriter


@pytest.fixture
def s3_root(s3_base) -> str:
    """A fresh prefix on the S3 server (conftest's ``s3_base``)."""
    return s3_base


def test_the_native_api_saves_and_loads_on_s3(s3_root):
    state = {"w": torch.randn(300, 70), "b": torch.randn(70).bfloat16(), "cursor": 17}
    with Checkpointer(s3_root) as c:
        c.save(1, state).wait_committed()
        c.save(2, {**state, "cursor": 18}).wait_committed()
    assert latest(s3_root)["step"] == 2
    into = {"w": torch.zeros(300, 70), "b": torch.zeros(70).bfloat16(), "cursor": 0}
    extra = load(s3_root, into)
    assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"])
    assert into["cursor"] == 18 and extra.step == 2
    # A ranged get's body is copied into the destination once.
    assert extra.stats["bytes_copied"] == extra.stats["bytes_requested"]


def test_dcp_saves_and_loads_through_the_plugin_on_s3(s3_root):
    state = {"model": {"w": torch.randn(128, 32)}, "epoch": 3}
    dcp.save(state, storage_writer=StorageWriter(s3_root))
    into = {"model": {"w": torch.zeros(128, 32)}, "epoch": 0}
    dcp.load(into, storage_reader=StorageReader(s3_root))
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["epoch"] == 3
    assert latest(s3_root)["step"] == 0
