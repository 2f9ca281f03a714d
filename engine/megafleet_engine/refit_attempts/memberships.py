"""A membership of a trainer's world joined ahead of its refits, as the refit status shows it, and
the probe of the trainer's store that runs while it is joined.

Shared by the two sources whose trainer builds its world once per run: NeMo's collective
(:mod:`~megafleet_engine.refit_attempts.nemo_world`, through the refit controller) and megatron-core's
refit group (:mod:`~megafleet_engine.refit_attempts.megatron_group`). The probe runs on a thread of
the membership's own; the agent (:mod:`megafleet_engine.agent_server`) reports the snapshot as
``world`` in ``GET /v1/refit/status``, from which the operator closes a session whose trainer is gone.
"""

from __future__ import annotations

import dataclasses
import socket

from megafleet_protocol import vocabulary

__all__ = ["STORE_PROBE_SECONDS", "STORE_PROBE_TIMEOUT_SECONDS", "ReshardSnapshot", "WorldSnapshot", "store_listening"]

STORE_PROBE_SECONDS = 10.0
"""Seconds between probes of the trainer's store while this rank holds a joined world (the operator
closes the session once every member found the store unreachable for a minute)."""
STORE_PROBE_TIMEOUT_SECONDS = 2.0
"""How long one probe may wait for the store to accept a connection."""


@dataclasses.dataclass(frozen=True)
class ReshardSnapshot:
    """The stage communicators of NeMo's M-to-N reshard this rank joined beside a session's NeMo world
    (``world.reshard`` in the refit status)."""

    phase: str  # joining | joined | failed | left
    stages: int
    rank: int
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class WorldSnapshot:
    """The membership of a trainer's world this rank joined for a session (``world`` in the refit status)."""

    session: str
    phase: str  # joining | joined | failed | left
    rank: int
    generation: vocabulary.NemoGeneration | None = None
    error: str | None = None
    store_reachable: bool | None = None  # the last probe of the trainer's store; None: not probed yet
    reshard: ReshardSnapshot | None = None  # the stage communicators joined beside NeMo's world, if any


def store_listening(address: str, port: int, *, timeout: float) -> bool:
    """Whether the trainer's store at ``address:port`` accepts a TCP connection within ``timeout``."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False
