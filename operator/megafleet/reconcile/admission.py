"""Kueue's admission of whole shards, for a fleet with ``spec.placement.gang.scheduler: Kueue``.

Called by :func:`megafleet.reconcile.reconcile`: :func:`observe` right after the pods are observed
(before healing), :func:`gang` by :func:`megafleet.reconcile.shards.place` on each shard's pods as
they are made, and :func:`condition` when the status is written. The operator's placement decides
where a shard goes (nodes, clique) and makes its pods; Kueue decides whether and when the shard
runs (its ClusterQueue's quota, priorities, preemption): the pods wait behind Kueue's scheduling
gate until their group is admitted, all of them at once. Neither overrides the other
(docs/kueue.md). With ``gang.placedBy: Kueue`` Kueue's Topology Aware Scheduling decides where as
well (:func:`kueue_places`): the pods go unpinned, asking for one clique (:func:`topology`), and a
shard no clique holds waits with the reason ``WaitingForTopology``.

- A shard whose pods are gated waits: the ``Admitted`` condition is False, reason
  ``WaitingForQuota``, naming the LocalQueue and Kueue's own words for the lowest waiting shard.
- A shard Kueue stopped (its pods carry Kueue's ``TerminationTarget`` condition: a preemption) is
  removed whole (what Kueue has not deleted yet, the operator deletes), reported once
  (``ShardPreempted``) and not counted as a restart; it is placed again as a new group and waits
  in the queue until Kueue admits it.
- A shard whose pods are all being deleted (scaled in, healed, rolled, stopped by Kueue) has its
  group's Workload deleted (:func:`retire`): Kueue then lets the pods go and the quota returns. Left
  alone, Kueue would hold the pods under its finalizer, and an evicted group's Workload would wait in
  the queue for replacement pods, so the shard would never be placed again. The pods of a deleted
  fleet are let go the same way, from their events (:func:`release_orphan`, called by
  :mod:`megafleet.handlers`).
"""

from __future__ import annotations

from megafleet import conditions, desired, kube, kueue, names, planner
from megafleet.api import checks
from megafleet.fleet_state import ownership, pods
from megafleet.objects import Object
from megafleet.reconcile import context


def uses_kueue(fleet: desired.ParsedFleet) -> bool:
    return fleet.spec.placement.gang.scheduler == "Kueue"


def kueue_places(fleet: desired.ParsedFleet) -> bool:
    """Kueue's Topology Aware Scheduling, not the operator's planner, chooses the shards' cliques
    and nodes (``gang.placedBy: Kueue``)."""
    return uses_kueue(fleet) and fleet.spec.placement.gang.placed_by == "Kueue"


def topology(fleet: desired.ParsedFleet) -> dict[str, str]:
    """What a shard Kueue places asks of its Topology: one clique of ``placement.cliqueLabel`` when
    its NVLink span crosses nodes (required or preferred, as ``placement.nvlink``), else nothing."""
    spec = fleet.spec
    crosses = planner.needs_clique(checks.parallelism(spec.parallelism), spec.resources.gpus_per_node)
    return kueue.topology_request(
        clique_label=spec.placement.clique_label,
        needs_clique=crosses and fleet.layout.pods_per_shard > 1,
        required=spec.placement.nvlink == "Required",
    )


def gang(fleet: desired.ParsedFleet, shard: int, members: list[Object]) -> list[Object]:
    """One shard's pods as one Kueue pod group of a new name, when the fleet uses Kueue; asking
    Kueue's TAS for a clique when Kueue places it."""
    queue = fleet.spec.placement.gang.queue
    if not uses_kueue(fleet) or queue is None:
        return members
    group = kueue.group_name(fleet.name, shard)
    if kueue_places(fleet):
        asked = topology(fleet)
        return kueue.join(members, queue=queue, group=group, topology=asked, index_label=names.LABEL_POD_INDEX)
    return kueue.join(members, queue=queue, group=group)


async def observe(ctx: context.FleetContext) -> None:
    """Record the shards Kueue holds in ``ctx.queued``, remove, whole, the shards it stopped and end
    the groups of the shards that go. A fleet that no longer uses Kueue still ends the groups of its
    old pods (changing ``gang`` rolls the fleet), looked for only while a shard is terminating."""
    if not uses_kueue(ctx.fleet) and not ctx.shards.terminating:
        return
    raw = ownership.only_owned(await pods.labelled_objects(ctx.api, ctx.runtime.cache, "Pod", ctx.fleet), ctx.fleet)
    if not uses_kueue(ctx.fleet):
        await retire(ctx.api, ctx.fleet.namespace, kueue.retired(raw))
        return
    gated: dict[int, str] = {}
    stopped: dict[int, str] = {}
    for pod in raw:
        shard = int(pod["metadata"]["labels"][names.LABEL_SHARD])
        reason = kueue.stopped_by_kueue(pod)
        if reason is not None:
            stopped.setdefault(shard, reason)
        elif kueue.gated(pod) and not pod["metadata"].get("deletionTimestamp"):
            gated.setdefault(shard, kueue.group_of(pod) or "")
    for shard, reason in sorted(stopped.items()):
        await _remove_stopped(ctx, shard, reason)
    await retire(ctx.api, ctx.fleet.namespace, kueue.retired(raw))
    waiting = sorted(shard for shard in gated if shard not in stopped)
    if waiting:
        first = waiting[0]
        workload = await ctx.api.get("Workload", gated[first], ctx.fleet.namespace) if gated[first] else None
        ctx.queued = {shard: kueue.waiting_reason(workload) if shard == first else "" for shard in waiting}


async def retire(api: kube.Api, namespace: str, groups: list[str]) -> None:
    """End each pod group of ``groups`` (:func:`megafleet.kueue.retired`) the way Kueue ends one: its
    Workload deleted. Kueue stops what is left of the group, takes its finalizer off the pods and
    releases the group's quota."""
    for group in groups:
        await api.delete("Workload", group, namespace)


async def release_orphan(api: kube.Api, pod: Object) -> None:
    """``pod`` is of a fleet that is gone (the garbage collector deletes its pods): end its group, if
    the pod was the fleet's (its controller a MegatronGeneration of the name its label gives)."""
    metadata = pod["metadata"]
    fleet = (metadata.get("labels") or {}).get(names.LABEL_FLEET)
    owned = any(
        owner.get("kind") == "MegatronGeneration" and owner.get("name") == fleet and owner.get("controller")
        for owner in metadata.get("ownerReferences") or []
    )
    if owned:
        await retire(api, metadata.get("namespace") or "default", kueue.retired([pod]))


def created(ctx: context.FleetContext, shard: int, members: list[Object]) -> None:
    """A shard just placed waits from now on if Kueue's webhook gated its pods (the created objects
    say so): no later pod event may come before Kueue admits it."""
    if uses_kueue(ctx.fleet) and any(kueue.gated(pod) for pod in members):
        ctx.queued.setdefault(shard, "just placed; Kueue has not admitted its pod group yet")


async def _remove_stopped(ctx: context.FleetContext, shard: int, reason: str) -> None:
    """Delete what is left of a shard Kueue stopped and report it once: the first reconcile that sees
    it finds the shard's pods still listed in the status, and clears them so healing counts no restart."""
    for pod in ctx.shards.take(shard):
        await ctx.api.delete("Pod", pod.name, ctx.fleet.namespace)
    entries = list(ctx.status.get("shards", []))
    listed = [index for index, item in enumerate(entries) if item.get("index") == shard and item.get("pods")]
    if not listed:
        return
    entries[listed[0]] = {**entries[listed[0]], "pods": []}
    ctx.status = {**ctx.status, "shards": entries}
    queue = ctx.fleet.spec.placement.gang.queue
    ctx.notify(
        "Warning",
        "ShardPreempted",
        f"shard {shard} was stopped by Kueue ({reason}): removed whole; it waits in LocalQueue {queue} to be "
        "admitted again",
    )


def condition(ctx: context.FleetContext, found: list[conditions.Condition], *, now: str) -> list[conditions.Condition]:
    """``found`` with ``Admitted`` set (fleets using Kueue only): False while a shard waits."""
    if not uses_kueue(ctx.fleet):
        return found
    queue, generation = ctx.fleet.spec.placement.gang.queue, ctx.fleet.generation
    if ctx.queued:
        shards = ", ".join(str(shard) for shard in sorted(ctx.queued))
        first = min(ctx.queued)
        message = (
            f"shards {shards} wait in LocalQueue {queue}: not admitted by Kueue (shard {first}: {ctx.queued[first]})"
        )
        reason = "WaitingForTopology" if kueue.short_of_topology(ctx.queued[first]) else "WaitingForQuota"
        verdict = conditions.Verdict(False, reason, message[: context.SUMMARY_CHARACTERS])
    else:
        verdict = conditions.Verdict(True, "AllShardsAdmitted", f"Kueue admitted every shard from LocalQueue {queue}")
    return conditions.set_condition(found, conditions.ADMITTED, verdict, generation=generation, now=now)
