"""The memory tier of ``ckpt.elastic``: ``ctx.snapshot`` and the resume from the
newest committed snapshot the survivors hold.

Why: a store save costs the store's bandwidth, so a job saves every few hundred
steps and a failure loses, in every rank, the work since. A snapshot costs one
staging copy (the save's) and a replica's transfer to the ring successor, so it can
be taken every step or few; a failure the survivors' copies cover then loses at
most that interval. The store stays the durability guarantee.

How, per snapshot of step S (taken at S's boundary, after ``ctx.step(S)``):

1. the training thread stages the state (a save's copy: blocking, or overlapped
   with the next step's forward and backward until ``ctx.snapshot_staged()``) and
   goes on; a thread waits for the checksum, keeps the snapshot in this rank's
   holder and asks for a replica of the ring predecessor's file of the same
   snapshot;
2. at the next step boundary (``ctx.step(S + 1)``: the replica transfer overlapped
   a step) every rank votes (holds its own file and its replica), the votes are
   all-gathered on the process group, and when every rank voted ready every rank
   notes the commit in its holder and rank 0 records it in the control plane, which
   keeps it across re-formations (and accepts it only from the running generation).

At a resume, rank 0 reads the record; it is used when it is newer than the newest
healthy store commit and every file of it is held by a survivor (the holdings all
ranks gathered). Rank 0 then gathers its parts and broadcasts them, every rank
loads from the copies (each block checked), and a failure on any rank (agreed with
an all-reduce) falls back to the store commit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt import _native
from ckpt.elastic._ending import say

if TYPE_CHECKING:
    from ckpt.elastic._context import Context

# How long the vote waits for replicas still being pulled: a replica that is not in
# by then makes its rank vote against (the next snapshot is voted on instead).
PULL_WAIT_S = 2.0


class Pending:
    """A snapshot taken and not yet voted on: its handle, and the thread that keeps
    it and asks for the predecessor's replica once it is checksummed."""

    def __init__(self, step: int, handle: Any, ctx: Context):
        self.step = step
        self.snapshot: _native.Snapshot | None = None
        self.error: BaseException | None = None
        self._handle = handle
        self._thread = threading.Thread(target=self._keep, args=(ctx,), daemon=True)
        self._thread.start()

    def _keep(self, ctx: Context) -> None:
        try:
            snapshot = self._handle._native.wait_ready()
            if ctx._copies.keep_snapshot(snapshot):
                ctx._copies.replicate_snapshot(snapshot, ctx._table, ctx.rank)
                self.snapshot = snapshot
        except Exception as e:  # noqa: BLE001 (a snapshot that failed is a vote against)
            self.error = e

    def staged(self) -> float:
        """Waits until the snapshotted tensors are copied (they may be written
        again); returns the seconds the copy took."""
        handle = self._handle
        return 0.0 if handle is None else handle.wait_staged()

    def kept(self) -> None:
        """Waits until the snapshot is kept and its replica asked for."""
        self._thread.join()
        self._handle = None

    def vote(self, copies: Any, rank: int) -> bytes:
        if self.error is not None:
            say(f"rank {rank}: snapshot of step {self.step} failed: {self.error}")
        if self.snapshot is None:
            return _native.vote_against(self.step)
        return copies.vote(self.snapshot)


def take(
    ctx: Context, step: int, state_dict: Mapping[str, Any], overlapped: bool
) -> Pending | None:
    """``ctx.snapshot``: stages ``state_dict`` (as a save's copy: blocking, or
    overlapped until ``Pending.staged``) and starts keeping it; None when the snapshot
    was not taken (over the budget: a vote against at the next boundary)."""
    checkpointer = ctx._snapshotter
    try:
        handle = checkpointer.snapshot(step, state_dict, overlapped=overlapped)
    except _native.OverBudgetError as e:
        if ctx.rank == 0 or ctx._warned_budget is None:
            say(f"rank {ctx.rank}: snapshot of step {step} not taken: {e}")
        ctx._warned_budget = step
        return None
    return Pending(step, handle, ctx)


def vote(ctx: Context, pending: Pending | None, step: int) -> int | None:
    """Every rank's vote on the snapshot of ``step`` (a collective); commits it when
    every rank voted ready. Returns the committed step, or None."""
    import torch.distributed as dist

    copies = ctx._copies
    if pending is None:
        mine = _native.vote_against(step)
    else:
        ctx._agent.collective_started()
        try:
            # The replica is asked for once the snapshot is kept: wait for that
            # first, then for the replica.
            pending.kept()
            copies.wait_for_pulls(PULL_WAIT_S)
        finally:
            ctx._agent.collective_done()
        mine = pending.vote(copies, ctx.rank)
    votes: list[Any] = [None] * ctx.world_size
    ctx._collective(lambda: dist.all_gather_object(votes, mine))
    ready, table = _native.tally(votes, step)
    if not ready:
        return None
    snapshot = pending.snapshot if pending is not None else None
    if snapshot is None:  # every rank voted ready, so this rank has one
        return None
    copies.commit_snapshot(snapshot.dir, table)
    if ctx.rank == 0:
        record = _native.snapshot_record(snapshot, table)
        try:
            ctx._agent.commit_snapshot(record)
        except _native.ElasticError as e:
            # Fenced (the generation is over) or the control plane unreachable: the
            # snapshot is not a resume point; the next one may be.
            say(f"snapshot of step {step} not recorded: {e}")
            return None
    return step


def choose(ctx: Context, store_step: int | None) -> str | None:
    """The committed snapshot record every rank resumes from (a collective: rank 0
    decides, every rank gets its choice), or None: none recorded, not newer than
    the store's ``store_step``, or not covered by the survivors' holdings."""
    import torch.distributed as dist

    if ctx._copies is None or ctx._table is None:
        return None
    choice: list[Any] = [None]
    if ctx.rank == 0:
        choice[0] = _rank0_choice(ctx, store_step)
    ctx._collective(lambda: dist.broadcast_object_list(choice, src=0))
    return choice[0]


def committed_record(ctx: Context) -> str | None:
    """The control plane's newest committed snapshot record (None: none, or no
    control plane, or it could not be read)."""
    committed = getattr(ctx._agent, "committed_snapshot", None)
    if committed is None:
        return None
    try:
        return committed()
    except _native.ElasticError as e:
        say(f"no snapshot to resume from: the control plane could not be read ({e})")
        return None


def _rank0_choice(ctx: Context, store_step: int | None) -> str | None:
    record = committed_record(ctx)
    if not record:
        return None
    step = json.loads(record)["step"]
    if record == ctx._rollbacks.stale_snapshot:
        say(f"snapshot of step {step} passed over: it was taken before a rollback")
        return None
    if store_step is not None and step <= store_step:
        return None
    try:
        uncovered = _native.record_uncovered(record, ctx._table)
    except _native.CkptError as e:
        say(f"snapshot of step {step} passed over: {e}")
        return None
    if uncovered:
        say(
            f"snapshot of step {step} passed over: no survivor holds the files of ranks "
            f"{', '.join(map(str, uncovered))} of its world; resuming from the store"
        )
        return None
    return record


def load(ctx: Context, record: str, state_dict: Mapping[str, Any]) -> Any:
    """Loads the snapshot ``record`` into ``state_dict`` on every rank, from the
    survivors' copies (a collective). Returns its ``ExtraState``, or None when any
    rank failed (every rank then resumes from the store)."""
    import torch
    import torch.distributed as dist

    from ckpt.torch import _api

    payload: list[Any] = [None]
    if ctx.rank == 0:
        try:
            payload[0] = ("ok", _native.share_snapshot(record, ctx._copies, ctx._table, 0))
        except _native.CkptError as e:
            payload[0] = ("error", f"rank 0 could not gather it: {type(e).__name__}: {e}")
    ctx._agent.collective_started()
    try:
        ctx._collective(lambda: dist.broadcast_object_list(payload, src=0))
        status, value = payload[0]
        extra, why = None, value
        if status == "ok":
            try:
                reader = _native.Reader.from_snapshot(value)
                extra = _api.load_reader(reader, state_dict, ctx.rank, (ctx._copies, ctx._table))
            except _native.CkptError as e:
                why = f"rank {ctx.rank}: {type(e).__name__}: {e}"
        failed = torch.tensor([int(extra is None)], dtype=torch.int32, device=ctx.device)
        ctx._collective(lambda: dist.all_reduce(failed, op=dist.ReduceOp.MAX))
        if failed.item():
            reasons: list[Any] = [None] * ctx.world_size
            mine = why if extra is None else None
            ctx._collective(lambda: dist.all_gather_object(reasons, mine))
            if ctx.rank == 0:
                step = json.loads(record)["step"]
                say(
                    f"snapshot of step {step} could not be loaded "
                    f"({'; '.join(r for r in reasons if r)}); resuming from the store"
                )
            return None
        return extra
    finally:
        ctx._agent.collective_done()


def held(ctx: Context) -> dict[str, Any]:
    """Host memory held by this rank's checkpointing: the budget its copies holder
    owns and every generation's checkpointer counts in (staging, own copies and
    snapshots, replicas), or without a holder its newest checkpointer's."""
    kinds = ("total", "peak", "staging", "copies", "replicas", "snapshots", "snapshot_replicas")
    out: dict[str, Any] = dict.fromkeys(kinds, 0)
    out["budget"] = None
    sources = []
    if ctx._copies is not None:
        sources.append(ctx._copies.host_bytes_held())
    elif ctx._snapshotter is not None:
        sources.append(ctx._snapshotter.host_bytes_held())
    for source in sources:
        for kind in kinds:
            out[kind] += source[kind]
        if source["budget"] is not None:
            out["budget"] = (out["budget"] or 0) + source["budget"]
    mib = 1 << 20
    out["summary"] = (
        f"{out['total'] / mib:.1f} MiB held (staging {out['staging'] / mib:.1f}, copies "
        f"{out['copies'] / mib:.1f}, replicas {out['replicas'] / mib:.1f}, snapshots "
        f"{out['snapshots'] / mib:.1f}, snapshot replicas {out['snapshot_replicas'] / mib:.1f}; "
        f"peak {out['peak'] / mib:.1f}"
        + (f" of a {out['budget'] / mib:.1f} MiB budget)" if out["budget"] else ", no budget)")
    )
    return out
