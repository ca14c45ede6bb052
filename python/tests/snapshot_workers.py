"""What each rank process runs in the snapshot binding tests (spawned: importable
functions only): a real gloo process group, each rank's in-memory copies holder
serving on loopback, the vote all-gathered on the group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from workers import init

from ckpt import _native
from ckpt.torch import Checkpointer, _api

ROWS, COLS = 7, 5  # 7 rows on 3 ranks: uneven shards


def whole(step: int) -> torch.Tensor:
    """The tensor snapshotted at ``step``, whole (every rank computes the same)."""
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 1000 + step


def gather(items: Any) -> list[Any]:
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, items)
    return every


def vote_commit_drop_share(rank: int, world: int, port: int, root: str) -> None:
    """Snapshots step 1 (one rank votes against: not committed) and step 2 (all
    ready: committed on every rank, recorded), then rank 2's holder is let go and
    the survivors (ranks 0 and 1) gather, open and load the snapshot from their
    copies alone: bitwise, the lost rank's file from its successor's replica, the
    non-tensor state with it."""
    init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    copies = _native.Copies("127.0.0.1")
    table = gather(copies.holding())
    checkpointer = Checkpointer(root, rank=rank, world_size=world)

    def take(step: int) -> _native.Snapshot:
        sd = {
            "w": distribute_tensor(whole(step), mesh, [Shard(0)]),
            "data": {"cursor": step * 10 + rank},
        }
        handle = checkpointer.snapshot(step, sd, overlapped=False)
        snapshot = handle.wait_ready()
        assert snapshot.step == step and snapshot.rank == rank and snapshot.world_size == world
        assert snapshot.nbytes > 0
        assert copies.keep_snapshot(snapshot)
        copies.replicate_snapshot(snapshot, table, rank)
        assert copies.wait_for_pulls(30.0)
        return snapshot

    # Step 1: rank 1 votes against (it "took none"): no commit, rank 1 named.
    first = take(1)
    mine = _native.vote_against(1) if rank == 1 else copies.vote(first)
    assert len(mine) == _native.VOTE_SIZE
    assert _native.tally(gather(mine), 1) == (False, [1])
    # A vote on another step is against too.
    assert _native.tally(gather(copies.vote(first)), 2) == (False, [0, 1, 2])
    assert copies.committed_snapshot() is None

    second = take(2)
    dirs = gather(second.dir)
    assert len(set(dirs)) == 1 and "snap" in second.dir, dirs
    ready, crcs = _native.tally(gather(copies.vote(second)), 2)
    assert ready and crcs == gather(second.part_crc32), crcs
    copies.commit_snapshot(second.dir, crcs)
    assert copies.committed_snapshot() == (second.dir, crcs)
    record = _native.snapshot_record(second, crcs)
    assert gather(record) == [record] * world  # every rank could record it
    assert _native.record_uncovered(record, table) == [0, 1, 2]  # gathered before
    assert _native.record_uncovered(record, gather(copies.holding())) == []

    # Rank 2 is lost: its holder goes. The survivors' table covers its file (rank
    # 0 holds its replica); without rank 0's holding, rank 2's is uncovered.
    if rank == 2:
        del copies
    survivors = gather(copies.holding() if rank < 2 else None)[:2]
    assert _native.record_uncovered(record, survivors) == []
    assert _native.record_uncovered(record, survivors[1:]) == [2]
    payload: list[Any] = [None]
    if rank == 0:
        payload[0] = _native.share_snapshot(record, copies, survivors, 0)
    dist.broadcast_object_list(payload, src=0)
    if rank < 2:
        reader = _native.Reader.from_snapshot(payload[0])
        assert reader.step == 2 and reader.world_size == world
        into = {"w": torch.zeros(ROWS, COLS), "data": {"cursor": -1}}
        extra = _api.load_reader(reader, into, rank, (copies, survivors))
        assert torch.equal(into["w"], whole(2)), into["w"]
        assert into["data"]["cursor"] == 20 + rank
        assert [r["data.cursor"] for r in extra.ranks] == [20, 21, 22]
        stats = extra.stats
        assert stats["files_from_store"] == 0 and stats["bytes_read"] == 0, stats
        assert stats["own_bytes"] + stats["peer_bytes"] > 0, stats
    # A snapshot whose record does not match its table is refused by the reader.
    if rank == 0:
        try:
            _native.Reader.from_snapshot(payload[0][:-1])
        except _native.CkptError:
            pass
        else:
            raise AssertionError("a truncated share opened")
    dist.barrier()
    checkpointer.close()
    dist.destroy_process_group()
