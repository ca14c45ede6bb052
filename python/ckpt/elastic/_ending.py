"""How a member reads the end of its generation, and how it says so.

An error out of ``train`` is a peer's loss, a transient store error, or a bug in the
script; the control plane may have sent this member away; the script may know the
job is over without it. Each decides whether the member re-forms, leaves or exits
with an error, and with which exit code (``ckpt launch`` reads them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from ckpt import _native

#: A rank that stopped on SIGTERM/SIGINT after the agreed final save (EX_TEMPFAIL).
EXIT_STOPPED = 75

#: A survivor whose training thread stayed blocked in a collective after the abort
#: (gloo can leave one waiting on pairs it already closed, until the group's
#: timeout): the process cannot leave its generation, a fresh one can join the next.
#: ``ckpt launch`` starts it again at once, without counting a restart.
EXIT_WEDGED = 76


class PeerFailure(Exception):
    """A collective failed before the control plane said anything: a peer is gone
    (gloo saw the closed connection first). The world must re-form."""


def say(line: str) -> None:
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def brief(error: BaseException | None) -> str:
    """An error in one line: gloo's messages start with a source location and end
    with advice meant for a person reading a crash."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]


def transient(error: BaseException) -> bool:
    """A checkpoint error that trying again may cure (a store that reset a connection,
    timed out): the world re-forms and resumes from the newest commit, as the
    reference trainer does, rather than dropping this member."""
    return isinstance(error, _native.CkptError) and bool(getattr(error, "transient", False))


def looks_like_a_peer(error: BaseException) -> bool:
    """Whether a collective's error says a peer is gone (closed or reset connection,
    a communicator error) rather than a bug in the script."""
    import torch.distributed as dist

    from ckpt.torch._cooperative import PeerLostError

    if isinstance(error, (PeerFailure, PeerLostError, dist.DistError)):
        return True
    text = str(error)
    return any(
        mark in text
        for mark in ("gloo", "Connection closed", "Connection reset", "NCCL", "Broken pipe")
    )


def over_without_us(finished: Callable[[], bool] | None, error: BaseException) -> bool:
    """Whether the script's ``finished`` says the job trained to its end without
    this member, which the control plane could not tell (``error``); says so."""
    if finished is None:
        return False
    try:
        over = bool(finished())
    except Exception as e:  # noqa: BLE001 (a failed look is not an answer)
        err(f"the job's end could not be checked ({type(e).__name__}: {e}); failing on {error}")
        return False
    if over:
        say(f"done: the job already finished (by the script's check); the control plane: {error}")
    return over


def left(agent: Any, member: str) -> bool:
    """Whether the control plane dropped this member (stale) or shut the job down;
    says so."""
    directive = agent.directive() or {}
    if directive.get("kind") == "stale":
        err(
            f"member {member}: stale: this member's generation is over (the job is at "
            f"generation {directive.get('current')}); leaving without writing anything more"
        )
        return True
    if directive.get("kind") == "shutdown":
        err(f"member {member}: shutdown: {directive.get('reason')}")
        return True
    return False


def cooperative_sources(stats: Mapping[str, Any]) -> str:
    """Where a cooperative load's bytes came from, as rank 0 saw them."""
    requests = stats.get("store_requests", {})
    counts = " ".join(f"{kind} {requests.get(kind, 0)}" for kind in ("LIST", "GET", "HEAD"))
    return (
        f"cooperative: the job read {stats['unique_bytes'] / 1e6:.1f} MB from the store once, "
        f"rank 0 {stats['bytes_read_from_store'] / 1e6:.1f} MB of it and "
        f"{stats['bytes_received_from_peers'] / 1e6:.1f} MB from peers; rank 0's requests "
        f"{counts}"
    )
