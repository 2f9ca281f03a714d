"""A refit attempt's deadline, and how a failed torch step is reported against it.

Every blocking call of a refit is bounded by the attempt's :class:`Deadline`: the trainer's
:mod:`~megafleet_protocol.refit.sender`, an engine rank's :mod:`~megafleet_protocol.refit.receiver`
(through :mod:`megafleet_engine.refit_attempts`), the :mod:`~megafleet_protocol.refit.communicator`
they share and the NeMo collective's receiver (:mod:`~megafleet_protocol.refit.nemo`) all take one.
:func:`translate` turns the ``RuntimeError`` a torch store or collective raises into the
:class:`~megafleet_protocol.refit.errors.RefitError` that says which step failed and why, a timeout
when the deadline was (about to be) spent. Imports no torch.
"""

from __future__ import annotations

import datetime
import time

from megafleet_protocol.refit import errors

__all__ = ["DEADLINE_SLACK_SECONDS", "Deadline", "translate"]

DEADLINE_SLACK_SECONDS = 0.25
"""A torch wait that fails this close to the deadline ran out of time (its own timer may end a moment
early), and is reported as the deadline passing."""


class Deadline:
    """The instant a refit attempt must be over by (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    @property
    def remaining(self) -> float:
        """Seconds left; zero or negative once passed."""
        return self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.remaining <= 0

    def left(self, what: str) -> datetime.timedelta:
        """The time left as a timeout for the step ``what``; :class:`RefitTimeout` if none is left."""
        remaining = self.remaining
        if remaining <= 0:
            raise errors.RefitTimeout(f"the refit's {self.seconds:g} s deadline passed before {what}")
        return datetime.timedelta(seconds=remaining)


def translate(error: RuntimeError, deadline: Deadline, what: str, *, aborted: bool = False) -> errors.RefitError:
    """A torch error of a refit step as a :class:`RefitError` that says which step failed and why."""
    if aborted:
        return errors.RefitAborted(f"the refit was aborted during {what}")
    if deadline.remaining <= DEADLINE_SLACK_SECONDS:
        return errors.RefitTimeout(f"the refit's {deadline.seconds:g} s deadline passed during {what}")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return errors.RefitError(f"{what} failed: {first_line}")
