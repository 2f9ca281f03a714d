"""A shard's ComputeDomain (:mod:`megafleet.compute_domain`): made before its pods, deleted with it.

Called by :mod:`.shards` (:func:`attach` while placing, :func:`remove` when a shard's pods are
deleted) and by :mod:`.lost_nodes` (a shard on a lost node). Only shards spanning nodes of one
clique take part, so fleets within one node make no call here. Placing a shard first deletes the
domains an earlier placement of it left (its pods went away without the operator removing them),
then creates a new one under a new name, and only then are the pods, claiming its channel, created.

A cluster that does not serve the ComputeDomain API (no NVIDIA DRA driver: the API server answers
404 for the resource) gets the pods without claims, as before, and a ``ComputeDomainUnavailable``
Event says so; the domain is created as soon as the API is served.
"""

from __future__ import annotations

import secrets

from megafleet import compute_domain, kube, names
from megafleet.fleet_state import ownership
from megafleet.objects import Object
from megafleet.reconcile import context

KIND = compute_domain.KIND


def spanning(ctx: context.FleetContext) -> bool:
    """Whether the fleet's shards can span nodes at all (more than one pod each, in one clique)."""
    return ctx.fleet.layout.pods_per_shard > 1


async def attach(
    ctx: context.FleetContext, spans: dict[int, int], wanted: dict[int, list[Object]]
) -> dict[int, list[Object]]:
    """``wanted`` (each placed shard's pods) with a new ComputeDomain made for every shard that spans
    nodes of one clique (``spans``: shard to its node count, from the operator's placement or, for a
    shard Kueue places in one clique, its pod count) and its pods claiming the domain's channel; the
    others as they are."""
    if not spanning(ctx):
        return wanted
    attached = dict(wanted)
    made, missing_api = [], False
    for shard, nodes in sorted(spans.items()):
        if nodes < 2 or missing_api:
            continue
        try:
            await remove(ctx, shard)
            domain = compute_domain.name(ctx.fleet.name, shard, secrets.token_hex(3))
            await ownership.create(ctx.api, ctx.fleet, compute_domain.compute_domain(ctx.fleet, shard, domain, nodes))
        except kube.ApiError as error:
            if error.code != 404:
                raise
            missing_api = True
            continue
        attached[shard] = [compute_domain.with_channel(pod, domain) for pod in wanted[shard]]
        made.append(f"shard {shard}: {domain}")
    if made:
        ctx.notify("Normal", "ComputeDomainCreated", context.summary(made))
    if missing_api:
        ctx.notify(
            "Warning",
            "ComputeDomainUnavailable",
            f"{compute_domain.API_VERSION} {KIND} is not served (no NVIDIA DRA driver): shards spanning "
            "nodes are placed without IMEX channels",
        )
    return attached


async def remove(ctx: context.FleetContext, shard: int) -> None:
    """Delete the ComputeDomains of ``shard`` (every placement's); nothing when the API is not served."""
    if not spanning(ctx):
        return
    labels = {names.LABEL_FLEET: ctx.fleet.name, names.LABEL_SHARD: str(shard)}
    try:
        found = await ctx.api.list(KIND, namespace=ctx.fleet.namespace, labels=labels)
    except kube.ApiError as error:
        if error.code == 404:
            return
        raise
    for domain in ownership.only_owned(found, ctx.fleet):
        await ctx.api.delete(KIND, domain["metadata"]["name"], ctx.fleet.namespace)
