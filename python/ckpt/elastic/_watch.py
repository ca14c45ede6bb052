"""The watcher of one generation: once the control plane aborted it, it ends a
member whose training thread cannot leave, so that the others need not wait for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from ckpt.elastic import _torch_workarounds
from ckpt.elastic._ending import EXIT_WEDGED, err, left

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


def watch(
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
    or shut down leaves anyway (``left``), so it waits ``LEAVING_AFTER_ABORT``; a
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
            _torch_workarounds.abort_process_group()
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
                left(agent, member)
                err(f"generation {generation}: the training thread is still blocked; leaving now")
                os._exit(1)
        elif now >= aborted + WEDGED_AFTER_ABORT and _in_torch_distributed(trainer):
            err(
                f"generation {generation}: the training thread is still inside a collective "
                f"{now - aborted:.1f} s after the abort (the process group did not fail it); "
                f"exiting with {EXIT_WEDGED} for a fresh process to join the next generation"
            )
            os._exit(EXIT_WEDGED)
        if now >= aborted + STUCK_AFTER_ABORT:
            break
    if not done.is_set():
        err(
            f"generation {generation}: the training thread is still blocked "
            f"{STUCK_AFTER_ABORT:.0f} s after the abort; exiting so the others can go on"
        )
        os._exit(1)
