"""Endpoints are reserved before any pod exists: the agent token, the fleet's Services, the
endpoints ConfigMap and ``status.endpoints``.

Called by :func:`megafleet.reconcile.reconcile`. A shard's published endpoint is its port on one of
the fleet's frontends Services (:func:`megafleet.desired.frontends_services`: one ClusterIP per 100
shards), fixed for the shard's life; a fleet made by an older operator keeps one Service per shard
(:func:`megafleet.desired.legacy_frontends`). A fleet of multi-pod shards also gets one headless
ranks Service (a shard's own, made by an older operator, is kept while its shard lives, as its
pods' rendezvous address may name it). Ports and Services no longer needed go. Only
objects the fleet owns are read, published or deleted (:mod:`megafleet.fleet_state.ownership`).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any

from megafleet import conditions, desired, names
from megafleet.api import v1alpha1
from megafleet.fleet_state import ownership, pods
from megafleet.reconcile import context, status


def fresh(ctx: context.FleetContext) -> bool:
    """No endpoints were ever published for the fleet: its Secret and ConfigMap most likely do not
    exist yet, so they are created without a GET first (a create that finds one returns it, and
    :func:`megafleet.fleet_state.ownership.create` checks whose it is): two round trips fewer before
    the first pod."""
    return not ctx.status.get("endpoints")


async def agent_token(ctx: context.FleetContext) -> str:
    """The fleet's agent token, created once and never rotated by a reconcile. A Secret of that name
    the fleet does not own is a :class:`~megafleet.fleet_state.ownership.NameConflict`, never read.
    The Refit and RefitSession controllers read it with :func:`megafleet.fleet_state.token.read`."""
    fleet = ctx.fleet
    name = names.agent_secret(fleet.name)
    recent = ctx.runtime.recent
    secret = None if fresh(ctx) else await ownership.get(ctx.api, fleet, "Secret", name, recent)
    if secret is None:
        new_secret = desired.agent_secret(fleet, secrets.token_urlsafe(32))
        secret = await ownership.create(ctx.api, fleet, new_secret, recent)
    encoded = (secret.get("data") or {}).get(names.AGENT_TOKEN_KEY)
    if not encoded:  # the fleet's Secret, emptied by hand: a new token (agents read it at every call)
        encoded = desired.agent_secret(fleet, secrets.token_urlsafe(32))["data"][names.AGENT_TOKEN_KEY]
        patched = await ctx.api.patch("Secret", name, fleet.namespace, {"data": {names.AGENT_TOKEN_KEY: encoded}})
        recent.put("Secret", patched)
    return base64.b64decode(encoded).decode()


async def reserve(ctx: context.FleetContext) -> None:
    """Services first, then the ConfigMap; ``ctx.status`` gets the endpoints (the caller writes it)."""
    endpoints = await _services(ctx)
    await _configmap(ctx, endpoints)
    ctx.status = status.with_endpoints(ctx.status, ctx.fleet, endpoints, now=conditions.now())


async def _services(ctx: context.FleetContext) -> list[v1alpha1.Endpoint]:
    """The missing Services are created together (one round trip, not one per Service), frontends
    and ranks alike; the ClusterIP ones within the operator-wide bound on Service creates in flight
    (:attr:`.context.Runtime.service_slots`), headless ones beside them. A frontends Service whose
    ports are not the shards' (scaled up or down) gets them. The endpoints are in shard order."""
    fleet, api = ctx.fleet, ctx.api
    labelled = await pods.labelled_objects(api, ctx.runtime.cache, "Service", fleet)
    services = {service["metadata"]["name"]: service for service in ownership.only_owned(labelled, fleet)}
    legacy = desired.legacy_frontends(list(services.values()))
    wanted = desired.services(fleet, legacy=legacy)
    missing = [service for service in wanted if service["metadata"]["name"] not in services]
    reshaped = [
        service
        for service in wanted
        if service["metadata"]["name"] in services and _ports(services[service["metadata"]["name"]]) != _ports(service)
    ]

    async def create(service: dict[str, Any]) -> dict[str, Any]:
        if service["spec"].get("clusterIP") == "None":  # headless: no address to allocate, not bounded
            return await ownership.create(api, fleet, service)
        async with ctx.runtime.service_slots:
            return await ownership.create(api, fleet, service)

    async def reshape(service: dict[str, Any]) -> dict[str, Any]:
        name = service["metadata"]["name"]
        return await api.patch("Service", name, fleet.namespace, {"spec": {"ports": service["spec"]["ports"]}})

    made = await asyncio.gather(*(create(service) for service in missing), *(reshape(service) for service in reshaped))
    services.update({service["metadata"]["name"]: service for service in made})
    endpoints = [
        desired.endpoint(fleet, shard, services[_frontend(fleet, shard, legacy)])
        for shard in range(fleet.spec.replicas)
    ]
    published = {endpoint.get("url") for endpoint in ctx.status.get("endpoints") or []}
    reserved = [f"shard {e.shard}: {e.url}" for e in endpoints if e.url not in published]
    if reserved:  # one Event per reconcile, not one per shard: new Services and new shards' ports
        ctx.notify("Normal", "EndpointsReserved", context.summary(reserved))
    names_wanted = {service["metadata"]["name"] for service in wanted}
    for name, service in services.items():  # shards, frontends groups and ranks no longer needed
        if _gone(service, fleet, names_wanted):
            await api.delete("Service", name, fleet.namespace)
    return endpoints


def _frontend(fleet: desired.ParsedFleet, shard: int, legacy: bool) -> str:
    if legacy:
        return names.frontend_service(fleet.name, shard)
    return names.frontends_service(fleet.name, desired.frontends_group(shard))


def _ports(service: dict[str, Any]) -> list[tuple[str | None, int]]:
    return sorted((port.get("name"), port["port"]) for port in service["spec"].get("ports") or [])


def _gone(service: dict[str, Any], fleet: desired.ParsedFleet, wanted: set[str]) -> bool:
    """A Service the fleet no longer needs: a frontends group or ranks Service not wanted, or a
    shard's own Service (an older operator's) of a shard past ``replicas``."""
    if service["metadata"]["name"] in wanted:
        return False
    shard = (service["metadata"].get("labels") or {}).get(names.LABEL_SHARD)
    return shard is None or int(shard) >= fleet.spec.replicas


async def _configmap(ctx: context.FleetContext, endpoints: list[v1alpha1.Endpoint]) -> None:
    fleet, api = ctx.fleet, ctx.api
    wanted, recent = desired.endpoints_configmap(fleet, endpoints), ctx.runtime.recent
    if fresh(ctx):  # what the create finds (made by an earlier reconcile) is compared below
        current = await ownership.create(api, fleet, wanted, recent)
    else:
        found = await ownership.get(api, fleet, "ConfigMap", names.endpoints_configmap(fleet.name), recent)
        if found is None:
            await ownership.create(api, fleet, wanted, recent)
            return
        current = found
    if current.get("data") != wanted["data"]:
        name = wanted["metadata"]["name"]
        patched = await api.patch("ConfigMap", name, fleet.namespace, {"data": wanted["data"]})
        recent.put("ConfigMap", patched)
