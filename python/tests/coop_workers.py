"""What each rank process runs in the cooperative-load tests (spawned: importable
functions only). Every worker forms a real gloo process group; each load is checked
bitwise against a reference and for the job's store traffic: the ranks' store bytes
add up to the unique bytes, only rank 0 lists or sends a metadata request."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from workers import check_equal, full_tensors, init, model_and_optimizer, state

from ckpt.torch import Checkpointer, PeerLostError, load
from ckpt.torch.dcp import StorageReader
from ckpt.torch.dcp import StorageWriter as _StorageWriter

# Small blocks, so that these small models spread over every rank's share.
BLOCK = 4096


def Saver(url: str) -> Checkpointer:  # noqa: N802 - reads as the class it makes
    return Checkpointer(url, block_size=BLOCK)


def StorageWriter(url: str) -> _StorageWriter:  # noqa: N802
    return _StorageWriter(url, block_size=BLOCK)


def job_traffic(stats: dict[str, Any]) -> dict[str, Any]:
    """Every rank's counters of one load, gathered on every rank."""
    mine = {
        "from_store": stats["bytes_read_from_store"],
        "from_peers": stats["bytes_received_from_peers"],
        "unique": stats["unique_bytes"],
        "requests": stats["store_requests"],
        "rejected": stats.get("peer_blocks_rejected", 0),
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"ranks": every, "from_store": sum(r["from_store"] for r in every)}


def check_read_once(stats: dict[str, Any], what: str) -> dict[str, Any]:
    """The job read each needed byte from the store once, listed once (rank 0), and
    no other rank sent a LIST or a HEAD."""
    job = job_traffic(stats)
    ranks = job["ranks"]
    unique = ranks[0]["unique"]
    assert all(r["unique"] == unique for r in ranks), (what, ranks)
    assert job["from_store"] == unique > 0, (what, job)
    assert ranks[0]["requests"]["LIST"] >= 1, (what, ranks[0])
    for rank, r in enumerate(ranks[1:], start=1):
        assert r["requests"]["LIST"] == 0 and r["requests"]["HEAD"] == 0, (what, rank, r)
    return job


def _ddp_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def replicas_and_hsdp(
    rank: int, world: int, port: int, roots: dict[str, str], references: dict[str, str]
) -> None:
    """Four ranks: DDP-style replicas (every rank holds the whole model), an FSDP2
    model on an HSDP 2 x 2 mesh, and a 1-D FSDP2 save for the 4 -> 3 test; each
    loaded cooperatively, natively and through dcp.load, bitwise."""
    init(rank, world, port)

    # DDP: plain tensors, the same on every rank; rank 0 writes them.
    sd = {"model": _ddp_model(1).state_dict()}
    if rank == 0:
        torch.save(full_tensors(sd), references["ddp"])
    Saver(roots["ddp"]).save(1, sd).wait_committed()
    dcp.save(sd, storage_writer=StorageWriter(roots["ddp-dcp"]))
    dist.barrier()
    into = {"model": _ddp_model(2).state_dict()}
    extra = load(roots["ddp"], into, cooperative=True)
    check_equal(into, references["ddp"], "cooperative load of DDP replicas")
    job = check_read_once(extra.stats, "DDP, native")
    # Every rank reads about a quarter and receives the rest.
    for r in job["ranks"]:
        assert r["from_store"] < job["from_store"] / 2, job
        assert r["from_peers"] > job["from_store"] / 2, job
    # Read each on its own: every rank reads everything.
    plain = load(roots["ddp"], {"model": _ddp_model(3).state_dict()})
    alone = job_traffic(plain.stats)
    assert alone["from_store"] >= 4 * job["from_store"], (alone, job)
    into = {"model": _ddp_model(4).state_dict()}
    reader = StorageReader(roots["ddp-dcp"])
    dcp.load(into, storage_reader=reader)
    check_equal(into, references["ddp"], "dcp.load of DDP replicas")
    check_read_once(reader.stats, "DDP, dcp.load")

    # HSDP 2 x 2: two replicas of two shards.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 24))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    sd = {"model": hsdp(5).state_dict()}
    full = full_tensors(sd)
    if rank == 0:
        torch.save(full, references["hsdp"])
    Saver(roots["hsdp"]).save(2, sd).wait_committed()
    dcp.save(sd, storage_writer=StorageWriter(roots["hsdp-dcp"]))
    dist.barrier()
    for via in ("native", "dcp"):
        into = {"model": hsdp(6).state_dict()}
        if via == "native":
            stats = load(roots["hsdp"], into, cooperative=True).stats
        else:
            reader = StorageReader(roots["hsdp-dcp"])
            dcp.load(into, storage_reader=reader)
            stats = reader.stats
        check_equal(into, references["hsdp"], f"cooperative HSDP load ({via})")
        check_read_once(stats, f"HSDP, {via}")

    # A 1-D FSDP2 save of 4 ranks, for the 4 -> 3 load.
    model, optimizer = model_and_optimizer(world, seed=7)
    sd = state(model, optimizer)
    full = full_tensors(sd)
    if rank == 0:
        torch.save(full, references["fsdp"])
    Saver(roots["fsdp"]).save(3, sd).wait_committed()
    dcp.save(sd, storage_writer=StorageWriter(roots["fsdp-dcp"]))
    dist.barrier()
    dist.destroy_process_group()


def resharded(
    rank: int,
    world: int,
    port: int,
    roots: dict[str, str],
    references: dict[str, str],
    outcome: str,
) -> None:
    """Three ranks load the 4-rank FSDP2 save cooperatively (natively and through
    dcp.load), bitwise; then with rank 1 sending rank 2 a flipped bit: rank 2's CRC
    check catches it, reads those blocks from the store, and still loads bitwise.
    Last, rank 2 dies mid-exchange of a native load: see ``dead_peer``."""
    init(rank, world, port)
    for corrupt in (False, True):
        if corrupt:
            os.environ["CKPT_TEST_COOPERATIVE_CORRUPT"] = "1->2"
        for via in ("native", "dcp"):
            model, optimizer = model_and_optimizer(world, seed=11)
            into = state(model, optimizer)
            if via == "native":
                stats = load(roots["fsdp"], into, cooperative=True).stats
            else:
                reader = StorageReader(roots["fsdp-dcp"])
                dcp.load(into, storage_reader=reader)
                stats = reader.stats
            what = f"4 -> 3 ({via}{', a corrupted block' if corrupt else ''})"
            check_equal(into, references["fsdp"], what)
            if not corrupt:
                check_read_once(stats, what)
                continue
            job = job_traffic(stats)
            ranks = job["ranks"]
            assert ranks[2]["rejected"] > 0, (what, ranks)
            assert ranks[0]["rejected"] == ranks[1]["rejected"] == 0, (what, ranks)
            # The blocks rank 2 rejected were read again, by rank 2.
            assert job["from_store"] > ranks[0]["unique"], (what, job)
    os.environ.pop("CKPT_TEST_COOPERATIVE_CORRUPT")
    _die_mid_exchange(rank, roots["fsdp"], "native", outcome, into)


def dead_peer(rank: int, world: int, port: int, roots: dict[str, str], outcome: str) -> None:
    """Three ranks load the DDP replicas through dcp.load; rank 2 dies between
    reading its share and sending it."""
    init(rank, world, port)
    into = {"model": _ddp_model(8).state_dict()}
    _die_mid_exchange(rank, roots["ddp-dcp"], "dcp", outcome, into)


def _die_mid_exchange(rank: int, root: str, via: str, outcome: str, into: dict[str, Any]) -> None:
    """Rank 2 dies between reading its share and sending it; ranks 0 and 1 fail the
    load naming it, and write what they saw to ``outcome``.RANK."""
    os.environ["CKPT_TEST_COOPERATIVE_EXIT"] = "2"
    reader = StorageReader(root)
    try:
        if via == "native":
            load(root, into, cooperative=True)
        else:
            dcp.load(into, storage_reader=reader)
        seen = "loaded"
    except PeerLostError as e:
        seen = f"PeerLostError rank={e.rank}: {e}"
    except Exception as e:  # noqa: BLE001 - dcp.load fails in its own collective
        # DCP's error is its collective's, over the broken group; the reader kept
        # the peer's name.
        lost = reader.error
        seen = f"{type(e).__name__}; the reader's: " + (
            f"PeerLostError rank={lost.rank}: {lost}" if isinstance(lost, PeerLostError) else "none"
        )
    with open(f"{outcome}.{rank}", "w") as f:
        f.write(seen)
    # The group is broken: leave without tearing it down.
    os._exit(0)
