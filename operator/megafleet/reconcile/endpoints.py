"""Endpoints are reserved before any pod exists: the agent token, each shard's Services, the
endpoints ConfigMap and ``status.endpoints``.

Called by :func:`megafleet.reconcile.reconcile`. A frontend Service's ClusterIP is the shard's
published endpoint for the fleet's whole life; a shard of several pods also gets a headless ranks
Service (a one-pod shard needs none: :func:`megafleet.desired.shard_services`; one made by an older
operator is kept while its shard lives, as its pods' rendezvous address may name it); Services of
shards removed by scaling down go. Only
objects the fleet owns are read, published or deleted (:mod:`.ownership`).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any

from megafleet import conditions, desired, kube, names
from megafleet.api import v1alpha1
from megafleet.reconcile import context, ownership, pods, status


def fresh(ctx: context.FleetContext) -> bool:
    """No endpoints were ever published for the fleet: its Secret and ConfigMap most likely do not
    exist yet, so they are created without a GET first (a create that finds one returns it, and
    :func:`.ownership.create` checks whose it is): two round trips fewer before the first pod."""
    return not ctx.status.get("endpoints")


async def agent_token(ctx: context.FleetContext) -> str:
    """The fleet's agent token, created once and never rotated by a reconcile. A Secret of that name
    the fleet does not own is a :class:`~.ownership.NameConflict`, never read."""
    fleet = ctx.fleet
    name = names.agent_secret(fleet.name)
    secret = None if fresh(ctx) else await ownership.get(ctx.api, fleet, "Secret", name)
    if secret is None:
        secret = await ownership.create(ctx.api, fleet, desired.agent_secret(fleet, secrets.token_urlsafe(32)))
    encoded = (secret.get("data") or {}).get(names.AGENT_TOKEN_KEY)
    if not encoded:  # the fleet's Secret, emptied by hand: a new token (agents read it at every call)
        encoded = desired.agent_secret(fleet, secrets.token_urlsafe(32))["data"][names.AGENT_TOKEN_KEY]
        await ctx.api.patch("Secret", name, fleet.namespace, {"data": {names.AGENT_TOKEN_KEY: encoded}})
    return base64.b64decode(encoded).decode()


async def read_token(api: kube.Api, fleet: desired.ParsedFleet) -> str:
    """The fleet's agent token as the Refit and RefitSession drivers read it: '' before it exists or
    when the Secret of that name is not the fleet's own (a squatter's token is never sent to agents;
    the reconcile reports the name conflict)."""
    secret = await api.get("Secret", names.agent_secret(fleet.name), fleet.namespace)
    if secret is None or not ownership.owned(secret, fleet):
        return ""
    return base64.b64decode((secret.get("data") or {}).get(names.AGENT_TOKEN_KEY, "")).decode()


async def reserve(ctx: context.FleetContext) -> None:
    """Services first, then the ConfigMap; ``ctx.status`` gets the endpoints (the caller writes it)."""
    endpoints = await _services(ctx)
    await _configmap(ctx, endpoints)
    ctx.status = status.with_endpoints(ctx.status, ctx.fleet, endpoints, now=conditions.now())


async def _services(ctx: context.FleetContext) -> list[v1alpha1.Endpoint]:
    """The missing Services are created together (one round trip, not one per Service), frontends
    and ranks alike; the ClusterIP ones within the operator-wide bound on Service creates in flight
    (:attr:`.context.Runtime.service_slots`), headless ones beside them; the endpoints are in shard
    order."""
    fleet, api = ctx.fleet, ctx.api
    labelled = await pods.labelled_objects(api, ctx.runtime.cache, "Service", fleet)
    services = {service["metadata"]["name"]: service for service in ownership.only_owned(labelled, fleet)}
    missing = [
        wanted
        for shard in range(fleet.spec.replicas)
        for wanted in desired.shard_services(fleet, shard)
        if wanted["metadata"]["name"] not in services
    ]

    async def create(wanted: dict[str, Any]) -> dict[str, Any]:
        if wanted["spec"].get("clusterIP") == "None":  # headless: no address to allocate, not bounded
            return await ownership.create(api, fleet, wanted)
        async with ctx.runtime.service_slots:
            return await ownership.create(api, fleet, wanted)

    reserved = []
    for created in await asyncio.gather(*(create(wanted) for wanted in missing)):
        services[created["metadata"]["name"]] = created
        if created["metadata"]["name"] == names.frontend_service(fleet.name, _shard(created)):
            reserved.append(f"shard {_shard(created)}: {created['spec']['clusterIP']}")
    if reserved:  # one Event per reconcile, not one per shard
        ctx.notify("Normal", "EndpointsReserved", context.summary(reserved))
    endpoints = []
    for shard in range(fleet.spec.replicas):
        frontend = services[names.frontend_service(fleet.name, shard)]
        endpoints.append(desired.endpoint(fleet, shard, frontend["spec"]["clusterIP"]))
    for name, service in services.items():  # shards removed by scaling down
        if _shard(service) >= fleet.spec.replicas:
            await api.delete("Service", name, fleet.namespace)
    return endpoints


def _shard(service: dict[str, Any]) -> int:
    return int(service["metadata"]["labels"].get(names.LABEL_SHARD, "-1"))


async def _configmap(ctx: context.FleetContext, endpoints: list[v1alpha1.Endpoint]) -> None:
    fleet, api = ctx.fleet, ctx.api
    wanted = desired.endpoints_configmap(fleet, endpoints)
    if fresh(ctx):  # what the create finds (made by an earlier reconcile) is compared below
        current = await ownership.create(api, fleet, wanted)
    else:
        found = await ownership.get(api, fleet, "ConfigMap", names.endpoints_configmap(fleet.name))
        if found is None:
            await ownership.create(api, fleet, wanted)
            return
        current = found
    if current.get("data") != wanted["data"]:
        await api.patch("ConfigMap", wanted["metadata"]["name"], fleet.namespace, {"data": wanted["data"]})
