"""The memory tier's bindings (``Checkpointer.snapshot``, the ``Copies`` snapshot
calls, ``tally``, ``share_snapshot``, ``Reader.from_snapshot``) without a launcher:
3 ranks on a real gloo group snapshot, vote, commit, lose one rank's holder and load
the snapshot bitwise from the survivors' copies; and the host memory budget, which
a snapshot never passes."""

from __future__ import annotations

import pytest
import snapshot_workers
import torch
from conftest import spawn

from ckpt import _native
from ckpt.torch import Checkpointer

MIB = 1 << 20


def test_three_ranks_snapshot_vote_commit_and_load_from_the_survivors(root):
    spawn(snapshot_workers.vote_commit_drop_share, 3, root)


def test_a_state_three_times_the_budget_is_not_snapshotted(root):
    budget = 4 * MIB
    with Checkpointer(root, rank=0, world_size=1, host_memory_budget=budget) as checkpointer:
        big = {"w": torch.ones(3 * budget // 4)}  # float32: 3 budgets
        with pytest.raises(_native.OverBudgetError):
            checkpointer.snapshot(1, big)
        held = checkpointer.host_bytes_held()
        assert held["budget"] == budget
        assert held["peak"] <= budget, held
        assert held["snapshots"] == 0, held


def test_snapshots_within_the_budget_let_the_older_ones_go(root):
    budget = 4 * MIB
    with Checkpointer(root, rank=0, world_size=1, host_memory_budget=budget) as checkpointer:
        copies = _native.Copies("127.0.0.1", checkpointer._native)
        state = {"w": torch.zeros(MIB // 4)}  # 1 MiB
        kept = 0
        for step in range(1, 9):
            state["w"].fill_(step)
            try:
                handle = checkpointer.snapshot(step, state, overlapped=False)
            except _native.OverBudgetError:
                continue
            assert handle.step == step and handle.stall >= 0
            assert handle.host_bytes_held()["budget"] == budget
            snapshot = handle.wait_ready()
            assert snapshot.nbytes >= MIB
            kept += copies.keep_snapshot(snapshot)
            if step == 2:
                # The committed one is kept until a newer one commits.
                copies.commit_snapshot(snapshot.dir, [snapshot.part_crc32])
            held = checkpointer.host_bytes_held()
            assert held["peak"] <= budget, held
            # The holder counts in the checkpointer's budget: one bound for both.
            assert copies.host_bytes_held()["budget"] == budget
        assert kept >= 6, kept
        held = checkpointer.host_bytes_held()
        assert 0 < held["snapshots"] <= budget, held
        assert held["peak"] <= budget, held
        assert "budget" in held["summary"], held
        # The committed snapshot of step 2 is still held.
        committed = copies.committed_snapshot()
        assert committed is not None and committed[0].startswith("step-00000002/"), committed


class _Agent:
    def __init__(self, record: str | None):
        self.record = record

    def committed_snapshot(self) -> str | None:
        return self.record


def test_a_resume_takes_the_snapshot_only_when_newer_covered_and_not_rolled_back(root):
    """Rank 0's choice of ``ctx.resume`` (``_snapshots._rank0_choice``) on a real
    record of a world of one."""
    from types import SimpleNamespace

    from ckpt.elastic import _snapshots
    from ckpt.elastic._rollback import Rollbacks

    with Checkpointer(root, rank=0, world_size=1) as checkpointer:
        copies = _native.Copies("127.0.0.1", checkpointer._native)
        snapshot = checkpointer.snapshot(7, {"w": torch.ones(8)}, overlapped=False).wait_ready()
        assert copies.keep_snapshot(snapshot)
        ready, crcs = _native.tally([copies.vote(snapshot)], 7)
        assert ready, crcs
        copies.commit_snapshot(snapshot.dir, crcs)
        record = _native.snapshot_record(snapshot, crcs)
        ctx = SimpleNamespace(
            _agent=_Agent(record), _table=[copies.holding()], _rollbacks=Rollbacks()
        )
        assert _snapshots._rank0_choice(ctx, None) == record
        assert _snapshots._rank0_choice(ctx, 6) == record
        assert _snapshots._rank0_choice(ctx, 7) is None  # the store's commit is as new
        # Held by no survivor: the store.
        assert (
            _snapshots._rank0_choice(
                SimpleNamespace(**{**vars(ctx), "_table": [_native.Copies("127.0.0.1").holding()]}),
                None,
            )
            is None
        )
        # Taken before a rollback: never resumed from.
        ctx._rollbacks.stale_snapshot = record
        assert _snapshots._rank0_choice(ctx, None) is None
        assert (
            _snapshots._rank0_choice(SimpleNamespace(**{**vars(ctx), "_agent": _Agent(None)}), None)
            is None
        )
