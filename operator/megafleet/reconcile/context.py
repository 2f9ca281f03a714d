"""What one reconcile works on: the operator-wide runtime and the per-fleet context.

:class:`Runtime` lives as long as the operator (kept in Kopf's ``memo`` by :mod:`megafleet.handlers`);
:class:`FleetContext` lives for one reconcile of one fleet, built by :func:`megafleet.reconcile.reconcile`
and handed to each step, which reads what earlier steps found and records what it finds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from megafleet import agent_client, backoff, desired, kube
from megafleet import settings as operator_settings
from megafleet.fleet_state import ownership, pods
from megafleet.objects import Object
from megafleet.reconcile import cache as watch_cache
from megafleet.reconcile import pod_checks

Notify = Callable[[str, str, str], None]
"""Emits a Kubernetes Event about the fleet: (type Normal|Warning, reason, message)."""


def ignore(kind: str, reason: str, message: str) -> None:
    """A :data:`Notify` that emits nothing (in-process tests)."""


SUMMARY_CHARACTERS = 1000
"""The longest Event message :func:`summary` makes (Kopf cuts Event messages at 1,024 characters)."""


def summary(items: list[str]) -> str:
    """One Event message for several shards (``items`` each say one shard's part), cut to
    :data:`SUMMARY_CHARACTERS` with the count of the items left out: one Event per reconcile step
    instead of one per shard, which at hundreds of shards were most of the operator's writes."""
    message = "; ".join(items)
    if len(message) <= SUMMARY_CHARACTERS:
        return message
    shown: list[str] = []
    for item in items:
        if len("; ".join([*shown, item])) > SUMMARY_CHARACTERS - 24:
            break
        shown.append(item)
    return "; ".join(shown) + f"; and {len(items) - len(shown)} more"


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one reconcile saw of a fleet: its pods and agents (a fingerprint to compare probes with),
    and whether it left the fleet settled (every shard Ready, nothing placed, rolled or refitted)."""

    fleet: desired.ParsedFleet
    token: str
    """The fleet's agent token, so a probe reads no Secret."""
    seen: tuple[Any, ...]
    settled: bool
    starting: bool = False
    """Not settled only because shards are still coming up (pods starting, engines loading):
    nothing a timer would act on, so it is probed at the observe interval, not reconciled."""


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The operator's clients, settings and the state shared across fleets and reconciles."""

    api: kube.Api
    agents: agent_client.AgentClient
    settings: operator_settings.OperatorSettings
    fleet_locks: dict[tuple[str, str], asyncio.Lock]
    """Keep the reconciles and Refit steps of one fleet sequential, keyed by (namespace, name)."""
    placement_lock: asyncio.Lock
    """Serialises inventory-plan-create across fleets, so each sees the GPUs the others took."""
    catch_up: backoff.Backoff
    """Delays between catch-ups that keep failing, keyed by (namespace, fleet, shard, version, source:
    the checkpoint's path, or ``peer``)."""
    catching_up: dict[tuple[str, str, int], tuple[int, str]] = dataclasses.field(default_factory=dict)
    """The catch-ups started, keyed by (namespace, fleet, shard): the version and the source (a peer
    shard, a checkpoint), for the ``CaughtUp`` Event once the shard serves it (in memory only)."""
    store_lost: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """When (monotonic seconds) every member of a joined RefitSession, keyed by (namespace, name),
    first reported the trainer's store unreachable; kept in memory only (an operator restart starts
    the wait again, which only delays ``TrainerGone``)."""
    waiting: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """Fleets, keyed by (namespace, name), whose next reconcile waits for the fleet's lock: a further
    trigger is folded into it (:func:`megafleet.handlers._reconcile`)."""
    cache: watch_cache.Cache | None = None
    """Watch-fed pods, Services and nodes (the operator's); None: the steps LIST (in-process tests)."""
    service_slots: asyncio.Semaphore = dataclasses.field(
        default_factory=lambda: asyncio.Semaphore(operator_settings.ApiSettings().service_creates_in_flight)
    )
    """Bounds the ClusterIP Service creates in flight across fleets
    (``settings.api.service_creates_in_flight``: kube-apiserver allocates ClusterIPs one at a time,
    so more in flight only queue there, and at ~1,000 in one burst it stopped completing them).
    Taken before the API client's own request slot, so creates waiting here hold none;
    waiters are served in arrival order, so the fleets that asked first get their endpoints, and
    their pods, first."""
    recent: ownership.Recent = dataclasses.field(default_factory=ownership.Recent)
    """The fleets' own Secrets and ConfigMaps as last read or written, so a burst of reconciles reads
    each once (:class:`megafleet.fleet_state.ownership.Recent` says how fresh)."""
    observed: dict[tuple[str, str], Observation] = dataclasses.field(default_factory=dict)
    """What the last reconcile of each fleet, keyed by (namespace, name), saw of its pods and agents,
    and whether it left the fleet settled (:mod:`megafleet.reconcile.pacing` compares probes with it)."""
    checked_pods: pod_checks.Checked = dataclasses.field(default_factory=pod_checks.Checked)
    """What each fleet's spec makes of its pods that the engine or the API server would refuse, by
    generation (:mod:`megafleet.reconcile.pod_checks`)."""

    @classmethod
    def of(
        cls,
        api: kube.Api,
        agents: agent_client.AgentClient,
        settings: operator_settings.OperatorSettings,
        *,
        cache: watch_cache.Cache | None = None,
    ) -> Runtime:
        delays = backoff.Backoff(
            first_seconds=settings.catch_up.first_seconds, most_seconds=settings.catch_up.most_seconds
        )
        if cache is not None:
            api.observers.append(cache.written)  # own writes are seen before the watch delivers them
        slots = asyncio.Semaphore(max(1, settings.api.service_creates_in_flight))
        return cls(api, agents, settings, {}, asyncio.Lock(), delays, cache=cache, service_slots=slots)

    def fleet_lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.fleet_locks.setdefault((namespace, name), asyncio.Lock())

    async def close(self) -> None:
        await self.api.close()
        await self.agents.close()


class OnRuntime:
    """The operator's clients and settings, as every controller's context reads them from its
    :class:`Runtime` (the fleet reconcile's and the Refit and RefitSession controllers')."""

    runtime: Runtime

    @property
    def api(self) -> kube.Api:
        return self.runtime.api

    @property
    def agents(self) -> agent_client.AgentClient:
        return self.runtime.agents

    @property
    def settings(self) -> operator_settings.OperatorSettings:
        return self.runtime.settings


@dataclasses.dataclass
class FleetContext(OnRuntime):
    """One reconcile of one valid fleet; the fields after ``notify`` are filled in by the steps."""

    runtime: Runtime
    body: Object
    """The fleet as read at the start; its status is updated by each status write."""
    fleet: desired.ParsedFleet
    notify: Notify
    status: Object = dataclasses.field(default_factory=dict)
    """The status being built, written by :func:`megafleet.reconcile.status.write`."""
    token: str = ""
    """The fleet's agent token."""
    shards: pods.Shards = dataclasses.field(default_factory=lambda: pods.Shards({}, set()))
    restarts: dict[int, tuple[int, str | None]] = dataclasses.field(default_factory=dict)
    """Restart count and last error by shard."""
    unplaced: dict[int, str] = dataclasses.field(default_factory=dict)
    """Why each shard that could not be placed was not."""
    reports: pods.Reports = dataclasses.field(default_factory=dict)
    held_world: frozenset[int] = frozenset()
    """The shards in the trainer's world of the session that holds the fleet (empty when none does)."""
    queued: dict[int, str] = dataclasses.field(default_factory=dict)
    """The shards Kueue has not admitted (``gang.scheduler: Kueue``), with Kueue's reason for the lowest
    ('' for the others): :mod:`megafleet.reconcile.admission`."""

    @property
    def refit(self) -> Object:
        """``status.refit``: the running refit (``active``) and the fleet's current version."""
        refit: Object = self.status.get("refit") or {}
        return refit

    @property
    def refitting(self) -> bool:
        """A refit runs: scaling, rolling and placing wait for it."""
        return self.refit.get("active") is not None

    @property
    def held(self) -> str | None:
        """The RefitSession whose trainer world the shards hold (``status.refit.session``): scaling,
        rolling, placing and checkpoint catch-ups wait until it ends; healing does not, nor the placing
        of a lost shard outside its world (``held_world``)."""
        session: str | None = self.refit.get("session")
        return session
