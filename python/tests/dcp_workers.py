"""Rank processes of the DCP contract tests (spawned: importable functions only).

Each worker does the same thing twice, once with torch's own storage
(``FileSystemWriter``/``FileSystemReader``) and once with ckpt's plugin, and checks
that the plugin gives what torch's storage gives.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckpt import _native
from ckpt.torch.dcp import StorageReader, StorageWriter


def init(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=timeout_s),
    )


def _fsdp_state(world: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    model(torch.randn(5, 6)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, {"model": model_sd, "optim": optim_sd}


def _local_shards(value: Any) -> list[tuple[list[int], torch.Tensor]]:
    """A ShardedTensor's local shards (offsets, data), or a tensor whole."""
    if hasattr(value, "local_shards"):
        return [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    return [([], value)]


def _same_tree(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        # The same keys; not their order (ckpt's manifest lists tensors by name).
        assert sorted(a, key=str) == sorted(b, key=str), (where, list(a), list(b))
        for k in a:
            _same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        sa, sb = _local_shards(a), _local_shards(b)
        assert [o for o, _ in sa] == [o for o, _ in sb], where
        for (_, x), (_, y) in zip(sa, sb, strict=True):
            assert torch.equal(x, y), where
    else:
        assert a == b, (where, a, b)


def sharded_optimizer_state(rank: int, world: int, port: int, fs_dir: str, url: str) -> None:
    """Contract of torch's test_load_sharded_optimizer_state_dict (and test_fsspec's
    load): optimizer state saved from FSDP2, loaded back by
    ``load_sharded_optimizer_state_dict`` as ShardedTensors over the world, with and
    without a planner, gives what torch's storage gives; the save staged through the
    plugin (dcp.async_save) too."""
    init(rank, world, port)
    _, sd = _fsdp_state(world)
    dcp.save(sd, storage_writer=FileSystemWriter(fs_dir))
    dcp.save(sd, storage_writer=StorageWriter(url, step=1))
    # dcp.async_save staging through the plugin (it fixes the step at `stage`).
    writer = StorageWriter(url, step=2)
    pending = dcp.async_save(
        sd, storage_writer=writer, process_group=dist.new_group(backend="gloo")
    )
    pending.staging_completion.result()
    pending.upload_completion.result()
    model_sd = sd["model"]
    for planner in (None, DefaultLoadPlanner()):
        expected = load_sharded_optimizer_state_dict(
            model_sd,
            optimizer_key="optim",
            storage_reader=FileSystemReader(fs_dir),
            planner=planner,
        )
        for step in (1, 2):
            got = load_sharded_optimizer_state_dict(
                model_sd,
                optimizer_key="optim",
                storage_reader=StorageReader(url, step=step),
                planner=planner,
            )
            _same_tree(got, expected, f"step {step}, planner {planner}")
            assert got["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)
    dist.barrier()
    dist.destroy_process_group()


class _FailingWriter(StorageWriter):
    """ckpt's writer whose write fails on one rank, with an error of ckpt's."""

    def __init__(self, url: str, failing_rank: int):
        super().__init__(url)
        self.failing_rank = failing_rank

    def write_data(self, plan, planner):
        if dist.get_rank() == self.failing_rank:
            # A genuine error of the library: opening a checkpoint that is not there.
            _native.Reader(self.url + "-absent", None)
        return super().write_data(plan, planner)


def failure_on_one_rank(rank: int, world: int, port: int, url: str, results: Any) -> None:
    """Contract of DCP's error handling: one rank's failed write reaches every rank
    as a CheckpointException (DCP gathers the exceptions with pickle) at once, not at
    the process group's timeout."""
    init(rank, world, port, timeout_s=60)
    sd = {"w": torch.arange(8.0)}
    started = time.monotonic()
    try:
        dcp.save(sd, storage_writer=_FailingWriter(url, failing_rank=1))
        outcome = ("no error", "")
    except CheckpointException as e:
        outcome = ("CheckpointException", str(e))
    except Exception as e:  # noqa: BLE001 (reported to the test, which fails on it)
        outcome = (type(e).__name__, str(e))
    results[rank] = (outcome[0], outcome[1], time.monotonic() - started)
    dist.destroy_process_group()
