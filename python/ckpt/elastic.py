"""Elastic PyTorch training: survivors of a lost rank keep training, in the same
processes, on a smaller world resharded from the newest checkpoint.

A script started by ``ckpt launch`` with an elastic flag (``--min-ranks``,
``--max-restarts``, ``--nnodes``, ``--rdzv``) calls :func:`run` once::

    def train(ctx):
        model, opt = build(ctx.device)
        step = ctx.resume(args.ckpt, state(model, opt))      # newest commit, resharded
        ckpt = ctx.checkpointer(args.ckpt)
        while step < args.steps:
            ...one step...
            step += 1
            if ctx.step(step) or step % every == 0:
                ckpt.save(step, state(model, opt)).wait_committed()
                if ctx.stopping:
                    return

    ckpt.elastic.run(train, backend="gloo")

Each turn of :func:`run` is a *generation* of the job, formed by ckpt's control
plane (the library's agent, through the binding: the same agent and protocol as the
reference trainer's): rendezvous, a process group for that generation's rank and
world (a store of its own, so that a rank of another generation cannot join it),
``train(ctx)``, and whatever ended it:

- a lost or hung member: the agent's thread aborts the process group (on gloo it
  shuts the group's sockets down, which fails a collective blocked on a dead or a
  stopped peer at once; on NCCL it aborts the communicators), the training thread
  gets :class:`WorldChanged`, the group is torn down, and ``train`` is called again
  in the next generation, where ``ctx.resume`` loads the newest commit resharded;
- a regroup (ranks wait to join) or a stop (SIGTERM or SIGINT to any rank): the
  ranks agree on a step through ``ctx.step``, save it, and the generation ends at
  that commit; stopped ranks exit with 75, the others go on;
- ``train`` returned: the job trained to its end; every rank exits 0.

Saves go through ``ctx.checkpointer``, fenced by the generation: its run id and
checkpoint generation are the generation's, so a rank of an older generation (a
process resumed after SIGSTOP) can commit nothing over a newer one.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckpt import _native
from ckpt.torch import _api

#: A rank that stopped on SIGTERM/SIGINT after the agreed final save (EX_TEMPFAIL).
EXIT_STOPPED = 75

#: A survivor whose training thread stayed blocked in a collective after the abort
#: (gloo can leave one waiting on pairs it already closed, until the group's
#: timeout): the process cannot leave its generation, a fresh one can join the next.
#: ``ckpt launch`` starts it again at once, without counting a restart.
EXIT_WEDGED = 76

__all__ = ["EXIT_STOPPED", "EXIT_WEDGED", "Context", "WorldChanged", "run"]


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


class _Stop:
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


def _sockets() -> dict[int, int]:
    """This process's sockets: descriptor number → inode."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of the host's network namespace: inode → (local port,
    remote port, state; "0A" is listening)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, remote = (int(c.rsplit(":", 1)[1], 16) for c in cols[1:3])
                    out[int(cols[9])] = (local, remote, cols[3])
        except FileNotFoundError:
            pass
    return out


def _shut_down_store_connections(port: int) -> int:
    """Shuts down this process's connections to or from the store on ``port`` (the
    client's, and the server's side where this process serves it); returns how many.
    Each descriptor is duplicated and its inode checked first, so a number closed
    and reused meanwhile is left alone; shutdown(2) acts on the socket, so closing
    the duplicate leaves the store's own descriptor open."""
    tcp = _tcp_sockets()
    count = 0
    for fd, inode in _sockets().items():
        local, remote, state = tcp.get(inode, (0, 0, "0A"))
        if state == "0A" or port not in (local, remote):
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inode:
                continue
            with socket.socket(fileno=dup) as conn:
                dup = -1  # the socket object closes it
                conn.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            if dup >= 0:
                os.close(dup)
    return count


class _Forming:
    """Makes the formation of generation ``generation``'s process group abortable.
    Its waits (the store's barrier, gloo's exchange of addresses) are blocking calls
    with the group's timeout, minutes: a peer that never arrives (dropped, or still
    stuck in the previous generation) would keep this rank there long after the
    control plane ended the generation. Once the agent aborts it, a thread shuts
    down the store's connections (again as new ones appear) until the formation
    ends, which makes every such wait fail at once."""

    def __init__(self, agent: Any, generation: int):
        self.agent, self.generation = agent, generation
        self.port: int | None = None
        self.done = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.is_set():
            if self.agent.wait_abort(self.generation, 0.2):
                break
        else:
            return
        while not self.done.is_set():
            if self.port is not None:
                _shut_down_store_connections(self.port)
            self.done.wait(0.1)


def _group_sockets(before: Mapping[int, int], store_port: int) -> list[tuple[int, int]]:
    """The connections a gloo process group opened since ``before``, as (descriptor,
    inode): not its listener (shutting that down ends the process: gloo's accept
    loop treats the error as fatal) and not the store's connections."""
    tcp = _tcp_sockets()
    out = []
    for fd, inode in _sockets().items():
        if before.get(fd) == inode or inode not in tcp:
            continue
        local, remote, state = tcp[inode]
        if state != "0A" and store_port not in (local, remote):
            out.append((fd, inode))
    return out


class Context:
    """What ``train`` gets for one generation."""

    def __init__(self, agent: Any, assignment: Mapping[str, Any], backend: str, stop: _Stop):
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
            elastic = not isinstance(self._agent, _NoAgent)
            self._ending = "regroup" if elastic and not self._stop.requested else "stop"
            self._agreed = step
            return True
        return False

    def checkpointer(self, url: str | os.PathLike, **config: Any) -> _api.Checkpointer:
        """A ``ckpt.torch.Checkpointer`` for this rank, fenced by the generation (its
        run id and checkpoint generation), whose commits are reported to the control
        plane (which is how waiting ranks are let in at a checkpoint)."""
        if self._run_id is not None:
            config.setdefault("run_id", self._run_id)
        if self._copies is not None:
            # The staged file stays this rank's in-memory copy (nothing is copied).
            config.setdefault("keep_copy", True)
        config["generation"] = max(int(config.get("generation", 0)), self._floor)
        self._agent.set_checkpoint_generation(config["generation"])
        return _Checkpointer(self, url, rank=self.rank, world_size=self.world_size, **config)

    def resume(
        self,
        url: str | os.PathLike,
        state_dict: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    ) -> _api.ExtraState | None:
        """Loads the newest committed checkpoint under ``url`` (every rank the same
        one) into ``state_dict`` in place, resharded for this generation, and returns
        its ``ExtraState`` (``step``, every saved rank's non-tensor state …); None when
        nothing is committed yet. ``state_dict`` may be a function that returns it,
        called only when there is something to load (``get_state_dict`` gives a fresh
        optimizer state, which a run from scratch must not have). The load counts as
        a wait on the other ranks, not as a hang."""
        started = time.monotonic()
        try:
            step = self._collective(lambda: _newest_step(os.fspath(url)))
            if step is None:
                return None
            if callable(state_dict):
                state_dict = state_dict()
            # Reading is not being hung: it counts as a wait, as a collective does.
            self._agent.collective_started()
            copies = (self._copies, self._table) if self._copies is not None else None
            try:
                extra = _api.load(url, state_dict, step=step, rank=self.rank, copies=copies)
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
            raise _PeerFailure(str(e)) from e
        finally:
            self._agent.collective_done()


def _newest_step(url: str) -> int | None:
    """The newest committed step under ``url`` as rank 0 sees it, or None: every rank
    resumes from the same one."""
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        newest = _native.latest(url)
        choice[0] = newest["step"] if newest else None
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


class _PeerFailure(Exception):
    """A collective failed before the control plane said anything: a peer is gone
    (gloo saw the closed connection first). The world must re-form."""


class _SaveHandle(_api.SaveHandle):
    def __init__(self, ctx: Context, handle: _api.SaveHandle):
        self.__dict__.update(handle.__dict__)
        self._ctx = ctx

    def wait_committed(self) -> None:
        self._ctx._agent.collective_started()
        try:
            super().wait_committed()
        finally:
            self._ctx._agent.collective_done()
        if self._ctx._copies is not None:
            self._ctx._copies.confirm(self._native)
        self._ctx._committed_step(self.step)
        if self._ctx._ending == "regroup" and self.step == self._ctx._agreed:
            # The generation ends at the agreed commit; the next one loads it.
            raise WorldChanged(self._ctx.generation, "regroup at a committed checkpoint")


class _Checkpointer(_api.Checkpointer):
    def __init__(self, ctx: Context, url: str | os.PathLike, **kwargs: Any):
        super().__init__(url, **kwargs)
        self._ctx = ctx
        self._native_keeps_copies = bool(kwargs.get("keep_copy"))

    def save(self, step: int, state_dict: Mapping[str, Any], **kwargs: Any) -> _api.SaveHandle:
        handle = super().save(step, state_dict, **kwargs)
        ctx = self._ctx
        if ctx._copies is not None and self._native_keeps_copies:
            ctx._copies.keep(handle._native, ctx._table, ctx.rank)
        return _SaveHandle(ctx, handle)


def _say(line: str) -> None:
    print(line, flush=True)


def _device_kwargs(backend: str) -> dict[str, Any]:
    """On NCCL, this rank's GPU (``LOCAL_RANK``) is the current device and the group's."""
    if backend != "nccl":
        return {}
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return {"device_id": torch.device("cuda", local)}


def _forget_meshes() -> None:
    """Empties torch's DTensor caches, which are keyed by specs that hold device
    meshes; meshes compare equal whatever rank built them, so after a re-formation a
    cached result could hand a DTensor the mesh of an earlier generation, with this
    process's rank there (torch 2.15). Best effort: private names, checked."""
    try:
        from torch.distributed.tensor import DTensor, _redistribute

        propagator = DTensor._op_dispatcher.sharding_propagator
        for cached in (
            getattr(propagator.propagate_op_sharding, "cache", None),
            getattr(propagator, "_propagate_tensor_meta_cached", None),
            getattr(_redistribute, "_gen_transform_infos", None),
        ):
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()
    except (ImportError, AttributeError):
        pass


def _reset_group_names() -> None:
    """Names the next default group as a fresh process would. torch names groups by
    a process-wide counter (``str(group_count)``, also the store prefix of its
    keys) that only a successful ``destroy_process_group`` resets: after a
    formation that failed inside ``init_process_group`` (aborted), this rank would
    name the next group "1" while its peers name it "0", and each would wait for
    the others' keys under its own prefix until the timeout. Best effort: a private
    name, checked."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def _form_group(
    agent: Any, a: Mapping[str, Any], backend: str, timeout: timedelta
) -> list[tuple[int, int]]:
    """A process group for generation ``a``: rank 0 serves a fresh TCPStore on a
    free port and publishes it in the generation's key-value space. Returns the
    sockets the group opened (the abort shuts them down). An abort of the
    generation while it forms makes it raise (``_Forming``)."""
    forming = _Forming(agent, a["generation"])
    try:
        return _form_group_watched(agent, a, backend, timeout, forming)
    finally:
        forming.done.set()


def _form_group_watched(
    agent: Any, a: Mapping[str, Any], backend: str, timeout: timedelta, forming: _Forming
) -> list[tuple[int, int]]:
    rank, world, generation = a["rank"], a["world_size"], a["generation"]
    host = agent.member()["host"]
    _forget_meshes()
    before = _sockets()
    if rank == 0:
        store = dist.TCPStore(
            host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        forming.port = store.port
        agent.kv_set("torch/store", f"{host}:{store.port}")
    else:
        where = agent.kv_get("torch/store", timeout.total_seconds())
        store_host, port = where.rsplit(":", 1)
        forming.port = int(port)
        store = dist.TCPStore(store_host, int(port), world, is_master=False, timeout=timeout)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR=host if rank == 0 else where.rsplit(":", 1)[0],
        MASTER_PORT=str(store.port),
    )
    kwargs = _device_kwargs(backend)
    _reset_group_names()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"ckpt-g{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **kwargs,
    )
    # The first collective connects every pair (gloo connects lazily on some paths).
    probe = torch.zeros(1, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(probe)
    return _group_sockets(before, store.port)


def _teardown(agent: Any, generation: int, aborted: bool, backend: str) -> None:
    """Destroys the generation's process group; the sockets' guard goes first, so the
    abort never touches descriptors the destruction frees."""
    agent.guard_sockets(generation, [])
    if not dist.is_initialized():
        return
    if aborted and backend == "nccl":
        dist.distributed_c10d._abort_process_group()
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a broken group is being thrown away)
        pass


#: How long the training thread may stay blocked after its generation was aborted
#: before the process gives up on it and exits (the others go on without it).
STUCK_AFTER_ABORT = 15.0

#: The same for a member told it is stale or that the job is shut down: it leaves
#: whatever the training thread does next, so it waits only for that thread to say
#: so itself (a collective that no abort reached would otherwise keep it for
#: ``STUCK_AFTER_ABORT``, past the launcher's patience once the job ends).
LEAVING_AFTER_ABORT = 2.0

#: How long a survivor's training thread may stay inside ``torch.distributed`` after
#: the abort before the process counts as wedged (``EXIT_WEDGED``): an aborted
#: collective fails within milliseconds; this must leave a fresh process the time
#: to start and ask for the next generation within the join timeout (10 s).
WEDGED_AFTER_ABORT = 2.0


def _in_torch_distributed(thread: int) -> bool:
    """Whether thread ``thread`` is inside ``torch.distributed`` (a collective, or
    FSDP around one) now."""
    frame = sys._current_frames().get(thread)
    marker = f"{os.sep}torch{os.sep}distributed{os.sep}"
    while frame is not None:
        if marker in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _watch(
    agent: Any,
    member: str,
    generation: int,
    backend: str,
    done: threading.Event,
    seen: dict[str, float],
    trainer: int,
) -> None:
    """The watcher of one generation, whose training thread is ``trainer``. Once the
    agent aborted it (gloo: the agent shut the group's connections down itself), it
    aborts the communicators on NCCL; then, if the training thread is still blocked
    after ``STUCK_AFTER_ABORT`` (a collective that no abort reached), it ends the
    process: a member that cannot leave its generation would hold up the next one
    until the join timeout drops it. Two cases end sooner: a member that is stale
    or shut down leaves anyway (``_left``), so it waits ``LEAVING_AFTER_ABORT``; a
    survivor still inside ``torch.distributed`` after ``WEDGED_AFTER_ABORT`` is
    wedged and exits with ``EXIT_WEDGED``, for the launcher to start a fresh
    process that joins the next generation in its place."""
    while not done.is_set():
        if agent.wait_abort(generation, 0.2):
            seen.setdefault("abort", time.time())
            break
    else:
        return
    if backend == "nccl" and not done.is_set():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 (the group may be gone already)
            pass
    aborted = time.monotonic()
    leave_at = None
    while not done.wait(0.1):
        now = time.monotonic()
        if leave_at is None and (agent.directive() or {}).get("kind") in ("stale", "shutdown"):
            leave_at = now + LEAVING_AFTER_ABORT
        if leave_at is not None:
            if now >= leave_at:
                _left(agent, member)
                _err(f"generation {generation}: the training thread is still blocked; leaving now")
                os._exit(1)
        elif now >= aborted + WEDGED_AFTER_ABORT and _in_torch_distributed(trainer):
            _err(
                f"generation {generation}: the training thread is still inside a collective "
                f"{now - aborted:.1f} s after the abort (the process group did not fail it); "
                f"exiting with {EXIT_WEDGED} for a fresh process to join the next generation"
            )
            os._exit(EXIT_WEDGED)
        if now >= aborted + STUCK_AFTER_ABORT:
            break
    if not done.is_set():
        _err(
            f"generation {generation}: the training thread is still blocked "
            f"{STUCK_AFTER_ABORT:.0f} s after the abort; exiting so the others can go on"
        )
        os._exit(1)


def run(
    train: Callable[[Context], Any],
    *,
    backend: str | None = None,
    timeout: float = 600.0,
    memory_copies: bool = True,
    finished: Callable[[], bool] | None = None,
) -> None:
    """Runs ``train(ctx)`` through as many generations as the job takes, then exits
    the process: 0 when ``train`` returned (the job trained to its end), 75 after a
    stop's committed save, 1 when the job shut down or dropped this member, or after
    a ``train`` error that is not the world changing (raised again first, so its
    traceback is printed).

    ``backend``: ``"nccl"`` or ``"gloo"`` (default: nccl when CUDA is available).
    ``timeout``: the process group's timeout in seconds (a backstop: failures are
    detected by the control plane long before it). ``memory_copies``: every save
    stays in this rank's memory, with a replica of its ring predecessor's, and a
    recovery loads from them before the store (about four times a rank's share of a
    checkpoint in RAM). ``finished``: asked when this member cannot take part (the
    control plane cannot be reached, or sends it away) before it trained: true when
    the job already trained to its end, so that the process exits 0 rather than 1. A
    node started again after the job finished can meet a coordinator that went with
    the job (a launcher hosts it); only the script knows its last step, so the
    example passes a look at the newest commit
    (``ckpt.torch.latest(url)["step"] >= steps``).

    Outside an elastic launcher (no ``CKPT_RDZV``: torchrun, ``ckpt launch`` without
    elastic flags, or plain ``python``) there is one generation, the fixed world of
    ``RANK``/``WORLD_SIZE`` (or a world of one): ``train`` runs once, with the same
    context; a stop still saves the agreed step, but a lost rank ends the job."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        raise RuntimeError(
            "ckpt.elastic.run forms the process groups itself: call it before init_process_group"
        )
    stop = _Stop()
    stop.install()
    try:
        agent = _native.Agent.from_env()
    except _native.ElasticError as e:
        if not _over_without_us(finished, e):
            raise
        code = 0
    else:
        if agent is None:
            code = _fixed(train, backend, timedelta(seconds=timeout), stop)
        else:
            copies = _native.Copies(agent.member()["host"]) if memory_copies else None
            code = _generations(
                agent, train, backend, timedelta(seconds=timeout), stop, copies, finished
            )
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.15's gloo can abort the interpreter while it finalizes a group's
    # worker threads; the job's outcome is decided, so skip finalization.
    os._exit(code)


class _NoAgent:
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


def _fixed(train: Callable[[Context], Any], backend: str, timeout: timedelta, stop: _Stop) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init = "env://"
    else:
        rank, world = 0, 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    kwargs = _device_kwargs(backend)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and init == "env://":
        # Under torchrun: a store of this attempt's own. torchrun restarts every
        # worker on the same store, and without a prefix per attempt the restarted
        # workers read the addresses the previous attempt's gloo published and are
        # refused (torch 2.15).
        kwargs["store"] = dist.PrefixStore(
            f"ckpt/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                world,
                is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True),
                timeout=timeout,
            ),
        )
    else:
        kwargs["init_method"] = init
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    assignment = {
        "rank": rank,
        "world_size": world,
        "generation": 0,
        "cause": "a fixed world",
        "run_id": None,
        "checkpoint_generation_floor": 0,
    }
    ctx = Context(_NoAgent(), assignment, backend, stop)
    train(ctx)
    dist.destroy_process_group()
    if ctx.stopping:
        _err(f"rank {rank}: stopped at step {ctx._committed} after a committed checkpoint")
        return EXIT_STOPPED
    return 0


def _transient(error: BaseException) -> bool:
    """A checkpoint error that trying again may cure (a store that reset a connection,
    timed out): the world re-forms and resumes from the newest commit, as the
    reference trainer does, rather than dropping this member."""
    return isinstance(error, _native.CkptError) and bool(getattr(error, "transient", False))


def _looks_like_a_peer(error: BaseException) -> bool:
    """Whether a collective's error says a peer is gone (closed or reset connection,
    a communicator error) rather than a bug in the script."""
    if isinstance(error, (_PeerFailure, dist.DistError)):
        return True
    text = str(error)
    return any(
        mark in text
        for mark in ("gloo", "Connection closed", "Connection reset", "NCCL", "Broken pipe")
    )


def _generations(
    agent: Any,
    train: Callable[[Context], Any],
    backend: str,
    timeout: timedelta,
    stop: _Stop,
    copies: Any,
    finished: Callable[[], bool] | None = None,
) -> int:
    member = agent.member()["id"]
    previous: dict[str, float] | None = None
    trained = False  # whether this member ever joined a generation
    while True:
        started = time.monotonic()
        try:
            a = agent.rendezvous()
        except _native.ElasticError as e:
            if e.kind == "shutdown" and "the job finished" in str(e):
                _say(f"done: the job finished without this member ({e}; member {member})")
                return 0
            if not trained and _over_without_us(finished, e):
                return 0
            _err(f"member {member}: rendezvous: {e}")
            return 1
        trained = True
        generation, rank = a["generation"], a["rank"]
        rendezvous_s = time.monotonic() - started
        if rank == 0:
            _say(
                f"generation {generation}: world {a['world_size']} ({a['cause']}), "
                f"rendezvous {rendezvous_s * 1e3:.0f} ms"
            )
        ctx = Context(agent, a, backend, stop)
        formed = time.monotonic()
        try:
            sockets = _form_group(agent, a, backend, timeout)
            if backend == "gloo":
                agent.guard_sockets(generation, sockets)
            if copies is not None:
                # Who holds which copies, and where their servers are.
                ctx._copies, ctx._table = copies, _holdings(ctx, copies)
        except Exception as e:  # noqa: BLE001 (any failure to form ends the generation)
            _teardown(agent, generation, True, backend)
            if not agent.is_cancelled():
                agent.report("collective_failed", reason=f"forming the generation: {_brief(e)}")
            if _left(agent, member):
                return 1
            previous = {"noticed": time.time(), "aborted": time.time()}
            continue
        group_s = time.monotonic() - formed
        ctx._timing["start"] = formed
        done = threading.Event()
        seen: dict[str, float] = {}
        threading.Thread(
            target=_watch,
            args=(agent, member, generation, backend, done, seen, threading.get_ident()),
            daemon=True,
        ).start()
        if previous is not None and rank == 0:
            threading.Thread(
                target=_recovery_line, args=(ctx, previous, rendezvous_s, group_s), daemon=True
            ).start()
        previous = None
        error: BaseException | None = None
        try:
            train(ctx)
            outcome = "stopped" if ctx.stopping else "finished"
        except WorldChanged as e:
            regroup = ctx._ending == "regroup" and not agent.is_cancelled()
            outcome, error = ("regroup" if regroup else "failed"), e
        except Exception as e:  # noqa: BLE001 (sorted out below)
            error = e
            if agent.is_cancelled() or _looks_like_a_peer(e) or _transient(e):
                outcome = "failed"
            # A plain error may still be the echo of a failure the control plane is
            # about to announce: give it a moment before blaming the script.
            elif agent.wait_abort(generation, 1.0):
                outcome = "failed"
            else:
                outcome = "error"
        out = time.time()
        done.set()
        # The failure reached this rank when the control plane's abort did, or when
        # its own collective failed, whichever came first.
        noticed = min(seen.get("abort", out), out)
        if outcome == "finished":
            step = ctx._committed or 0
            agent.report("finished", step=step)
            agent.report("leaving", reason=f"finished at step {step}")
            _teardown(agent, generation, False, backend)
            _say(f"done: member {member} finished at step {step}")
            return 0
        if outcome == "stopped":
            step = ctx._committed
            agent.report("leaving", reason=f"stopped by a signal after committing step {step}")
            _teardown(agent, generation, False, backend)
            _err(f"member {member}: stopped at step {step} after a committed checkpoint")
            return EXIT_STOPPED
        if outcome == "regroup":
            agent.report("ended", step=ctx._committed or 0)
            _teardown(agent, generation, False, backend)
            continue
        if _left(agent, member):
            _teardown(agent, generation, True, backend)
            return 1
        if outcome == "error":
            # Not a peer's failure: this member cannot go on. Reported before the
            # abort, so that the peers' failures are not blamed instead.
            agent.report("fatal", reason=f"{type(error).__name__}: {error}")
            _teardown(agent, generation, True, backend)
            raise error  # type: ignore[misc]
        if not agent.is_cancelled():
            # This rank saw the failure first (a peer's connection closed).
            agent.report("collective_failed", reason=_brief(error))
        _teardown(agent, generation, True, backend)
        if stop.requested:
            agent.report(
                "leaving",
                reason=f"stopped by a signal; the final save did not complete: {_brief(error)}",
            )
            return 1
        if rank == 0:
            _err(f"generation {generation} failed ({_brief(error)}); rejoining")
        previous = {"noticed": noticed, "aborted": out}


def _brief(error: BaseException | None) -> str:
    """An error in one line: gloo's messages start with a source location and end
    with advice meant for a person reading a crash."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]


def _over_without_us(finished: Callable[[], bool] | None, error: BaseException) -> bool:
    """Whether the script's ``finished`` says the job trained to its end without
    this member, which the control plane could not tell (``error``); says so."""
    if finished is None:
        return False
    try:
        over = bool(finished())
    except Exception as e:  # noqa: BLE001 (a failed look is not an answer)
        _err(f"the job's end could not be checked ({type(e).__name__}: {e}); failing on {error}")
        return False
    if over:
        _say(f"done: the job already finished (by the script's check); the control plane: {error}")
    return over


def _left(agent: Any, member: str) -> bool:
    """Whether the control plane dropped this member (stale) or shut the job down;
    says so."""
    directive = agent.directive() or {}
    if directive.get("kind") == "stale":
        _err(
            f"member {member}: stale: this member's generation is over (the job is at "
            f"generation {directive.get('current')}); leaving without writing anything more"
        )
        return True
    if directive.get("kind") == "shutdown":
        _err(f"member {member}: shutdown: {directive.get('reason')}")
        return True
    return False


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _holdings(ctx: Context, copies: Any) -> list[bytes]:
    """Every rank's holding of in-memory copies, by rank (a collective)."""
    table: list[Any] = [None] * ctx.world_size
    ctx._collective(lambda: dist.all_gather_object(table, copies.holding()))
    return table


def _sources(stats: Mapping[str, Any]) -> str:
    """Where a load's bytes came from, for the recovery line."""
    if "own_bytes" not in stats:
        return ""
    store = f", {stats['bytes_read'] / 1e6:.1f} MB from the store" if stats["bytes_read"] else ""
    return (
        f" (rank 0's rows from memory: {stats['own_bytes'] / 1e6:.1f} MB own, "
        f"{stats['peer_bytes'] / 1e6:.1f} MB from peers{store})"
    )


def _recovery_line(
    ctx: Context, previous: dict[str, float], rendezvous_s: float, group_s: float
) -> None:
    """Rank 0's one line per recovery, once the first step of the new generation is
    done: where the time went."""
    while not ctx._stepped.wait(0.1):
        if ctx._agent.is_cancelled():
            return
    now = ctx._timing["first_step_unix"]
    load = ctx._timing.get("load", 0.0)
    first = ctx._timing["first_step"] - ctx._timing["start"] - group_s - load
    _say(
        f"recovery: generation {ctx.generation} world {ctx.world_size} ({ctx.cause}): "
        f"noticed at {previous['noticed'] * 1e3:.0f} ms, "
        f"aborted +{(previous['aborted'] - previous['noticed']) * 1e3:.0f} ms, "
        f"rendezvous {rendezvous_s * 1e3:.0f} ms, process group {group_s * 1e3:.0f} ms, "
        f"load {load * 1e3:.0f} ms{_sources(ctx._loaded)}, "
        f"first step {max(first, 0) * 1e3:.0f} ms; "
        f"back to training {(now - previous['noticed']) * 1e3:.0f} ms after the failure was noticed"
    )
