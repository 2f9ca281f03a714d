"""The fleet's refit lock: taken as an attempt starts, released as the Refit finishes.

The fleet's ``status.refit.active`` names the Refit that runs: one refit per fleet at a time, and
the fleet's reconcile does not scale, roll or place while it is set. :func:`take` sets it (with the
membership the trainer reads); :func:`finish` ends a Refit: the fleet released first (and, on
success, its current version moved on), then the Refit's last status, then the fleet's finished
Refits beyond ``refit.historyLimit`` pruned. Called by the Refit controller's steps.
"""

from __future__ import annotations

from megafleet import conditions, kube
from megafleet.objects import Object
from megafleet.refits import context, refit_status


async def take(ctx: context.RefitContext, published: Object) -> None:
    """Name the Refit in the fleet's ``status.refit.active``, with the membership it publishes."""
    fleet_refit = {**ctx.fleet_refit, "active": ctx.name, "membership": published}
    await ctx.api.patch_status("MegatronGeneration", ctx.fleet.name, ctx.namespace, {"refit": fleet_refit})


async def finish(api: kube.Api, refit: Object, fleet_body: Object | None, outcome: refit_status.Outcome) -> None:
    """End ``refit`` with ``outcome``; ``fleet_body`` None: the fleet is not touched (a Refit refused
    before it held the fleet, or whose fleet is gone)."""
    name, namespace = refit["metadata"]["name"], refit["metadata"]["namespace"]
    now = conditions.now()
    update = refit_status.final(refit, outcome, now)
    # The fleet first, then the Refit: a write lost in between (an API server restart, an operator
    # killed) leaves the Refit unfinished, so its poll runs again and finishes it. The other order
    # left the fleet locked by a Succeeded Refit that nothing polls any more
    # (docs/incidents.md#refit-left-fleet-locked).
    patch = None if fleet_body is None else refit_status.released_fleet(fleet_body, name, outcome, now)
    if fleet_body is not None and patch is not None:
        fleet = fleet_body["metadata"]
        await api.patch_status("MegatronGeneration", fleet["name"], fleet["namespace"], patch)
    await api.patch_status("Refit", name, namespace, update)
    if fleet_body is not None and patch is not None:
        await prune(api, namespace, fleet_body)


async def prune(api: kube.Api, namespace: str, fleet_body: Object) -> None:
    """Delete the fleet's finished Refits beyond ``refit.historyLimit`` (see
    :func:`.refit_status.prunable`)."""
    limit = int(((fleet_body.get("spec") or {}).get("refit") or {}).get("historyLimit", 10))
    fleet = fleet_body["metadata"]["name"]
    ours = [item for item in await api.list("Refit", namespace=namespace) if item["spec"]["fleetRef"]["name"] == fleet]
    for name in refit_status.prunable(ours, limit):
        await api.delete("Refit", name, namespace)
