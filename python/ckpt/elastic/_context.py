"""What ``train`` gets for one generation: its ``Context`` (rank, world, device,
the agreed stop or regroup, saves fenced by the generation), and ``WorldChanged``,
raised in the training thread when the generation is over.

torch is imported by the methods that need it, so that ``import ckpt.elastic``
does not import it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt import _native
from ckpt.elastic._ending import PeerFailure, cooperative_sources, say
from ckpt.elastic._rollback import Rollbacks, bad_loss

if TYPE_CHECKING:
    from ckpt.torch import _api


class WorldChanged(Exception):  # noqa: N818 (it is a control-flow signal, not an error)
    """Raised in the training thread when its generation is over: a member was lost,
    the job regroups, or it shuts down. ``run`` catches it; ``train`` need not."""

    def __init__(self, generation: int, cause: str):
        super().__init__(f"generation {generation} is over: {cause}")
        self.generation = generation
        self.cause = cause

    def __reduce__(self):
        # Pickled (a gather of exceptions) with the arguments its constructor takes,
        # not the message that BaseException would hand back.
        return (type(self), (self.generation, self.cause))


class Stop:
    """SIGTERM/SIGINT: the first asks for a drain (the agreed step is saved), the
    second ends the process at once with 128 + the signal, as the launcher expects."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True


class NoAgent:
    """The agent of a fixed world: no control plane, nothing to report."""

    def progress(self, step: int) -> None:
        pass

    def collective_started(self) -> None:
        pass

    def collective_done(self) -> None:
        pass

    def regroup_requested(self) -> bool:
        return False

    def is_cancelled(self) -> bool:
        return False

    def directive(self) -> None:
        return None

    def set_checkpoint_generation(self, generation: int) -> None:
        pass

    def report(self, kind: str, **fields: Any) -> None:
        pass


class Context:
    """What ``train`` gets for one generation."""

    def __init__(
        self,
        agent: Any,
        assignment: Mapping[str, Any],
        backend: str,
        stop: Stop,
        rollbacks: Rollbacks | None = None,
    ):
        self._agent = agent
        self._stop = stop
        self._ending: str | None = None
        self._agreed: int | None = None
        self._committed: int | None = None
        self._timing: dict[str, float] = {}
        self._loaded: dict[str, Any] = {}
        self._stepped = threading.Event()
        #: This rank in the generation.
        self.rank: int = assignment["rank"]
        #: Ranks in the generation.
        self.world_size: int = assignment["world_size"]
        #: The control plane's generation number (grows with every re-formation).
        self.generation: int = assignment["generation"]
        #: Why the generation formed ("initial", "lost member …", "grow: …").
        self.cause: str = assignment["cause"]
        #: This process's rank on its node (``LOCAL_RANK``).
        self.local_rank: int = int(os.environ.get("LOCAL_RANK", "0"))
        #: The process group's backend.
        self.backend = backend
        import torch

        #: Where this rank's tensors live: ``cuda:LOCAL_RANK`` on NCCL, else the CPU.
        self.device = (
            torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")
        )
        self._run_id: str = assignment["run_id"]
        self._floor: int = assignment["checkpoint_generation_floor"]
        # In-memory copies (elastic ranks): this process's holder and every rank's
        # holding in this generation, by rank.
        self._copies: Any = None
        self._table: list[bytes] | None = None
        # Rollbacks: in a row (kept across generations by ``run``), in this
        # generation (the run ids of the saves after each), what ``resume`` loaded
        # into, the checkpointers to renew, the last step done, the last good loss.
        self._rollbacks = rollbacks if rollbacks is not None else Rollbacks()
        self._rolled = 0
        self._resumed: tuple[str, Any, Any] | None = None
        self._checkpointers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._done = 0
        self._good_loss: float | None = None
        # Snapshots: the checkpointer that takes them (the newest ``checkpointer``),
        # the one taken and not yet voted on and its step, the directory of the one
        # resumed from, the step of the first refused for the budget.
        self._snapshotter: Any = None
        self._pending: Any = None
        self._pending_step: int | None = None
        self._resumed_snapshot: str | None = None
        self._warned_budget: int | None = None
        #: What the last ``resume`` or ``rollback_if`` loaded (its ``ExtraState``:
        #: ``step``, every saved rank's non-tensor state, ``skipped`` …), or None.
        self.restored: _api.ExtraState | None = None

    @property
    def stopping(self) -> bool:
        """True once ``step`` returned True because this rank was asked to stop (a
        signal): save that step, wait for its commit, and return from ``train``. (The
        ranks that were not signalled save the same step; its commit ends their
        generation, and they go on in the next one without the stopped ranks.)"""
        return self._ending == "stop"

    def step(self, step: int) -> bool:
        """Step ``step`` is complete. Reports progress (a rank that stops calling this
        outside a collective for the progress timeout is declared hung) and agrees
        with the other ranks whether the job needs a checkpoint now: True when a rank
        was asked to stop, or ranks wait to join — then save ``step`` through
        ``checkpointer`` and wait for its commit before going on. Raises
        :class:`WorldChanged` when the generation is over."""
        self._agent.progress(step)
        self._done = step
        if not self._stepped.is_set():
            self._timing["first_step"] = time.monotonic()
            self._timing["first_step_unix"] = time.time()
            self._stepped.set()
        if self._agreed is not None:
            # The agreed checkpoint was saved (or the script went on without it):
            # a regroup ends the generation here.
            if self._committed is None or self._committed < self._agreed:
                raise RuntimeError(
                    f"ckpt.elastic: step {self._agreed} was agreed as a checkpoint "
                    "but not saved through ctx.checkpointer and committed"
                )
            raise WorldChanged(self.generation, "regroup at a committed checkpoint")
        self._check()
        if self._pending_step is not None:
            from ckpt.elastic import _snapshots

            pending, voted = self._pending, self._pending_step
            self._pending = self._pending_step = None
            _snapshots.vote(self, pending, voted)
        import torch
        import torch.distributed as dist

        flags = torch.tensor(
            [int(self._stop.requested), int(self._agent.regroup_requested())],
            dtype=torch.int32,
            device=self.device,
        )
        self._collective(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX))
        stop, regroup = (bool(v) for v in flags.tolist())
        if stop or regroup:
            # Every rank saves this step; the ranks that were signalled then leave,
            # the others end the generation at its commit and form the next one (a
            # fixed world has no next one: every rank stops).
            elastic = not isinstance(self._agent, NoAgent)
            self._ending = "regroup" if elastic and not self._stop.requested else "stop"
            self._agreed = step
            return True
        return False

    def checkpointer(
        self,
        url: str | os.PathLike,
        *,
        store_options: _api.StoreOptions | None = None,
        **config: Any,
    ) -> _api.Checkpointer:
        """A ``ckpt.torch.Checkpointer`` for this rank, fenced by the generation (its
        run id and checkpoint generation), whose commits are reported to the control
        plane (which is how waiting ranks are let in at a checkpoint). ``config`` and
        ``store_options`` as ``ckpt.torch.Checkpointer`` takes them. It is also the
        checkpointer :meth:`snapshot` takes its snapshots with.

        ``host_memory_budget`` (bytes) bounds what this rank's checkpointing holds:
        staging buffers, own copies and snapshots, and the replicas its in-memory
        copies holder pulls, as one budget. The holder outlives every generation and
        owns it; each generation's checkpointer counts in it, so a new snapshot can
        push out the holder's older ones. It must fit the committed snapshot and its
        replica, the staging of the next, and the store save's copies, or snapshots
        are refused (their rank votes against)."""
        budget = config.get("host_memory_budget")
        if budget is not None:
            config["host_memory_budget"] = int(budget)
        if self._copies is not None:
            config["_budget_of"] = self._copies
        if self._run_id is not None:
            config.setdefault("run_id", self._run_id)
        if self._copies is not None:
            # The staged file stays this rank's in-memory copy (nothing is copied).
            config.setdefault("keep_copy", True)
        config["generation"] = max(int(config.get("generation", 0)), self._floor)
        self._agent.set_checkpoint_generation(config["generation"])
        from ckpt.elastic._checkpointer import FencedCheckpointer

        checkpointer = FencedCheckpointer(
            self,
            url,
            rank=self.rank,
            world_size=self.world_size,
            store_options=store_options,
            **config,
        )
        self._checkpointers.add(checkpointer)
        self._snapshotter = checkpointer
        return checkpointer

    def snapshot(
        self, step: int, state_dict: Mapping[str, Any], *, overlapped: bool = False
    ) -> bool:
        """Snapshots this rank's ``state_dict`` at step ``step`` into host memory, for
        a recovery that loses less than the store's interval: call it after
        ``step(step)``, on every rank at the same steps, beside (or instead of) the
        periodic save. It stages the state as a save does (blocking while it copies,
        the same stall; with ``overlapped``, the copy runs while the script goes on,
        and the tensors must not be written until :meth:`snapshot_staged` returns:
        call it just before the optimizer step, as ``SaveHandle.wait_staged``),
        keeps it in this rank's memory and replicates it to its ring
        successor while the next step runs; the next ``step`` call commits it in the
        control plane when every rank holds its own and its replica (one
        all-gather). A failure the survivors' copies cover resumes from the newest
        committed snapshot when it is newer than the newest store commit
        (:meth:`resume`; rank 0 prints ``resumed from snapshot step S``); losing
        two ring neighbours resumes from the store. Non-tensor leaves (the data
        cursor) come with it.

        Snapshots use the checkpointer :meth:`checkpointer` made last (its
        ``host_memory_budget``): one that does not fit is not taken (its rank votes
        against; training goes on). Returns whether it was taken. Does nothing
        (False) without in-memory copies (a fixed world, ``memory_copies=False``)."""
        from ckpt.elastic import _snapshots

        if self._copies is None or self._table is None:
            return False
        if self._snapshotter is None:
            raise RuntimeError(
                "ckpt.elastic: ctx.snapshot needs ctx.checkpointer(url) first: its "
                "checkpointer takes the snapshots"
            )
        if self._pending_step is not None:
            # Two snapshots without a step between: vote on the older one first.
            pending, voted = self._pending, self._pending_step
            self._pending = self._pending_step = None
            _snapshots.vote(self, pending, voted)
        self._pending = _snapshots.take(self, step, state_dict, overlapped)
        self._pending_step = step
        return self._pending is not None

    def snapshot_staged(self) -> float:
        """Waits until the tensors of the last :meth:`snapshot` are copied (they may
        be written again after this); returns the seconds the copy took (0 when
        there is nothing to wait for). Needed only with ``overlapped=True``."""
        return 0.0 if self._pending is None else self._pending.staged()

    def host_bytes_held(self) -> dict[str, Any]:
        """Host memory this rank's checkpointing holds now, in bytes by kind
        (``total``, ``peak``, ``staging``, ``copies``, ``replicas``, ``snapshots``,
        ``snapshot_replicas``, ``budget``) and ``summary``, one line of it."""
        from ckpt.elastic import _snapshots

        return _snapshots.held(self)

    def resume(
        self,
        url: str | os.PathLike,
        state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        store_options: _api.StoreOptions | None = None,
    ) -> _api.ExtraState | None:
        """Loads the newest healthy commit under ``url`` (every rank the same one)
        into ``state_dict`` in place, resharded for this generation, and returns its
        ``ExtraState`` (``step``, every saved rank's non-tensor state, ``skipped``: the
        unhealthy commits passed over …); None when nothing is committed yet.

        Healthy: not judged unhealthy (a non-finite tensor or metric, replicas that
        disagreed, a failed ``health_check``); a commit of unknown health (written
        before health was recorded) is taken. Rank 0 prints a line for each newer
        commit passed over, with the reasons. ``state_dict`` may be a function that
        returns it, called only when there is something to load (``get_state_dict``
        gives a fresh optimizer state, which a run from scratch must not have); it is
        also what :meth:`rollback_if` loads into. The load counts as a wait on the
        other ranks, not as a hang. ``store_options`` as ``ckpt.torch.Checkpointer``
        takes them."""
        started = time.monotonic()
        url = os.fspath(url)
        self._resumed = (url, state_dict, store_options)
        try:
            choice = self._choose(url, store_options)
            resolved: list[Mapping[str, Any]] = []

            def once() -> Mapping[str, Any]:
                # The snapshot's load and, when it fails, the store's: the same state.
                if not resolved:
                    resolved.append(state_dict() if callable(state_dict) else state_dict)
                return resolved[0]

            extra = self._from_snapshot(once, None if choice is None else choice[0])
            if extra is None:
                if choice is None:
                    return None
                extra = self._load(url, once, store_options, *choice)
                tier = f"step {extra.step} of {url} ("
            else:
                # As the reference trainer says it.
                tier = f"snapshot step {extra.step} in memory (snapshot {self._resumed_snapshot}; "
            self._done = extra.step
            if self.rank == 0:
                say(
                    f"resumed from {tier}saved by {extra.world_size} ranks, resharded onto "
                    f"{self.world_size}; load {(time.monotonic() - started) * 1e3:.0f} ms; "
                    f"host memory {self.host_bytes_held()['summary']})"
                )
            return extra
        finally:
            self._timing["load"] = time.monotonic() - started

    def _from_snapshot(
        self, state_dict: Callable[[], Mapping[str, Any]], store_step: int | None
    ) -> _api.ExtraState | None:
        """Loads the newest committed snapshot when it is newer than ``store_step``
        and the survivors hold it (every rank the same choice); None otherwise, or
        when any rank failed to load it."""
        from ckpt.elastic import _snapshots

        record = _snapshots.choose(self, store_step)
        if record is None:
            return None
        extra = _snapshots.load(self, record, state_dict())
        if extra is None:
            return None
        self._resumed_snapshot = json.loads(record)["dir"]
        self._loaded = extra.stats
        self.restored = extra
        return extra

    def bad_loss(
        self, loss: Any, spike: float | Callable[[float], bool | str | None] | None = None
    ) -> tuple[bool, str]:
        """This rank's verdict on ``loss`` (a number or a one-element tensor), for
        :meth:`rollback_if`: ``(True, reason)`` when it is not finite, or a spike;
        ``(False, "")`` otherwise. ``spike``: a callable taking the loss (True or a
        reason when it is a spike), or a factor (a loss above ``spike`` times the
        last good one this rank saw since the last load is a spike)."""
        bad, why = bad_loss(loss, spike, self._good_loss)
        if not bad:
            self._good_loss = float(loss.detach().item() if hasattr(loss, "detach") else loss)
        return bad, why

    def rollback_if(
        self,
        bad: bool,
        reason: str = "",
        *,
        step: int | None = None,
        state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    ) -> int | None:
        """Goes back to the newest healthy commit when any rank's ``bad`` is true.

        A collective: every rank calls it at the same point of every step, once the
        step's loss is known (before the optimizer writes the parameters, before
        ``step``). The ranks agree on the flag (one all-reduce); when no rank asked,
        it returns None. When one did, the saves in flight through this context's
        checkpointers end first (their commits count), then every rank loads the
        newest healthy commit under the ``resume`` URL into the ``resume`` state (or
        ``state_dict``), resharded for this world, in this process, with the
        non-tensor state that commit saved (the data cursor): :attr:`restored` is its
        ``ExtraState``. Rank 0 prints ``rolled back from step B to step S:
        <reasons>`` (B: ``step``, by default the step after the last one ``step`` or
        a load reported), and it returns S; the script trains on from S. Later saves
        through this context's checkpointers use a run id of their own, so that the
        steps saved again get directories of their own.

        Rollbacks to the same commit in a row (no commit since of a step past the one
        that asked) are counted: one more than ``run``'s ``max_rollbacks`` raises
        :class:`RollbackLoop` on every rank, which ends the job with a non-zero
        exit. Raises ``RuntimeError`` when ``resume`` was not called, or when no
        healthy commit is there to go back to."""
        import torch
        import torch.distributed as dist

        from ckpt.elastic import _snapshots

        self._check()
        asked = self._done + 1 if step is None else step
        flag = torch.tensor([int(bool(bad))], dtype=torch.int32, device=self.device)
        self._collective(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))
        if not flag.item():
            return None
        why: list[Any] = [None] * self.world_size
        mine = f"rank {self.rank}: {reason or 'asked for a rollback'}" if bad else None
        self._collective(lambda: dist.all_gather_object(why, mine))
        reasons = "; ".join(w for w in why if w)
        if self._resumed is None:
            raise RuntimeError(
                f"ckpt.elastic: step {asked} asked for a rollback ({reasons}), but "
                "ctx.resume(url, state) was not called: it says where to go back to"
            )
        url, state, options = self._resumed
        started = time.monotonic()
        # Closing a checkpointer waits for its saves in flight (their commits count
        # in the choice); the saves after the rollback use a run id of their own.
        self._rolled += 1
        self._agent.collective_started()
        try:
            for checkpointer in list(self._checkpointers):
                checkpointer._renew(self._rolled)
        finally:
            self._agent.collective_done()
        choice = self._choose(url, options)
        if choice is None:
            raise RuntimeError(
                f"ckpt.elastic: step {asked} asked for a rollback ({reasons}), but {url} "
                "holds no healthy commit to go back to"
            )
        target = choice[0]
        self._rollbacks.count(asked, target, reasons)
        # A snapshot taken before the rollback holds the state the job goes back
        # from: the one not yet voted on is dropped, the committed one is never
        # resumed from (every rank notes it: any may be rank 0 of a later world).
        self._pending = self._pending_step = None
        self._rollbacks.stale_snapshot = _snapshots.committed_record(self)
        self._load(url, state if state_dict is None else state_dict, options, *choice)
        self._done, self._committed, self._good_loss = target, target, None
        if self.rank == 0:
            say(
                f"rolled back from step {asked} to step {target}: {reasons} "
                f"(load {(time.monotonic() - started) * 1e3:.0f} ms)"
            )
        return target

    def _choose(
        self, url: str, store_options: _api.StoreOptions | None
    ) -> tuple[int, list[dict[str, Any]]] | None:
        """The newest healthy (or health unknown) committed step under ``url`` as
        rank 0 sees it, with the unhealthy commits it passed over (``{"step", "dir",
        "reasons"}``, newest first), or None: every rank loads the same one. Rank 0's
        store error is every rank's (not a peer's failure)."""
        status, value, transient = self._collective(lambda: _newest_healthy(url, store_options))
        if status == "error":
            error = _native.CkptError(f"rank 0 could not choose the checkpoint to load: {value}")
            error.transient = transient
            raise error
        return value

    def _load(
        self,
        url: str,
        state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        store_options: _api.StoreOptions | None,
        step: int,
        skipped: list[dict[str, Any]],
    ) -> _api.ExtraState:
        """Loads commit ``step`` (the newest healthy one, chosen by rank 0, which
        passed over ``skipped``) into ``state_dict``, from the in-memory copies
        first."""
        from ckpt.torch import _api

        if self.rank == 0:
            for entry in skipped:
                reasons = "; ".join(entry["reasons"]) or "no reason recorded"
                say(f"passing over unhealthy step {entry['step']} ({entry['dir']}): {reasons}")
        if callable(state_dict):
            state_dict = state_dict()
        # Reading is not being hung: it counts as a wait, as a collective does.
        self._agent.collective_started()
        # The in-memory copies where some rank holds one (a recovery in the same
        # processes); else every byte read from the store once by the job and
        # passed between the ranks (a fresh start, or copies off).
        held = self._table is not None and any(
            json.loads(record.decode().strip() or "{}").get("held") for record in self._table
        )
        copies = (self._copies, self._table) if self._copies is not None and held else None
        try:
            extra = _api.load(
                url,
                state_dict,
                step=step,
                rank=self.rank,
                copies=copies,
                store_options=store_options,
                cooperative=copies is None,
            )
        finally:
            self._agent.collective_done()
        extra.skipped = skipped
        self._loaded = extra.stats
        if self.rank == 0 and extra.stats.get("bytes_received_from_peers"):
            say(f"loaded step {extra.step}: {cooperative_sources(extra.stats)}")
        self.restored = extra
        return extra

    def _committed_step(self, step: int) -> None:
        self._committed = max(self._committed or 0, step)
        self._rollbacks.committed(step)
        if self.rank == 0:
            try:
                self._agent.report("committed", step=step)
            except _native.ElasticError:
                pass

    def _check(self) -> None:
        if self._agent.is_cancelled():
            directive = self._agent.directive() or {}
            raise WorldChanged(
                self.generation, directive.get("cause") or directive.get("kind", "aborted")
            )

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` (collectives) as a wait on peers; an error of an aborted
        generation becomes :class:`WorldChanged`."""
        self._agent.collective_started()
        try:
            return fn()
        except WorldChanged:
            raise
        except Exception as e:
            self._check()
            raise PeerFailure(str(e)) from e
        finally:
            self._agent.collective_done()


def _newest_healthy(url: str, store_options: _api.StoreOptions | None) -> tuple[str, Any, bool]:
    """Rank 0's choice for ``Context._choose``, broadcast: ``("ok", (step, skipped) or
    None, False)``, or ``("error", message, transient)``."""
    import torch.distributed as dist

    from ckpt.torch import _api

    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            newest = _api.latest(url, healthy=True, store_options=store_options)
            found = (newest["step"], list(newest.get("skipped", []))) if newest else None
            if found is None:
                _no_healthy(url, store_options)
            choice[0] = ("ok", found, False)
        except _native.CkptError as e:
            choice[0] = ("error", f"{type(e).__name__}: {e}", bool(getattr(e, "transient", False)))
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _no_healthy(url: str, store_options: _api.StoreOptions | None) -> None:
    """Says so when ``url`` holds commits but none healthy (a resume then starts from
    scratch, a rollback fails)."""
    from ckpt.torch import _api

    newest = _api.latest(url, healthy=False, store_options=store_options)
    if newest is not None:
        reasons = "; ".join(newest.get("reasons", [])) or "no reason recorded"
        say(
            f"no healthy commit under {url}: every commit is unhealthy, the newest "
            f"(step {newest['step']}) for: {reasons}"
        )
