"""A rank whose DCP plan holds several pieces of one tensor (a ``ShardedTensor``
whose spec gives it two shards or more), saved through ckpt's DCP plugin by 2 real
gloo ranks and loaded back under other shard plans, into a plain tensor and back,
through the native API, and checked by the ``ckpt`` command.

Each test keeps the contract of one of torch's own DCP tests (torch's
``test/distributed/checkpoint/test_file_system_checkpoint.py``), with the same
specs on CPU; their writer ``thread_count`` of 1 and 2 becomes the writer's
``copy_threads``. Values are a function of the global index, so every rank checks
its own pieces exactly, without gathering."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import run_cli, spawn
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (
    ChunkShardingSpec,
    EnumerableShardingSpec,
    ShardMetadata,
)
from workers import init

from ckpt.torch import list_checkpoints, load
from ckpt.torch.dcp import StorageReader, StorageWriter

WORLD = 2


def _values(shape: tuple[int, ...], round_: int) -> torch.Tensor:
    """The global tensor of save number ``round_``: distinct in every element and
    every round, exact in float32."""
    count = 1
    for n in shape:
        count *= n
    return (torch.arange(count, dtype=torch.float32) + 1000.0 * round_).reshape(shape)


def _pieces(shape: tuple[int, ...], placements: list[tuple[int, int, int]]):
    """An EnumerableShardingSpec of row pieces ``(rank, start, rows)``."""
    rest = list(shape[1:])
    return EnumerableShardingSpec(
        shards=[
            ShardMetadata(
                shard_offsets=[start] + [0] * len(rest),
                shard_sizes=[rows, *rest],
                placement=f"rank:{rank}/cpu",
            )
            for rank, start, rows in placements
        ]
    )


def _chunks(*ranks: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in ranks])


def _shard_plans_2d() -> list:
    """The specs of test_load_with_different_shard_plan, for a [10, 20] tensor: two
    of them give a rank several shards."""
    return [
        _chunks(0, 1),
        _chunks(0, 1, 1, 0),
        _pieces((10, 20), [(0, 0, 2), (1, 2, 1), (0, 3, 3), (1, 6, 3), (0, 9, 1)]),
        _pieces((10, 20), [(1, 0, 8), (0, 8, 2)]),
    ]


def _shard_plans_1d(size: int) -> list:
    """The specs of test_switch_between_sharded_tensor_to_tensor."""
    return [
        _chunks(0, 1),
        _chunks(0, 1, 1, 0),
        _pieces((size,), [(1, 0, 8), (0, 8, size - 8)]),
        _pieces((size,), [(0, 0, 10), (1, 10, size - 10)]),
    ]


def _filled(spec, full: torch.Tensor):
    """A ShardedTensor of ``spec`` whose local shards hold ``full``'s values."""
    st = sharded_tensor.empty(spec, *full.shape, init_rrefs=False)
    for shard in st.local_shards():
        shard.tensor.copy_(_slice(full, shard.metadata))
    return st


def _slice(full: torch.Tensor, metadata: ShardMetadata) -> torch.Tensor:
    index = tuple(
        slice(o, o + n) for o, n in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
    )
    return full[index]


def _assert_holds(st, full: torch.Tensor, what: str) -> None:
    """Every local shard of ``st`` equals ``full``'s values there, exactly."""
    shards = st.local_shards()
    for shard in shards:
        expected = _slice(full, shard.metadata)
        assert torch.equal(shard.tensor, expected), (
            f"{what}: shard at {shard.metadata.shard_offsets} differs"
        )


def load_with_different_shard_plan(rank: int, world: int, port: int, root: str, threads: int):
    """Every pair of distinct specs: save a [10, 20] ShardedTensor with one, load it
    into the other."""
    init(rank, world, port)
    specs = _shard_plans_2d()
    round_ = 0
    for i, save_spec in enumerate(specs):
        for j, load_spec in enumerate(specs):
            if i == j:
                continue
            full = _values((10, 20), round_)
            saved = _filled(save_spec, full)
            dcp.save({"sharded": saved}, storage_writer=StorageWriter(root, copy_threads=threads))
            loaded = sharded_tensor.zeros(load_spec, 10, 20, init_rrefs=False)
            dcp.load({"sharded": loaded}, storage_reader=StorageReader(root))
            _assert_holds(loaded, full, f"saved with spec {i}, loaded with spec {j}")
            round_ += 1
    dist.barrier()
    dist.destroy_process_group()


def switch_between_sharded_tensor_to_tensor(
    rank: int, world: int, port: int, root: str, threads: int
):
    """Every pair of specs: a ShardedTensor saved loads into a plain tensor, and a
    plain tensor saved loads into a ShardedTensor."""
    init(rank, world, port)
    size = 32
    specs = _shard_plans_1d(size)
    round_ = 0
    for i, save_spec in enumerate(specs):
        for j, load_spec in enumerate(specs):
            sharded_values = _values((size,), round_)
            plain_values = _values((size,), round_) + 0.5
            state = {
                "sharded": _filled(save_spec, sharded_values),
                "replicated": plain_values.clone(),
            }
            dcp.save(state, storage_writer=StorageWriter(root, copy_threads=threads))
            switched = {
                "sharded": torch.zeros(size),
                "replicated": sharded_tensor.zeros(load_spec, size, init_rrefs=False),
            }
            dcp.load(switched, storage_reader=StorageReader(root))
            what = f"saved with spec {i}, loaded with spec {j}"
            assert torch.equal(switched["sharded"], sharded_values), what
            _assert_holds(switched["replicated"], plain_values, what)
            round_ += 1
    dist.barrier()
    dist.destroy_process_group()


def _saved_steps(root: str, count: int) -> list[int]:
    """The steps under ``root``, one per save, oldest first; there must be ``count``."""
    steps = sorted(c["step"] for c in list_checkpoints(root))
    assert len(steps) == count, steps
    return steps


def _inspect(root: str, step: int) -> dict:
    """``ckpt inspect --tensors`` of ``step``: written as version 4 (health), with
    a rank holding several boxes of one tensor (version 3's)."""
    shown = run_cli("inspect", root, "--step", str(step), "--tensors", "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    view = json.loads(shown.stdout)
    assert view["format_version"] == 4
    return view


def _ranks_of(view: dict, name: str) -> list[int]:
    (tensor,) = [t for t in view["tensors"] if t["name"] == name]
    return sorted(chunk["rank"] for chunk in tensor["chunks"])


def _verify_all(root: str) -> None:
    verified = run_cli("verify", root, "--all")
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sharded_tensor_with_two_shards_on_a_rank_loads_under_every_other_shard_plan(
    tmp_path, threads
):
    # Contract of torch's test_load_with_different_shard_plan.
    root = f"file://{tmp_path / 'ckpt'}"
    spawn(load_with_different_shard_plan, WORLD, root, threads)

    # One step per save, 12 pairs of specs. Rounds 6..8 were saved with the 5-piece
    # spec, which gives rank 0 three pieces and rank 1 two.
    step = _saved_steps(root, 12)[6]
    assert _ranks_of(_inspect(root, step), "sharded") == [0, 0, 0, 1, 1]

    # The native API loads it into a plain tensor, whole.
    whole = {"sharded": torch.zeros(10, 20)}
    extra = load(root, whole, step=step)
    assert extra.step == step
    assert torch.equal(whole["sharded"], _values((10, 20), 6))
    _verify_all(root)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_sharded_tensor_loads_into_a_plain_tensor_and_a_plain_one_into_shards(tmp_path, threads):
    # Contract of torch's test_switch_between_sharded_tensor_to_tensor.
    root = f"file://{tmp_path / 'ckpt'}"
    spawn(switch_between_sharded_tensor_to_tensor, WORLD, root, threads)

    # One step per save, 16 pairs of specs. Round 4 saved "sharded" with spec 1 (rank
    # 0 elements 0..8 and 24..32, rank 1 the two pieces between): each rank holds two
    # boxes of one tensor. The plain tensor is written once.
    step = _saved_steps(root, 16)[4]
    view = _inspect(root, step)
    assert _ranks_of(view, "sharded") == [0, 0, 1, 1]
    assert len(_ranks_of(view, "replicated")) == 1
    whole = {"sharded": torch.zeros(32), "replicated": torch.zeros(32)}
    load(root, whole, step=step)
    assert torch.equal(whole["sharded"], _values((32,), 4))
    assert torch.equal(whole["replicated"], _values((32,), 4) + 0.5)
    _verify_all(root)


def native_and_staged(rank: int, world: int, port: int, root: str) -> None:
    """A rank's several pieces through the native API and through dcp.async_save
    staged by the plugin (ckpt's own flattening): each loads natively into another
    shard plan, and through dcp.load."""
    from ckpt.torch import Checkpointer

    init(rank, world, port)
    specs = _shard_plans_2d()
    full = _values((10, 20), 0)
    checkpointer = Checkpointer(root)
    checkpointer.save(1, {"sharded": _filled(specs[2], full)}).wait_committed()
    checkpointer.close()
    writer = StorageWriter(root, step=2)
    group = dist.new_group(backend="gloo")
    pending = dcp.async_save(
        {"sharded": _filled(specs[2], full + 1)}, storage_writer=writer, process_group=group
    )
    pending.staging_completion.result()
    pending.upload_completion.result()
    for step, values in ((1, full), (2, full + 1)):
        native = sharded_tensor.zeros(specs[3], 10, 20, init_rrefs=False)
        load(root, {"sharded": native}, step=step)
        _assert_holds(native, values, f"native load of step {step}")
        through_dcp = sharded_tensor.zeros(specs[1], 10, 20, init_rrefs=False)
        dcp.load({"sharded": through_dcp}, storage_reader=StorageReader(root, step=step))
        _assert_holds(through_dcp, values, f"dcp.load of step {step}")
    dist.barrier()
    dist.destroy_process_group()


def test_several_pieces_on_a_rank_save_natively_and_staged_and_load_natively(tmp_path):
    root = f"file://{tmp_path / 'ckpt'}"
    spawn(native_and_staged, WORLD, root)
    for step in (1, 2):
        assert _ranks_of(_inspect(root, step), "sharded") == [0, 0, 0, 1, 1]
    _verify_all(root)
