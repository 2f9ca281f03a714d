"""Shard lifecycle: scale down with a drain, heal broken shards, roll one shard, place missing ones.

Called by :func:`megafleet.reconcile.reconcile`, in that order, on ``ctx.shards``. A shard is
whole or absent: its pods are deleted together, and it is placed again (all pods at once, on
nodes the planner chose) only once the old ones are gone. Restarts are counted and bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube import operators

from megafleet import compute_domain, desired, kueue, planner
from megafleet.api import checks
from megafleet.fleet_state import ownership, pods
from megafleet.reconcile import admission, compute_domains, context, inventory


async def scale_down(ctx: context.FleetContext, *, keep: frozenset[int] = frozenset()) -> None:
    """Drain and remove the shards above ``spec.replicas``, highest last, except those in ``keep`` (the
    world of the session that holds the fleet: they leave once the trainer's rebuild leaves them out)."""
    replicas = ctx.fleet.spec.replicas
    for shard in sorted(index for index in ctx.shards.pods if index >= replicas and index not in keep):
        await _drain_and_remove(ctx, shard)
        ctx.notify("Normal", "ShardRemoved", f"shard {shard} drained and removed by scaling to {replicas}")


async def heal(ctx: context.FleetContext) -> None:
    """Count a restart for each shard whose pods went away or broke, and delete what is left of a
    broken one; ``ctx.restarts`` starts from the counts in the status. A shard whose pods someone
    else deleted counts once, as soon as their deletion shows (terminating or gone): the status entry
    of a shard the operator removes itself, or that already counted, lists no pods."""
    previous = {item["index"]: item for item in ctx.status.get("shards", [])}
    ctx.restarts = {index: (int(item.get("restarts", 0)), item.get("lastError")) for index, item in previous.items()}
    for shard, item in sorted(previous.items()):
        gone = shard not in ctx.shards.pods
        if item.get("pods") and gone and shard < ctx.fleet.spec.replicas:
            count = _restart(ctx, shard, f"pods gone: {', '.join(item['pods'])}")
            ctx.notify("Warning", "ShardRestarting", f"shard {shard} is re-placed (restart {count}): its pods are gone")
    template = desired.template_hash(ctx.fleet)
    for shard in sorted(ctx.shards.pods):
        reason = broken(ctx.shards.pods[shard], ctx.fleet.layout, template)
        if reason is None:
            continue
        count = _restart(ctx, shard, reason)
        await _remove(ctx, shard)
        ctx.notify("Warning", "ShardRestarting", f"shard {shard} is re-placed (restart {count}): {reason}")


def broken(members: list[pods.Pod], layout: planner.PodLayout, template: str) -> str | None:
    """Why a shard cannot serve as it is (a pod missing or ended, with why its engine exited), or
    None. A shard on an older ``template`` was placed with the old layout (a changed pipeline size
    changes its pod count): only an ended pod breaks it; :func:`roll` replaces it."""
    ended = [pod.name if pod.exit_reason is None else f"{pod.name} ({pod.exit_reason})" for pod in members if pod.ended]
    if ended:
        return f"pods ended: {', '.join(ended)}"
    current = all(pod.template_hash == template for pod in members)
    if current and len(members) != layout.pods_per_shard:
        return f"{layout.pods_per_shard - len(members)} of {layout.pods_per_shard} pods missing"
    return None


def _restart(ctx: context.FleetContext, shard: int, reason: str) -> int:
    count = ctx.restarts.get(shard, (0, None))[0] + 1
    ctx.restarts[shard] = (count, reason)
    return count


async def roll(ctx: context.FleetContext) -> None:
    """Replace one shard whose pods run an older template, only while every shard runs whole."""
    shards, replicas = ctx.shards, ctx.fleet.spec.replicas
    if shards.terminating or any(shard not in shards.pods for shard in range(replicas)):
        return
    if not all(pod.running for members in shards.pods.values() for pod in members):
        return
    current = desired.template_hash(ctx.fleet)
    for shard in sorted(shards.pods):
        if any(pod.template_hash != current for pod in shards.pods[shard]):
            await _drain_and_remove(ctx, shard)
            ctx.notify("Normal", "ShardRolling", f"shard {shard} is replaced to apply the changed pod template")
            return


async def place(ctx: context.FleetContext, *, outside: frozenset[int] | None = None) -> None:
    """Plan and create the shards that have no pods (not terminating, not given up on); record in
    ``ctx.unplaced`` why the others could not be placed. Once a refit moved the fleet past the
    checkpoint, new pods start without weights (Stale until a catch-up or refit). With ``outside``
    (the world of the session that holds the fleet) only shards not in that world are placed (added by
    a scale-out, or lost): Stale until the trainer's next rebuild names them and a refit after it."""
    exhausted = {shard for shard, (count, _) in ctx.restarts.items() if count > ctx.settings.shards.max_restarts}
    skip = ctx.shards.terminating | exhausted
    if outside is not None:
        skip |= outside
    missing = [shard for shard in range(ctx.fleet.spec.replicas) if shard not in ctx.shards.pods and shard not in skip]
    if not missing:
        return
    defer_weights = ctx.refit.get("currentVersion") is not None
    if admission.kueue_places(ctx.fleet):
        await _hand_to_kueue(ctx, missing, defer_weights=defer_weights)
        return
    request = _request(ctx, missing)
    cache = ctx.runtime.cache if ctx.runtime.cache is not None and ctx.runtime.cache.ready else None
    async with ctx.runtime.placement_lock:  # fleets plan one at a time, each seeing what the others took
        plan = planner.plan_placement(request, await _inventory(ctx))
        wanted = {
            shard: admission.gang(
                ctx.fleet, shard, desired.shard_pods(ctx.fleet, shard, placement, defer_weights=defer_weights)
            )
            for shard, placement in plan.placed.items()
        }
        spans = {shard: compute_domain.nodes_spanned(placement) for shard, placement in plan.placed.items()}
        wanted = await compute_domains.attach(ctx, spans, wanted)  # domains before their pods
        planned = [pod for shard in sorted(wanted) for pod in wanted[shard]]
        if cache is not None:  # counted from now on: the next fleet plans while these are created
            cache.reserve(planned)
        else:
            made = await _create(ctx, planned)
    if cache is not None:
        try:
            made = await _create(ctx, planned)
        finally:
            cache.release(planned)
    created = iter(made)
    placed = []
    for shard, placement in sorted(plan.placed.items()):
        members = [next(created) for _ in wanted[shard]]
        admission.created(ctx, shard, members)
        ctx.shards.pods[shard] = [pods.parse(pod, clique_label=request.clique_label) for pod in members]
        where = f"clique {placement.clique}" if placement.clique else "nodes"
        placed.append(f"shard {shard} on {where}: {_nodes(placement)}")
    if placed:  # one Event per placement, not one per shard
        ctx.notify("Normal", "ShardsPlaced", context.summary(placed))
    if plan.unplaced:
        ctx.notify("Warning", "Unschedulable", context.summary([plan.unplaced[s] for s in sorted(plan.unplaced)]))
    ctx.unplaced = dict(plan.unplaced)


async def _hand_to_kueue(ctx: context.FleetContext, missing: list[int], *, defer_weights: bool) -> None:
    """Create the ``missing`` shards' pods unpinned, each shard one pod group asking Kueue's TAS for
    a clique (``gang.placedBy: Kueue``): Kueue chooses the clique and the nodes when it admits the
    group and pins each pod to its node then (a hostname node selector), which the planner of every
    fleet counts from that moment on (:func:`megafleet.fleet_state.pods.pinned_node`). Nothing is
    planned here, so nothing is unplaced: a shard no clique holds waits in the queue, and the
    ``Admitted`` condition gives Kueue's reason."""
    wanted = {
        shard: admission.gang(ctx.fleet, shard, desired.shard_pods(ctx.fleet, shard, None, defer_weights=defer_weights))
        for shard in missing
    }
    if kueue.REQUIRED_TOPOLOGY in admission.topology(ctx.fleet):  # one clique, a node per pod: a domain
        wanted = await compute_domains.attach(ctx, dict.fromkeys(missing, ctx.fleet.layout.pods_per_shard), wanted)
    made = iter(await _create(ctx, [pod for shard in missing for pod in wanted[shard]]))
    clique_label = ctx.fleet.spec.placement.clique_label
    for shard in missing:
        members = [next(made) for _ in wanted[shard]]
        admission.created(ctx, shard, members)
        ctx.shards.pods[shard] = [pods.parse(pod, clique_label=clique_label) for pod in members]
    request = ", ".join(f"{key.split('/')[-1]}={value}" for key, value in sorted(admission.topology(ctx.fleet).items()))
    shards = ", ".join(str(shard) for shard in missing)
    ctx.notify("Normal", "ShardsPlaced", f"shards {shards} handed to Kueue to place ({request})")
    ctx.unplaced = {}


def _nodes(placement: planner.ShardPlacement) -> str:
    return ", ".join(pod.node for pod in placement.pods)


def _request(ctx: context.FleetContext, missing: list[int]) -> planner.PlacementRequest:
    spec = ctx.fleet.spec
    return planner.PlacementRequest(
        fleet=ctx.fleet.name,
        shard_indices=missing,
        layout=ctx.fleet.layout,
        nvlink_span=checks.parallelism(spec.parallelism).nvlink_span,
        gpus_per_node=spec.resources.gpus_per_node,
        clique_label=spec.placement.clique_label,
        require_clique=spec.placement.nvlink == "Required",
        spread_shards=spec.placement.spread_shards,
        node_selector=dict(spec.placement.node_selector),
        existing={shard: existing(members) for shard, members in ctx.shards.pods.items()},
    )


def existing(members: list[pods.Pod]) -> planner.ShardPlacement:
    """Where a placed shard sits: each pod's node (bound, else pinned) and the shard's clique."""
    return planner.ShardPlacement(
        clique=members[0].clique, pods=tuple(planner.PodPlacement(node=pod.placed_on, gpus=0) for pod in members)
    )


async def _create(ctx: context.FleetContext, planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every planned pod at once (one round trip); each is in the cache's overlay once its create
    returned. Every create has finished (or failed) when this returns or raises."""
    made = await asyncio.gather(*(ownership.create(ctx.api, ctx.fleet, pod) for pod in planned), return_exceptions=True)
    for outcome in made:
        if isinstance(outcome, BaseException):
            raise outcome
    return [outcome for outcome in made if not isinstance(outcome, BaseException)]


async def _inventory(ctx: context.FleetContext) -> list[planner.NodeInfo]:
    """Nodes and the pods not ended, from the watch-fed cache where it covers them (see
    :mod:`.cache` for how fresh), else LISTed; and the Workload of each Kueue group admitted whose
    pods Kueue's TAS has not pinned yet (a moment, between its admission and its ungating), whose
    topology assignment names their nodes."""
    cache = ctx.runtime.cache if ctx.runtime.cache is not None and ctx.runtime.cache.ready else None
    live = cache.live_pods() if cache is not None else None
    if live is None:
        live = await ctx.api.list("Pod", fields={"status.phase": operators.not_in(["Succeeded", "Failed"])})
        if cache is not None:
            live = cache.with_reserved(live)
    found = cache.nodes() if cache is not None else await ctx.api.list("Node")
    spec = ctx.fleet.spec
    workloads = {
        (namespace, group): await ctx.api.get("Workload", group, namespace)
        for namespace, group in inventory.awaiting_groups(live)
    }
    return inventory.nodes(
        found,
        live,
        resource=spec.resources.gpu_resource,
        tolerations=spec.placement.tolerations,
        assigned=inventory.assigned_gpus(live, workloads, spec.resources.gpu_resource),
    )


async def _drain_and_remove(ctx: context.FleetContext, shard: int) -> None:
    """Close the shard's frontend and let in-flight requests finish (bounded), then delete its pods."""
    members = ctx.shards.pods.get(shard, [])
    if members and members[0].ip:
        timeout = ctx.settings.shards.drain_timeout_seconds
        await ctx.agents.suspend(members[0].ip, ctx.token, mode="drain", timeout_seconds=timeout)
    await _remove(ctx, shard)


async def _remove(ctx: context.FleetContext, shard: int) -> None:
    """Delete every pod of ``shard`` (whole or nothing); it is placed again once they are gone."""
    for pod in ctx.shards.take(shard):
        await ctx.api.delete("Pod", pod.name, ctx.fleet.namespace)
    await compute_domains.remove(ctx, shard)
