"""When a fleet is observed again: full reconciles while it changes, a slow agent probe once settled.

Called by the observation daemon in :mod:`megafleet.handlers`. Kubernetes events (the fleet's spec,
its pods) reconcile at once through their own handlers; what only the agents know (Ready, Stale,
an agent gone silent) is found by polling. A fleet the last reconcile left *settled* (every shard
Ready and nothing to place, roll, fence or refit) is not reconciled on a timer any more: a probe
reads its pods from the watch-fed cache (no API call) and asks each agent its state, and only a
difference from what that reconcile saw starts a reconcile. The probe's delay starts at
``probe_first_seconds`` after any change and doubles while nothing changes, up to
``probe_most_seconds``; so a settled fleet costs no API reads or writes, and one agent call per pod
per ``probe_most_seconds``, and an agent that goes stale or silent is noticed within
``probe_most_seconds`` plus one agent timeout. A fleet that is only *starting* (every shard placed
and coming up, nothing else pending: :func:`starting`) is probed the same way every
``observe_interval_seconds``, and reconciled only when its pods or agents changed: at a thousand
starting pods that is the difference between a few reconciles per fleet and one every interval.
Any other fleet that is not settled is reconciled every ``observe_interval_seconds``, as always.
"""

from __future__ import annotations

from typing import Any

from megafleet.fleet_state import pods
from megafleet.objects import Object
from megafleet.reconcile import context, lost_nodes


def pod_view(pod: pods.Pod) -> tuple[Any, ...]:
    """What a reconcile acts on of one pod. Its node is the one it is pinned to until bound there
    (the same node): being bound changes nothing the reconcile does or the status shows."""
    return (pod.shard, pod.name, pod.phase, pod.ip, pod.placed_on, pod.template_hash)


def fingerprint(shards: pods.Shards, reports: pods.Reports) -> tuple[Any, ...]:
    """What a reconcile acts on of the pods and agents, as a comparable value."""
    seen = tuple(pod_view(pod) for _, members in sorted(shards.pods.items()) for pod in members)
    answered = tuple((shard, tuple(reports[shard])) for shard in sorted(reports))
    return seen, tuple(sorted(shards.terminating)), answered


def settled(ctx: context.FleetContext) -> bool:
    """The reconcile left nothing to do that only time would bring: every shard up to ``replicas``
    is placed and Ready, none terminates or waits for GPUs, no refit runs or session holds it."""
    replicas = ctx.fleet.spec.replicas
    if ctx.refitting or ctx.held is not None or ctx.unplaced or ctx.shards.terminating:
        return False
    if set(ctx.shards.pods) != set(range(replicas)):
        return False
    return int(ctx.status.get("readyReplicas") or 0) == replicas


STARTING_PHASES = frozenset({"Starting", "Loading", "Ready"})
"""Shard phases that only an agent's (or a pod's) change moves on; a Stale shard waits for a
checkpoint catch-up, which a timer retries, and a Failed one for a restart."""


def starting(ctx: context.FleetContext) -> bool:
    """Not settled, but nothing but the pods and agents themselves can move it on: every shard up
    to ``replicas`` is placed, none terminates, waits for GPUs or for Kueue (whose reason, read from
    a Workload, changes without any pod changing), no refit runs or session holds the fleet, and
    each shard is Starting, Loading or Ready."""
    replicas = ctx.fleet.spec.replicas
    if ctx.refitting or ctx.held is not None or ctx.unplaced or ctx.shards.terminating or ctx.queued:
        return False
    if set(ctx.shards.pods) != set(range(replicas)):
        return False
    return {entry.get("phase") for entry in ctx.status.get("shards", [])} <= STARTING_PHASES


def record(ctx: context.FleetContext) -> None:
    """Keep what this reconcile saw, for the probes that follow it."""
    key = (ctx.fleet.namespace, ctx.fleet.name)
    seen = fingerprint(ctx.shards, ctx.reports)
    done = settled(ctx)
    ctx.runtime.observed[key] = context.Observation(ctx.fleet, ctx.token, seen, done, not done and starting(ctx))


async def probe(runtime: context.Runtime, body: Object) -> bool:
    """Whether the settled (or starting) fleet ``body`` looks different now than at its last
    reconcile (pods from the cache, agents asked); True also when there is nothing to compare with."""
    metadata = body["metadata"]
    last = runtime.observed.get((metadata.get("namespace") or "default", metadata["name"]))
    if last is None or not (last.settled or last.starting) or runtime.cache is None or not runtime.cache.ready:
        return True
    if (metadata.get("uid"), metadata.get("generation")) != (last.fleet.uid, last.fleet.generation):
        return True  # the spec changed (its own handler reconciles too)
    if lost_nodes.due(runtime.cache, last.fleet):
        return True  # a node of its pods is lost (deleted, or unreachable past the pods' toleration)
    shards = await pods.observe(runtime.api, last.fleet, runtime.cache)
    reports = await pods.ask_agents(runtime.agents, shards, last.token)
    return fingerprint(shards, reports) != last.seen


def pod_unchanged(runtime: context.Runtime, namespace: str, fleet: str, body: Object) -> bool:
    """Whether the last complete reconcile of ``fleet`` saw the pod ``body`` (an event's) just as it
    is now: the event (the watch confirming an own create, a condition the scheduler or kubelet
    wrote, a bind to the pinned node) gives that reconcile nothing to do, so the handler need not
    start one. False whenever in doubt (no such reconcile, a pod it did not see, one deleting)."""
    last = runtime.observed.get((namespace, fleet))
    if last is None:
        return False
    try:
        pod = pods.parse(body, clique_label=last.fleet.spec.placement.clique_label)
    except (KeyError, ValueError):
        return False
    return not pod.deleting and pod_view(pod) in last.seen[0]


def next_delay(previous: float | None, *, first: float, most: float) -> float:
    """The next probe delay of a settled fleet: ``first`` after a change (``previous`` None), then
    doubled up to ``most``."""
    return first if previous is None else min(previous * 2, most)
