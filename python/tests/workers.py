"""What each rank process runs in the distributed tests (spawned: importable
functions only). Every worker forms a real gloo process group."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckpt.torch import Checkpointer, load
from ckpt.torch.dcp import StorageReader, StorageWriter


def init(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=120),
    )


def model_and_optimizer(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small FSDP2 model (row counts that do not divide by 3 or 4: uneven shards)
    with AdamW state after one step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 34), nn.ReLU(), nn.Linear(34, 10), nn.LayerNorm(10))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.LayerNorm)):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def full_tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a state dict, whole (DTensors gathered: every rank calls this)."""
    from ckpt.torch._state import leaves

    out = {}
    for leaf in leaves(sd):
        if isinstance(leaf.value, torch.Tensor):
            value = leaf.value.full_tensor() if isinstance(leaf.value, DTensor) else leaf.value
            out[leaf.fqn] = value.detach().clone()
    return out


def save_world(rank: int, world: int, port: int, roots: dict[str, str], reference: str) -> None:
    """Trains one step on `world` ranks, then saves the same state natively (with a
    data-loader cursor per rank), through dcp.save and through dcp.async_save."""
    init(rank, world, port)
    model, optimizer = model_and_optimizer(world, seed=1)
    sd = state(model, optimizer)
    full = full_tensors(sd)
    if rank == 0:
        torch.save(full, reference)
    native = Checkpointer(roots["native"])
    handle = native.save(100, {**sd, "data": {"cursor": 1000 + rank}})
    handle.wait_staged()
    handle.wait_committed()
    native.close()

    dcp.save(sd, storage_writer=StorageWriter(roots["dcp"], step=100))

    # dcp.async_save with DCP's own stager: DCP copies, then the plugin writes.
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    async_group = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, False, True, False))
    pending = dcp.async_save(
        sd,
        storage_writer=StorageWriter(roots["async"]),
        process_group=async_group,
        async_stager=stager,
    )
    pending.upload_completion.result()
    stager.close()
    # dcp.async_save staging through the plugin itself (ckpt's overlapped save).
    writer = StorageWriter(roots["staged"])
    pending = dcp.async_save(sd, storage_writer=writer, process_group=async_group)
    pending.staging_completion.result()
    pending.upload_completion.result()
    assert not writer._staged
    first = writer._last_step
    assert writer.profile["plan_reused"] is False, writer.profile
    # Its next save agrees nothing with the other ranks (the step after the last,
    # the run id agreed once) and reuses the plan of the same state.
    agreements = []
    broadcast = dist.broadcast_object_list
    dist.broadcast_object_list = lambda *a, **k: agreements.append(a) or broadcast(*a, **k)
    try:
        writer.stage(sd).result()
    finally:
        dist.broadcast_object_list = broadcast
    assert agreements == [], "a later stage made a collective"
    assert writer.profile["plan_reused"] is True, writer.profile
    assert writer._last_step == first + 1, (first, writer._last_step)
    writer._staged.popleft().handle.wait_committed()
    dist.barrier()
    dist.destroy_process_group()


def check_equal(sd: dict[str, Any], reference: str, what: str) -> None:
    expected = torch.load(reference, weights_only=True)
    got = full_tensors(sd)
    assert sorted(got) == sorted(expected), (what, sorted(got), sorted(expected))
    for name, tensor in expected.items():
        a = got[name].reshape(-1).view(torch.uint8)
        b = tensor.reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{what}: {name} differs after the load"


def load_world(rank: int, world: int, port: int, roots: dict[str, str], reference: str) -> None:
    """Loads each saved checkpoint on `world` ranks, every way round, into a model
    trained from another seed, and checks the whole tensors bitwise."""
    init(rank, world, port)
    model, optimizer = model_and_optimizer(world, seed=7)

    # Native save, native load: tensors resharded, every saved rank's cursor visible.
    sd = state(model, optimizer)
    sd["data"] = {"cursor": -1}
    extra = load(roots["native"], sd)
    assert extra.step == 100 and extra.world_size == 4
    assert [r["data.cursor"] for r in extra.ranks] == [1000, 1001, 1002, 1003]
    assert sd["data"]["cursor"] == 1000 + rank
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    check_equal(state(model, optimizer), reference, f"native load on {world}")

    # dcp.save through the plugin, dcp.load through the plugin.
    model, optimizer = model_and_optimizer(world, seed=8)
    sd = state(model, optimizer)
    dcp.load(sd, storage_reader=StorageReader(roots["dcp"]))
    check_equal(sd, reference, f"dcp.load of dcp.save on {world}")

    # Native save, dcp.load.
    model, optimizer = model_and_optimizer(world, seed=9)
    sd = state(model, optimizer)
    dcp.load(sd, storage_reader=StorageReader(roots["native"]))
    check_equal(sd, reference, f"dcp.load of a native save on {world}")

    # dcp.save, native load.
    model, optimizer = model_and_optimizer(world, seed=10)
    sd = state(model, optimizer)
    load(roots["dcp"], sd)
    check_equal(sd, reference, f"native load of a dcp.save on {world}")

    # dcp.async_save (DCP's stager, then ckpt's staged), dcp.load and native load.
    for seed, root in ((11, "async"), (12, "staged")):
        model, optimizer = model_and_optimizer(world, seed=seed)
        sd = state(model, optimizer)
        dcp.load(sd, storage_reader=StorageReader(roots[root]))
        check_equal(sd, reference, f"dcp.load of a dcp.async_save ({root}) on {world}")
    model, optimizer = model_and_optimizer(world, seed=13)
    sd = state(model, optimizer)
    load(roots["staged"], sd)
    check_equal(sd, reference, f"native load of a dcp.async_save (staged) on {world}")
    dist.barrier()
    dist.destroy_process_group()


def save_twice(rank: int, world: int, port: int, root: str) -> None:
    """Two runs of a job (two checkpointers, as after a restart) save the same step
    into the same root: each gets its own run id from rank 0, so both commit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ckpt.torch import list_checkpoints

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    for run in range(2):
        w = DTensor.from_local(torch.full((4, 8), float(run)), mesh, [Shard(0)], run_check=False)
        checkpointer = Checkpointer(root)
        checkpointer.save(5, {"w": w}).wait_committed()
        checkpointer.close()
    committed = [e for e in list_checkpoints(root) if e["committed"]]
    assert [e["step"] for e in committed] == [5, 5], committed
    into = {"w": DTensor.from_local(torch.zeros(4, 8), mesh, [Shard(0)], run_check=False)}
    load(root, into)
    assert torch.all(into["w"].to_local() == 1.0)
    dist.barrier()
    dist.destroy_process_group()


def save_2d(rank: int, world: int, port: int, root: str, reference: str) -> None:
    """4 ranks on a 2x2 mesh: HSDP-style [Replicate(), Shard(0)] and a 2-D split
    [Shard(0), Shard(1)], saved natively (step 1). Then saved again as a training
    loop saves: the same tensors changed in place (step 2: the kept plan, the new
    values), and one tensor replaced (step 3: a new plan)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(5)
    full = {"hsdp": torch.randn(10, 6, generator=g), "grid": torch.randn(9, 7, generator=g)}
    if rank == 0:
        torch.save(full, reference)
    sd = {
        "hsdp": distribute_tensor(full["hsdp"], mesh, [Replicate(), Shard(0)]),
        "grid": distribute_tensor(full["grid"], mesh, [Shard(0), Shard(1)]),
    }
    checkpointer = Checkpointer(root)
    handle = checkpointer.save(1, sd)
    handle.wait_committed()
    assert handle.profile["plan_reused"] is False, handle.profile
    with torch.no_grad():
        for tensor in sd.values():
            tensor.to_local().add_(1.0)
    handle = checkpointer.save(2, sd)
    handle.wait_committed()
    assert handle.profile["plan_reused"] is True, handle.profile
    sd["grid"] = distribute_tensor(-full["grid"], mesh, [Shard(0), Shard(1)])
    handle = checkpointer.save(3, sd)
    handle.wait_committed()
    assert handle.profile["plan_reused"] is False, handle.profile
    checkpointer.close()
    expected = {
        2: {name: tensor + 1.0 for name, tensor in full.items()},
        3: {"hsdp": full["hsdp"] + 1.0, "grid": -full["grid"]},
    }
    for step, tensors in expected.items():
        into = {
            "hsdp": distribute_tensor(torch.zeros(10, 6), mesh, [Replicate(), Shard(0)]),
            "grid": distribute_tensor(torch.zeros(9, 7), mesh, [Shard(0), Shard(1)]),
        }
        load(root, into, step=step)
        for name, tensor in tensors.items():
            assert torch.equal(into[name].full_tensor(), tensor), (step, name)
    dist.barrier()
    dist.destroy_process_group()


def load_2d(rank: int, world: int, port: int, root: str, reference: str) -> None:
    """The 2-D checkpoint on 2 ranks, split another way (Shard(1) and Replicate())."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    sd = {
        "hsdp": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)]),
        "grid": distribute_tensor(torch.zeros(9, 7), mesh, [Replicate()]),
    }
    load(root, sd, step=1)
    expected = torch.load(reference, weights_only=True)
    for name, tensor in expected.items():
        assert torch.equal(sd[name].full_tensor(), tensor), name
    dist.barrier()
    dist.destroy_process_group()


def _flip_bit(tensor: torch.Tensor, element: int) -> None:
    """Flips the lowest bit of one float32 element of a DTensor's local shard, in
    place (silent data corruption in one replica)."""
    flat = tensor.to_local().detach().view(-1).view(torch.int32)
    flat[element : element + 1].bitwise_xor_(1)


def hsdp_health(rank: int, world: int, port: int, roots: dict[str, str], reference: str) -> None:
    """An FSDP2 model on an HSDP 2 x 2 mesh (2 replicas of 2 shards): replicas that
    agree commit healthy and load bitwise; one flipped bit in rank 3's copy (a
    replica rank 1 writes) marks the commit unhealthy naming rank 3 and the block,
    or with replica_mismatch="fail" refuses it ("off" compares nothing); the same
    through the DCP plugin, whose planner keeps one copy of each replicated shard."""
    from torch.distributed.tensor import Replicate, Shard

    from ckpt import CkptError
    from ckpt.torch import UnhealthySkippedWarning, health, latest

    init(rank, world, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    model = build(1)
    sd = {"model": model.state_dict()}
    weight = sd["model"]["0.weight"]
    assert weight.placements == (Replicate(), Shard(0)), weight.placements
    full = full_tensors(sd)
    if rank == 0:
        torch.save(full, reference)
    dist.barrier()

    # Replicas that agree: healthy, every replicated shard compared, loads bitwise.
    native = Checkpointer(roots["native"])
    native.save(1, sd).wait_committed()
    verdict = health(roots["native"], 1)
    assert verdict["healthy"] is True, verdict
    # 4 parameters, each 2 shards held by 2 replicas.
    assert verdict["replicas_compared"] == 8, verdict
    other = build(2)
    into = {"model": other.state_dict()}
    load(roots["native"], into)
    check_equal(into, reference, "native load of an HSDP save")

    # One bit of rank 3's copy of rows 8..15 of 0.weight: rank 1 writes that shard.
    element = 5
    if rank == 3:
        _flip_bit(weight, element)
    native.save(2, sd).wait_committed()
    verdict = health(roots["native"], 2)
    assert verdict["healthy"] is False, verdict
    assert verdict["replica_mismatches"] == [
        {
            "tensor": "model.0.weight",
            "offsets": [8, 0],
            "lengths": [8, 8],
            "blocks": [0],
            "written_by": 1,
            "agree": [],
            "disagree": [3],
        }
    ], verdict
    (reason,) = verdict["reasons"]
    assert "rank 3" in reason and "block 0" in reason and "model.0.weight" in reason, reason
    assert latest(roots["native"])["step"] == 1
    assert latest(roots["native"], healthy=False)["step"] == 2

    # replica_mismatch="fail": the commit is refused; step 2 stays the newest.
    failing = Checkpointer(roots["native"], replica_mismatch="fail")
    handle = failing.save(3, sd)
    try:
        handle.wait_committed()
    except CkptError as e:
        assert "model.0.weight" in str(e) and "rank 3" in str(e), e
    else:
        raise AssertionError("a save whose replicas disagree committed with replica_mismatch=fail")
    dist.barrier()
    assert latest(roots["native"], healthy=False)["step"] == 2
    assert latest(roots["native"])["step"] == 1
    failing.close()
    # replica_mismatch="off": nothing compared, so nothing seen.
    blind = Checkpointer(roots["native"], replica_mismatch="off")
    blind.save(4, sd).wait_committed()
    verdict = health(roots["native"], 4)
    assert verdict["healthy"] is True and verdict["replicas_compared"] == 0, verdict
    blind.close()
    native.close()

    # Through DCP: its planner keeps one copy of each replicated shard, the writer
    # still hands ckpt the others to compare.
    if rank == 3:
        _flip_bit(weight, element)  # back to the agreed value
    dcp.save(sd, storage_writer=StorageWriter(roots["dcp"], step=1))
    verdict = health(roots["dcp"], 1)
    assert verdict["healthy"] is True and verdict["replicas_compared"] == 8, verdict
    if rank == 3:
        _flip_bit(weight, element)
    dcp.save(sd, storage_writer=StorageWriter(roots["dcp"], step=2))
    verdict = health(roots["dcp"], 2)
    assert verdict["healthy"] is False, verdict
    (mismatch,) = verdict["replica_mismatches"]
    # DCP's planner picks which replica writes: the pair is ranks 1 and 3 either way.
    assert {mismatch["written_by"], *mismatch["disagree"]} == {1, 3}, mismatch
    assert (mismatch["tensor"], mismatch["offsets"], mismatch["blocks"]) == (
        "model.0.weight",
        [8, 0],
        [0],
    ), mismatch
    # dcp.load without a step passes over the unhealthy step 2.
    other = build(3)
    into = {"model": other.state_dict()}
    reader = StorageReader(roots["dcp"])
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(into, storage_reader=reader)
    assert [s["step"] for s in reader.skipped] == [2], reader.skipped
    assert any(issubclass(w.category, UnhealthySkippedWarning) for w in caught), caught
    check_equal(into, reference, "dcp.load of the healthy HSDP save")
    if rank == 3:
        _flip_bit(weight, element)
    dist.barrier()
    dist.destroy_process_group()
