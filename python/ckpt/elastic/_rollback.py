"""Rollback on a bad step: the newest healthy commit, how many times in a row the job
went back to it, and the checks a script asks for.

A rank that sees a non-finite loss (or a spike its script defines) asks, through
``Context.rollback_if``, that every rank go back to the newest healthy commit; this
module holds what that decision needs and nothing of torch: the count that turns a
loop into :class:`RollbackLoop`, the run id a rolled-back generation saves under,
and :func:`bad_loss`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

#: Rollbacks in a row to one commit that ``run`` allows before it raises
#: :class:`RollbackLoop`.
MAX_ROLLBACKS = 3

#: Longest run id the library takes (``ckpt::RunId::MAX_LEN``).
_MAX_RUN_ID = 48


class RollbackLoop(Exception):
    """The job went back to the same commit more than ``max_rollbacks`` times in a
    row, and the step after it went bad again: training from that commit cannot get
    past it, so the job stops (every rank raises it, the process exits non-zero)
    instead of looping. ``step`` is the step that asked, ``target`` the commit it
    went back to, ``times`` the rollbacks to it in a row (this one included)."""

    def __init__(self, step: int, target: int, times: int, limit: int, reasons: str):
        super().__init__(
            f"step {step} asked for a rollback to step {target} for the {_nth(times)} time "
            f"in a row (max_rollbacks={limit}): {reasons}; training from step {target} does "
            "not get past it, stopping the job"
        )
        self.step, self.target, self.times, self.limit, self.reasons = (
            step,
            target,
            times,
            limit,
            reasons,
        )

    def __reduce__(self):
        return (type(self), (self.step, self.target, self.times, self.limit, self.reasons))


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Rollbacks:
    """Rollbacks in a row to one commit, across the generations of one process
    (every rank counts the same: each rollback is agreed by all of them).

    A rollback to the commit of the previous one, with no commit since of a step past
    the step that asked last, is one more in a row; anything else starts the count
    again. More than ``limit`` in a row is a :class:`RollbackLoop`."""

    def __init__(self, limit: int = MAX_ROLLBACKS):
        if limit < 0:
            raise ValueError(f"max_rollbacks must be 0 or more, not {limit}")
        self.limit = limit
        self.target: int | None = None
        self.asked: int | None = None
        self.in_a_row = 0
        # The control plane's snapshot record when the last rollback happened: the
        # state it holds is what the job went back from, so no resume takes it.
        self.stale_snapshot: str | None = None

    def committed(self, step: int) -> None:
        """A commit of ``step``: past the step that asked, the job got over it."""
        if self.asked is not None and step >= self.asked:
            self.target, self.asked, self.in_a_row = None, None, 0

    def count(self, asked: int, target: int, reasons: str) -> int:
        """One more rollback from step ``asked`` to commit ``target``: the rollbacks
        to it in a row, or :class:`RollbackLoop` past the limit."""
        self.in_a_row = self.in_a_row + 1 if target == self.target else 1
        self.target, self.asked = target, asked
        if self.in_a_row > self.limit:
            raise RollbackLoop(asked, target, self.in_a_row, self.limit, reasons)
        return self.in_a_row


def rolled_run_id(base: str, n: int) -> str:
    """The run id of the saves after the ``n``-th rollback of a world that saved
    under ``base``: a rolled-back world saves steps it saved before, and every save
    attempt needs a directory of its own (one per step, generation and run id)."""
    suffix = f"-r{n}"
    if len(base) + len(suffix) <= _MAX_RUN_ID:
        return base + suffix
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{base[: _MAX_RUN_ID - len(suffix) - 9]}-{digest}{suffix}"


def bad_loss(
    loss: Any,
    spike: float | Callable[[float], bool | str | None] | None = None,
    previous: float | None = None,
) -> tuple[bool, str]:
    """Whether ``loss`` (a number or a one-element tensor) is bad, and why: not
    finite, or a spike. ``spike`` is a callable taking the loss (True or a reason
    when it is a spike), or a factor: a loss above ``spike`` times ``previous`` (the
    last good loss; none at first) is a spike. Returns ``(False, "")`` for a good
    loss."""
    value = float(loss.detach().item() if hasattr(loss, "detach") else loss)
    if not math.isfinite(value):
        return True, f"loss is {value}"
    if spike is None:
        return False, ""
    if callable(spike):
        verdict = spike(value)
        if verdict is None or verdict is False:
            return False, ""
        return True, verdict if isinstance(verdict, str) else f"loss {value:.6g} is a spike"
    if previous is not None and value > spike * previous:
        return True, f"loss {value:.6g} is more than {spike:g} times the last one ({previous:.6g})"
    return False, ""
