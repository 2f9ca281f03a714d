"""Every tuning value of the operator, in one frozen object.

Built once by :mod:`megafleet.handlers` (its Kopf decorators read it at import, its startup handler
keeps it in Kopf's ``memo``) and read by the reconcile steps and the Refit and RefitSession
controllers. A value changes by changing its default, with the reason beside it;
:meth:`OperatorSettings.from_environ` lets a deployment (or a test) override one as
``MEGAFLEET_<GROUP>_<FIELD>``, e.g. ``MEGAFLEET_SESSION_TRAINER_GONE_SECONDS``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENV_PREFIX",
    "AgentSettings",
    "ApiSettings",
    "CatchUpSettings",
    "OperatorSettings",
    "RefitSettings",
    "SessionSettings",
    "ShardSettings",
    "TriggerSettings",
    "env_name",
]


ENV_PREFIX = "MEGAFLEET_"
"""Environment names of the overrides: ``MEGAFLEET_<GROUP>_<FIELD>`` in upper case."""


@dataclasses.dataclass(frozen=True)
class TriggerSettings:
    """When the Kopf handlers run a reconcile."""

    observe_interval_seconds: float = 5.0
    """Seconds between reconciles of a fleet that is not settled, even when nothing announces a change
    (default 5): agent state (Ready, Stale, served address) changes without any Kubernetes event."""
    probe_first_seconds: float = 2.0
    """Seconds before the first agent probe of a settled fleet after any change (default 2); the delay
    doubles while nothing changes (:mod:`megafleet.reconcile.pacing`)."""
    probe_most_seconds: float = 8.0
    """The longest delay in seconds between agent probes of a settled fleet (default 8): the slow health
    probe, so an agent that goes stale or silent is noticed within 8 s plus one agent timeout (2 s)."""
    pod_event_gather_seconds: float = 0.5
    """Seconds a reconcile triggered by a pod event waits before it starts (default 0.5); the fleet's
    further pod events meanwhile are folded into it: at hundreds of pods a fleet is reconciled (and its
    status written) a few times while its pods are bound and started, not once per event; a pod
    killed is still acted on within a second."""
    retry_seconds: float = 5.0
    """Seconds before a failed reconcile or Refit step is retried (default 5): Kopf's own 60 s is too
    slow for fleets that a trainer waits on."""
    peering_lifetime_seconds: int = 20
    """Seconds a silent operator replica still counts as alive (default 20); a standby takes over
    after that."""
    peering_settle_seconds: float = 5.0
    """Seconds a replica started with peering waits, announced in the peering object, before Kopf
    starts (default 5): a replica started at the same moment has announced itself by then, so the
    lower priority never acts, not even briefly (:mod:`megafleet.peering`)."""


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    """Shard lifecycle: restarts, draining and fencing."""

    max_restarts: int = 5
    """Re-placements of one shard before it is left ``Failed`` (default 5): bounded restarts, so a
    shard that can never start stops taking nodes."""
    drain_timeout_seconds: float = 30.0
    """Seconds a frontend may finish in-flight requests before its shard's pods are deleted by a
    scale-down or a roll (default 30)."""
    fence_timeout_seconds: float = 10.0
    """Seconds an agent is given to abort serving when its shard is fenced as stale (default 10):
    nothing is drained, a stale shard must stop answering at once."""


@dataclasses.dataclass(frozen=True)
class CatchUpSettings:
    """Delays between catch-ups of a shard (from a peer, from the checkpoint) that keep failing, and
    the peer copies' transport."""

    first_seconds: float = 10.0
    """Seconds after the first failure (default 10); doubled after each further failure."""
    most_seconds: float = 300.0
    """The longest delay in seconds (default 300): a checkpoint that became loadable is tried again
    within five minutes."""
    peer_collective: str = ""
    """The transfer group of copies from a peer: ``gloo`` or ``nccl``; empty (default): the engines'
    own (NCCL between GPU engines, gloo between CPU ones), as for a trainer's refit."""


@dataclasses.dataclass(frozen=True)
class RefitSettings:
    """The Refit controller (:mod:`megafleet.refits.refit_controller`)."""

    poll_seconds: float = 1.0
    """Seconds between steps of a Refit that does not run yet (waiting for its fleet or its trainer;
    default 1)."""
    running_poll_seconds: float = 0.2
    """Seconds between progress polls of a running Refit's agents (default 0.2): a staged member
    waits for the operator's commit, and every poll of the wait is time the fleet serves the old
    version."""
    max_attempts: int = 2
    """Attempts of one Refit (default 2): a failed attempt is retried once with the shards still
    alive, then the Refit is ``Failed``."""

    def next_poll_seconds(self, phase: str) -> float:
        """How long the Refit timer waits after a step of a Refit that was in ``phase``."""
        return self.running_poll_seconds if phase == "Running" else self.poll_seconds


@dataclasses.dataclass(frozen=True)
class SessionSettings:
    """The RefitSession controller (:mod:`megafleet.refits.session_controller`)."""

    poll_seconds: float = 1.0
    """Seconds between observations of a session's members (default 1): a join's progress, a lost
    member, the trainer's store."""
    join_grace_seconds: float = 5.0
    """Seconds past ``joinTimeoutSeconds`` the controller waits for the members to report a join's
    outcome themselves (default 5; each agent's join has the same deadline and fails by itself)."""
    trainer_gone_seconds: float = 60.0
    """Seconds every member must report the trainer's store unreachable before the session is
    ``Closed`` with ``TrainerGone`` (default 60: six of the agents' 10 s probes, so one slow probe
    never ends a run; ``MEGAFLEET_SESSION_TRAINER_GONE_SECONDS``). The session ends within this
    plus one probe (10 s) plus one poll of the members after the trainer is gone."""


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """The operator's HTTP client for the pod agents."""

    timeout_seconds: float = 2.0
    """Seconds one agent call may take (default 2): an agent that does not answer within it is
    reported as unreachable, and the operator observes again a few seconds later."""


@dataclasses.dataclass(frozen=True)
class ApiSettings:
    """How the operator paces its writes to kube-apiserver."""

    service_creates_in_flight: int = 2
    """The most ClusterIP Service creates in flight at once, across fleets (default 2;
    ``MEGAFLEET_API_SERVICE_CREATES_IN_FLIGHT``). kube-apiserver (v1.33 and later: IPAddress-based
    allocation) allocates ClusterIPs one at a time, under one lock held across the write of the
    address's IPAddress object to itself, so only one create progresses at a time and the others
    only wait inside it, adding to the lock holder's work: measured on 2 cores, 1,000 creates went
    at 77, 63, 58 and 42 a second with 1, 4, 8 and 16 in flight (``bench/service_creates.py``).
    Two keep one create allocating while the next is on its way (:mod:`megafleet.reconcile.context`)."""


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    """The operator's settings, grouped by what they tune."""

    triggers: TriggerSettings = dataclasses.field(default_factory=TriggerSettings)
    shards: ShardSettings = dataclasses.field(default_factory=ShardSettings)
    catch_up: CatchUpSettings = dataclasses.field(default_factory=CatchUpSettings)
    refit: RefitSettings = dataclasses.field(default_factory=RefitSettings)
    session: SessionSettings = dataclasses.field(default_factory=SessionSettings)
    agents: AgentSettings = dataclasses.field(default_factory=AgentSettings)
    api: ApiSettings = dataclasses.field(default_factory=ApiSettings)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """The defaults, with every ``MEGAFLEET_<GROUP>_<FIELD>`` of ``environ`` (default: this
        process's) applied, e.g. ``MEGAFLEET_SESSION_TRAINER_GONE_SECONDS=15``. Read once at import by
        :mod:`megafleet.handlers`.

        Raises:
            ValueError: an override is not a number of its field's type.
        """
        environ = os.environ if environ is None else environ
        defaults = cls()
        groups: dict[str, Any] = {}
        for group in dataclasses.fields(cls):
            current = getattr(defaults, group.name)
            changes: dict[str, Any] = {}
            for field in dataclasses.fields(current):
                name = env_name(group.name, field.name)
                raw = environ.get(name)
                if raw is None:
                    continue
                kind = type(getattr(current, field.name))
                try:
                    changes[field.name] = kind(raw)
                except ValueError:
                    raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            groups[group.name] = dataclasses.replace(current, **changes)
        return cls(**groups)


def env_name(group: str, field: str) -> str:
    """The environment name that overrides ``field`` of settings group ``group``."""
    return f"{ENV_PREFIX}{group}_{field}".upper()
