"""DCP's contract with a storage plugin, as PyTorch's own checkpoint tests exercise it.

Each test does what one of torch's DCP tests does (named in its docstring) with
torch's storage and with ckpt's plugin, and expects the same result: ckpt's
``StorageWriter``/``StorageReader`` must be a drop-in for ``FileSystemWriter``/
``FileSystemReader``.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from conftest import spawn
from dcp_workers import _same_tree, failure_on_one_rank, sharded_optimizer_state
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import (
    _load_state_dict,
    _load_state_dict_from_keys,
)

import ckpt
import ckpt.elastic
from ckpt.torch import Checkpointer
from ckpt.torch.dcp import StorageReader, StorageWriter


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(4, 6)
        self.net2 = torch.nn.Sequential(torch.nn.Linear(6, 2), torch.nn.LayerNorm(2))


def state() -> dict:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model.net2(model.net1(torch.randn(3, 4))).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "extra": {"epoch": 3, "pair": (1, 2), "names": ["a", "b"]},
    }


@pytest.fixture
def saved(tmp_path) -> tuple[str, str]:
    """The same state saved by torch's storage and by ckpt's plugin."""
    fs_dir, url = str(tmp_path / "fs"), f"file://{tmp_path / 'ckpt'}"
    sd = state()
    dcp.save(sd, storage_writer=FileSystemWriter(fs_dir))
    dcp.save(sd, storage_writer=StorageWriter(url))
    return fs_dir, url


def load_empty(reader) -> dict:
    """What ``dcp_to_torch_save`` does: load everything into an empty state dict."""
    sd: dict = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def test_an_empty_state_dict_is_rebuilt_nested_as_torch_storage_rebuilds_it(saved):
    """torch's test_dcp_to_torch_save, and a load into an empty state dict."""
    fs_dir, url = saved
    expected = load_empty(FileSystemReader(fs_dir))
    got = load_empty(StorageReader(url))
    assert sorted(got) == ["extra", "model", "optim"]
    assert sorted(got["model"]) == sorted(state()["model"])  # "net1.bias", not "net1" → "bias"
    _same_tree(got, expected)
    _same_tree(_load_state_dict_from_keys(storage_reader=StorageReader(url)), expected)


@pytest.mark.parametrize(
    "keys",
    [{"model.net1.bias"}, {"model"}, {"optim.param_groups", "extra.pair"}, "model.net2.1.weight"],
)
def test_a_partial_load_by_keys_gives_what_torch_storage_gives(saved, keys):
    """torch's test_partial_load (``_load_state_dict_from_keys``)."""
    fs_dir, url = saved
    expected = _load_state_dict_from_keys(keys, storage_reader=FileSystemReader(fs_dir))
    got = _load_state_dict_from_keys(keys, storage_reader=StorageReader(url))
    assert got, "something was loaded"
    _same_tree(got, expected)


def test_a_checkpoint_saved_natively_is_rebuilt_nested_through_dcp(tmp_path):
    """The native API records where each name sits, so DCP's planners rebuild the
    state dict it saved; user metadata does not see the record."""
    url = f"file://{tmp_path / 'native'}"
    sd = state()
    Checkpointer(url).save(5, sd, metadata={"note": "mine"}).wait_committed()
    got = load_empty(StorageReader(url))
    assert sorted(got["model"]) == sorted(sd["model"])
    assert got["extra"]["pair"] == (1, 2)
    assert torch.equal(got["model"]["net2.0.weight"], sd["model"]["net2.0.weight"])
    extra = ckpt.torch.load(url, {"model": Net().state_dict()})
    assert extra.metadata == {"note": "mine"}
    with pytest.raises(ckpt.InvalidError, match="reserved"):
        Checkpointer(url).save(6, sd, metadata={"ckpt.torch.paths": {}})


def test_optimizer_state_loads_sharded_as_from_torch_storage_on_2_ranks(tmp_path):
    """torch's test_load_sharded_optimizer_state_dict (both variants) and
    test_fsspec's load."""
    spawn(sharded_optimizer_state, 2, str(tmp_path / "fs"), f"file://{tmp_path / 'ckpt'}")


def test_every_exception_pickles_to_its_class_with_its_message_and_attributes(tmp_path):
    """DCP gathers exceptions with pickle: each must come back as itself."""
    classes = [getattr(ckpt, name) for name in ckpt.__all__ if name.endswith("Error")]
    assert len(classes) >= 12
    for cls in classes:
        e = pickle.loads(pickle.dumps(cls("what went wrong")))
        assert type(e) is cls and str(e) == "what went wrong"
    with pytest.raises(ckpt.NotFoundError) as raised:
        ckpt._native.Reader(f"file://{tmp_path / 'absent'}", None)
    back = pickle.loads(pickle.dumps(raised.value))
    assert type(back) is ckpt.NotFoundError and str(back) == str(raised.value)
    assert back.kind == "not_found" and back.transient is False
    changed = pickle.loads(pickle.dumps(ckpt.elastic.WorldChanged(4, "rank 2 lost")))
    assert (changed.generation, changed.cause, str(changed)) == (
        4,
        "rank 2 lost",
        "generation 4 is over: rank 2 lost",
    )


def test_a_write_that_fails_on_one_of_2_ranks_fails_both_within_seconds(tmp_path):
    """DCP's error handling with one rank failing: every rank raises
    CheckpointException naming ckpt's error, well before the group's 60 s timeout."""
    results = mp.Manager().dict()
    spawn(failure_on_one_rank, 2, f"file://{tmp_path / 'ckpt'}", results)
    for rank in (0, 1):
        kind, message, seconds = results[rank]
        assert kind == "CheckpointException", (rank, kind, message)
        assert "NotFoundError" in message, message
        assert seconds < 30, f"rank {rank} raised after {seconds:.1f} s"


class _CustomPlanner(DefaultSavePlanner):
    """A planner whose planner_data is its own, not DCP's object paths (it flattens
    nothing, so DCP's merge of object paths is not run)."""

    def __init__(self, data):
        super().__init__(flatten_state_dict=False)
        self.data = data

    def create_local_plan(self):
        return dataclasses.replace(super().create_local_plan(), planner_data=self.data)


def test_a_custom_planners_data_comes_back_and_one_json_cannot_hold_is_dropped_with_a_warning(
    tmp_path,
):
    url = f"file://{tmp_path / 'ckpt'}"
    sd = {"w": torch.arange(4.0), "pair": (1, 2)}
    data = ("custom", {"rank": 0, 3: [1.5, None]})
    dcp.save(sd, storage_writer=StorageWriter(url, step=1), planner=_CustomPlanner(data))
    assert StorageReader(url, step=1).read_metadata().planner_data == data
    with pytest.warns(UserWarning, match="planner_data is not stored"):
        dcp.save(sd, storage_writer=StorageWriter(url, step=2), planner=_CustomPlanner(object()))
    # The object paths of the names stand in: each name at the top level.
    fallback = StorageReader(url, step=2).read_metadata().planner_data
    assert fallback == {"w": ("w",), "pair": ("pair",)}
