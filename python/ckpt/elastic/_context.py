"""What ``train`` gets for one generation: its ``Context`` (rank, world, device,
the agreed stop or regroup, saves fenced by the generation), and ``WorldChanged``,
raised in the training thread when the generation is over.

torch is imported by the methods that need it, so that ``import ckpt.elastic``
does not import it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckpt import _native
from ckpt.elastic._ending import PeerFailure

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

    def __init__(self, agent: Any, assignment: Mapping[str, Any], backend: str, stop: Stop):
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
        ``store_options`` as ``ckpt.torch.Checkpointer`` takes them."""
        if self._run_id is not None:
            config.setdefault("run_id", self._run_id)
        if self._copies is not None:
            # The staged file stays this rank's in-memory copy (nothing is copied).
            config.setdefault("keep_copy", True)
        config["generation"] = max(int(config.get("generation", 0)), self._floor)
        self._agent.set_checkpoint_generation(config["generation"])
        from ckpt.elastic._checkpointer import FencedCheckpointer

        return FencedCheckpointer(
            self,
            url,
            rank=self.rank,
            world_size=self.world_size,
            store_options=store_options,
            **config,
        )

    def resume(
        self,
        url: str | os.PathLike,
        state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        *,
        store_options: _api.StoreOptions | None = None,
    ) -> _api.ExtraState | None:
        """Loads the newest committed checkpoint under ``url`` (every rank the same
        one) into ``state_dict`` in place, resharded for this generation, and returns
        its ``ExtraState`` (``step``, every saved rank's non-tensor state …); None when
        nothing is committed yet. ``state_dict`` may be a function that returns it,
        called only when there is something to load (``get_state_dict`` gives a fresh
        optimizer state, which a run from scratch must not have). The load counts as
        a wait on the other ranks, not as a hang. ``store_options`` as
        ``ckpt.torch.Checkpointer`` takes them."""
        from ckpt.torch import _api

        started = time.monotonic()
        try:
            step = self._collective(lambda: _newest_step(os.fspath(url), store_options))
            if step is None:
                return None
            if callable(state_dict):
                state_dict = state_dict()
            # Reading is not being hung: it counts as a wait, as a collective does.
            self._agent.collective_started()
            copies = (self._copies, self._table) if self._copies is not None else None
            try:
                extra = _api.load(
                    url,
                    state_dict,
                    step=step,
                    rank=self.rank,
                    copies=copies,
                    store_options=store_options,
                )
            finally:
                self._agent.collective_done()
            self._loaded = extra.stats
            return extra
        finally:
            self._timing["load"] = time.monotonic() - started

    def _committed_step(self, step: int) -> None:
        self._committed = max(self._committed or 0, step)
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


def _newest_step(url: str, store_options: _api.StoreOptions | None) -> int | None:
    """The newest committed step under ``url`` as rank 0 sees it, or None: every rank
    resumes from the same one."""
    import torch.distributed as dist

    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        newest = _native.latest(url, store_options)
        choice[0] = newest["step"] if newest else None
    dist.broadcast_object_list(choice, src=0)
    return choice[0]
