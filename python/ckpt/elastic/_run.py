"""``run``: the generations of an elastic job, one after the other, in this process.

Each turn is a rendezvous through the agent, a process group for the generation
(``_group``), a watcher (``_watch``), ``train(ctx)``, and the verdict on whatever
ended it (``_ending``). Outside an elastic launcher there is one turn, on the fixed
world of ``RANK``/``WORLD_SIZE``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from ckpt import _native
from ckpt.elastic._context import Context, NoAgent, Stop, WorldChanged
from ckpt.elastic._ending import (
    EXIT_STOPPED,
    brief,
    cooperative_sources,
    err,
    left,
    looks_like_a_peer,
    over_without_us,
    say,
    transient,
)
from ckpt.elastic._group import device_kwargs, form_group, teardown
from ckpt.elastic._rollback import MAX_ROLLBACKS, RollbackLoop, Rollbacks
from ckpt.elastic._watch import watch


def run(
    train: Callable[[Context], Any],
    *,
    backend: str | None = None,
    timeout: float = 600.0,
    memory_copies: bool = True,
    finished: Callable[[], bool] | None = None,
    max_rollbacks: int = MAX_ROLLBACKS,
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
    (``ckpt.torch.latest(url)["step"] >= steps``). ``max_rollbacks``: how many
    times in a row ``ctx.rollback_if`` may go back to the same commit; one more
    raises :class:`RollbackLoop` on every rank, and the job ends (exit 1).

    Outside an elastic launcher (no ``CKPT_RDZV``: torchrun, ``ckpt launch`` without
    elastic flags, or plain ``python``) there is one generation, the fixed world of
    ``RANK``/``WORLD_SIZE`` (or a world of one): ``train`` runs once, with the same
    context; a stop still saves the agreed step, but a lost rank ends the job."""
    import torch
    import torch.distributed as dist

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        raise RuntimeError(
            "ckpt.elastic.run forms the process groups itself: call it before init_process_group"
        )
    rollbacks = Rollbacks(max_rollbacks)
    stop = Stop()
    stop.install()
    try:
        agent = _native.Agent.from_env()
    except _native.ElasticError as e:
        if not over_without_us(finished, e):
            raise
        code = 0
    else:
        if agent is None:
            code = _fixed(train, backend, timedelta(seconds=timeout), stop, rollbacks)
        else:
            copies = _native.Copies(agent.member()["host"]) if memory_copies else None
            code = _generations(
                agent,
                train,
                backend,
                timedelta(seconds=timeout),
                stop,
                copies,
                finished,
                rollbacks,
            )
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.15's gloo can abort the interpreter while it finalizes a group's
    # worker threads; the job's outcome is decided, so skip finalization.
    os._exit(code)


def _fixed(
    train: Callable[[Context], Any],
    backend: str,
    timeout: timedelta,
    stop: Stop,
    rollbacks: Rollbacks,
) -> int:
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init = "env://"
    else:
        rank, world = 0, 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    kwargs = device_kwargs(backend)
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
    ctx = Context(NoAgent(), assignment, backend, stop, rollbacks)
    try:
        train(ctx)
    except RollbackLoop as e:
        err(f"rank {rank}: RollbackLoop: {e}")
        return 1
    dist.destroy_process_group()
    if ctx.stopping:
        err(f"rank {rank}: stopped at step {ctx._committed} after a committed checkpoint")
        return EXIT_STOPPED
    return 0


def _generations(
    agent: Any,
    train: Callable[[Context], Any],
    backend: str,
    timeout: timedelta,
    stop: Stop,
    copies: Any,
    finished: Callable[[], bool] | None = None,
    rollbacks: Rollbacks | None = None,
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
                say(f"done: the job finished without this member ({e}; member {member})")
                return 0
            if not trained and over_without_us(finished, e):
                return 0
            err(f"member {member}: rendezvous: {e}")
            return 1
        trained = True
        generation, rank = a["generation"], a["rank"]
        rendezvous_s = time.monotonic() - started
        if rank == 0:
            say(
                f"generation {generation}: world {a['world_size']} ({a['cause']}), "
                f"rendezvous {rendezvous_s * 1e3:.0f} ms"
            )
        ctx = Context(agent, a, backend, stop, rollbacks)
        formed = time.monotonic()
        try:
            sockets = form_group(agent, a, backend, timeout)
            if backend == "gloo":
                agent.guard_sockets(generation, sockets)
            if copies is not None:
                # Who holds which copies, and where their servers are.
                ctx._copies, ctx._table = copies, _holdings(ctx, copies)
        except Exception as e:  # noqa: BLE001 (any failure to form ends the generation)
            teardown(agent, generation, True, backend)
            if not agent.is_cancelled():
                agent.report("collective_failed", reason=f"forming the generation: {brief(e)}")
            if left(agent, member):
                return 1
            previous = {"noticed": time.time(), "aborted": time.time()}
            continue
        group_s = time.monotonic() - formed
        ctx._timing["start"] = formed
        done = threading.Event()
        seen: dict[str, float] = {}
        threading.Thread(
            target=watch,
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
            if isinstance(e, RollbackLoop):
                # Every rank raises it: the job cannot get past the step.
                outcome = "error"
            elif agent.is_cancelled() or looks_like_a_peer(e) or transient(e):
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
            teardown(agent, generation, False, backend)
            say(f"done: member {member} finished at step {step}")
            return 0
        if outcome == "stopped":
            step = ctx._committed
            agent.report("leaving", reason=f"stopped by a signal after committing step {step}")
            teardown(agent, generation, False, backend)
            err(f"member {member}: stopped at step {step} after a committed checkpoint")
            return EXIT_STOPPED
        if outcome == "regroup":
            agent.report("ended", step=ctx._committed or 0)
            teardown(agent, generation, False, backend)
            continue
        if left(agent, member):
            teardown(agent, generation, True, backend)
            return 1
        if outcome == "error":
            # Not a peer's failure: this member cannot go on. Reported before the
            # abort, so that the peers' failures are not blamed instead.
            agent.report("fatal", reason=f"{type(error).__name__}: {error}")
            teardown(agent, generation, True, backend)
            if isinstance(error, RollbackLoop):
                # Every rank stops on it: its message says why, not a traceback.
                err(f"member {member}: RollbackLoop: {error}")
                return 1
            raise error  # type: ignore[misc]
        if not agent.is_cancelled():
            # This rank saw the failure first (a peer's connection closed).
            agent.report("collective_failed", reason=brief(error))
        teardown(agent, generation, True, backend)
        if stop.requested:
            agent.report(
                "leaving",
                reason=f"stopped by a signal; the final save did not complete: {brief(error)}",
            )
            return 1
        if rank == 0:
            err(f"generation {generation} failed ({brief(error)}); rejoining")
        previous = {"noticed": noticed, "aborted": out}


def _holdings(ctx: Context, copies: Any) -> list[bytes]:
    """Every rank's holding of in-memory copies, by rank (a collective)."""
    import torch.distributed as dist

    table: list[Any] = [None] * ctx.world_size
    ctx._collective(lambda: dist.all_gather_object(table, copies.holding()))
    return table


def _sources(stats: Mapping[str, Any]) -> str:
    """Where a load's bytes came from, for the recovery line."""
    if stats.get("bytes_received_from_peers"):
        return f" ({cooperative_sources(stats)})"
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
    say(
        f"recovery: generation {ctx.generation} world {ctx.world_size} ({ctx.cause}): "
        f"noticed at {previous['noticed'] * 1e3:.0f} ms, "
        f"aborted +{(previous['aborted'] - previous['noticed']) * 1e3:.0f} ms, "
        f"rendezvous {rendezvous_s * 1e3:.0f} ms, process group {group_s * 1e3:.0f} ms, "
        f"load {load * 1e3:.0f} ms{_sources(ctx._loaded)}, "
        f"first step {max(first, 0) * 1e3:.0f} ms; "
        f"back to training {(now - previous['noticed']) * 1e3:.0f} ms after the failure was "
        f"noticed; host memory {ctx.host_bytes_held()['summary']}"
    )
