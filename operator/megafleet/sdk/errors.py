"""The errors of the RL-job SDK's fleet client and generation (:mod:`megafleet.sdk.fleet`).

Exception tree::

    FleetError                 any failure of the fleet client; the message says which fleet and why
    ├── FleetNotFound          no such MegatronGeneration in the namespace
    ├── FleetNotReady          the fleet did not become Ready in time, or cannot (InvalidSpec);
    │                          carries the blocking condition's reason and message
    ├── RefitFailed            a Refit ended Failed, or did not finish in time; carries its status
    ├── NoFrontend             no Ready, non-stale frontend to send a request to
    ├── GenerationFailed       every frontend tried refused or failed one request
    └── PromptTooLong          a token prompt leaves no room to generate under the model's length
                               limit (also a ValueError); nothing was sent

The trainer's transfer errors (:class:`megafleet_protocol.refit.errors.RefitError` and its subclasses)
are raised by :mod:`megafleet_protocol.refit.sender`; :class:`RefitFailed` names them when a sender failed.
Imports nothing heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megafleet.api import v1alpha1

__all__ = [
    "FleetError",
    "FleetNotFound",
    "FleetNotReady",
    "GenerationFailed",
    "NoFrontend",
    "PromptTooLong",
    "RefitFailed",
]


class FleetError(RuntimeError):
    """Base of every error of the fleet client."""


class FleetNotFound(FleetError):
    """The MegatronGeneration does not exist."""


class FleetNotReady(FleetError):
    """The fleet is not Ready: invalid, or still not Ready when the wait ran out.

    ``reason`` and ``message`` are those of the condition that blocks it (``InvalidSpec`` when
    set, else ``Ready``), empty when the operator has written none yet.
    """

    def __init__(self, fleet: str, reason: str, message: str, *, detail: str = "") -> None:
        text = f"fleet {fleet} is not Ready: {reason or 'NoCondition'}: {message or 'no status written yet'}"
        super().__init__(f"{text}; {detail}" if detail else text)
        self.fleet = fleet
        self.reason = reason
        self.message = message


class RefitFailed(FleetError):
    """A Refit did not succeed; ``status`` is its last status (``None`` if never written)."""

    def __init__(self, refit: str, message: str, status: v1alpha1.RefitObjectStatus | None = None) -> None:
        super().__init__(f"refit {refit}: {message}")
        self.refit = refit
        self.status = status


class NoFrontend(FleetError):
    """No frontend may take a request: none is Ready at the fleet's current weight version."""


class GenerationFailed(FleetError):
    """One request failed on every frontend it was tried on; ``failures`` maps URL to what happened."""

    def __init__(self, failures: dict[str, str]) -> None:
        tried = "; ".join(f"{url}: {failure}" for url, failure in failures.items())
        super().__init__(f"the request failed on {len(failures)} frontends: {tried}")
        self.failures = failures


class PromptTooLong(FleetError, ValueError):
    """A prompt of ``length`` tokens leaves no room to generate under ``limit``, the fleet's
    ``spec.model.maxSequenceLength`` (vLLM refuses such a prompt too)."""

    def __init__(self, length: int, limit: int, *, what: str = "the prompt") -> None:
        super().__init__(
            f"{what} is {length} tokens; the fleet's maximum sequence length is {limit}: no room to generate"
        )
        self.length = length
        self.limit = limit
