"""Reconcile one MegatronGeneration: validate, reserve endpoints, place shards whole, create their
pods, observe them and write status (DESIGN.md section 5).

Called by the Kopf handlers (:mod:`megafleet.handlers`) on create, update, resume, a timer and
events of the fleet's pods. Level-based and idempotent: it reads what exists, compares it with what
the spec asks for, and writes only the difference, so a reconcile with nothing to change makes no
API writes. Endpoints are reserved, and written to status and the ConfigMap, before any pod exists.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from lightkube import operators

from megafleet import conditions, desired, kube, names, planner
from megafleet.api import checks

log = logging.getLogger(__name__)

Object = dict[str, Any]
Notify = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)

MAX_SHARD_RESTARTS = 5
"""Re-placements of one shard before it is left ``Failed`` (bounded restarts)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ignore(kind: str, reason: str, message: str) -> None:
    pass


@dataclasses.dataclass
class _Shards:
    """Pods of the fleet grouped by shard index."""

    pods: dict[int, list[Object]]

    @classmethod
    def of(cls, pods: list[Object]) -> _Shards:
        grouped: dict[int, list[Object]] = {}
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            shard = int(pod["metadata"]["labels"][names.LABEL_SHARD])
            grouped.setdefault(shard, []).append(pod)
        for members in grouped.values():
            members.sort(key=lambda pod: int(pod["metadata"]["labels"].get(names.LABEL_POD_INDEX, "0")))
        return cls(grouped)


async def reconcile(api: kube.Api, body: Object, *, notify: Notify = _ignore) -> None:
    """Bring the objects and status of one fleet in line with its spec."""
    metadata = body["metadata"]
    status: Object = dict(body.get("status") or {})
    spec, problems = checks.parse_spec(body.get("spec") or {})
    generation = int(metadata.get("generation", 1))
    if spec is None or problems:
        message = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
        was_invalid = (conditions.find(status.get("conditions", []), conditions.INVALID_SPEC) or {}).get("status")
        await _write_status(api, body, _invalid(status, message, generation))
        if was_invalid != "True":
            notify("Warning", "InvalidSpec", message)
        return
    fleet = desired.Fleet(metadata["name"], metadata["namespace"], metadata["uid"], generation, spec)
    missing = await _missing_references(api, fleet)
    if missing:
        was_invalid = (conditions.find(status.get("conditions", []), conditions.INVALID_SPEC) or {}).get("status")
        await _write_status(api, body, _invalid(status, missing, generation))
        if was_invalid != "True":
            notify("Warning", "InvalidSpec", missing)
        return
    await _ensure_agent_secret(api, fleet)
    endpoints = await _reserve_endpoints(api, fleet, notify)
    status = _with_endpoints(status, fleet, endpoints)
    await _write_status(api, body, status)  # published before any pod is created
    pods = await api.list("Pod", namespace=fleet.namespace, labels={names.LABEL_FLEET: fleet.name})
    shards = _Shards.of(pods)
    await _scale_down(api, fleet, shards, notify)
    restarts = await _remove_broken_shards(api, fleet, shards, status, notify)
    unplaced = await _place_missing(api, fleet, shards, notify)
    status = _observed(status, fleet, shards, unplaced, restarts)
    await _write_status(api, body, status)


async def _missing_references(api: kube.Api, fleet: desired.Fleet) -> str | None:
    """What the schema cannot check: objects the spec names must exist."""
    ref = fleet.spec.frontend.api_key_secret
    if ref is None:
        return None
    secret = await api.get("Secret", ref.name, fleet.namespace)
    if secret is None:
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} does not exist in namespace {fleet.namespace}"
    if ref.key not in (secret.get("data") or {}):
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} has no key {ref.key!r}"
    return None


# -- endpoints ---------------------------------------------------------------------------------


async def _ensure_agent_secret(api: kube.Api, fleet: desired.Fleet) -> None:
    if await api.get("Secret", names.agent_secret(fleet.name), fleet.namespace) is None:
        await api.create(desired.agent_secret(fleet, secrets.token_urlsafe(32)))


async def _reserve_endpoints(api: kube.Api, fleet: desired.Fleet, notify: Notify) -> list[Any]:
    services = {
        service["metadata"]["name"]: service
        for service in await api.list("Service", namespace=fleet.namespace, labels={names.LABEL_FLEET: fleet.name})
    }
    endpoints = []
    for shard in range(fleet.spec.replicas):
        frontend = services.get(names.frontend_service(fleet.name, shard))
        if frontend is None:
            frontend = await api.create(desired.frontend_service(fleet, shard))
            notify("Normal", "EndpointReserved", f"shard {shard}: {frontend['spec']['clusterIP']}")
        if names.ranks_service(fleet.name, shard) not in services:
            await api.create(desired.ranks_service(fleet, shard))
        endpoints.append(desired.endpoint(fleet, shard, frontend["spec"]["clusterIP"]))
    for name, service in services.items():  # shards removed by scaling down
        shard = int(service["metadata"]["labels"].get(names.LABEL_SHARD, "-1"))
        if shard >= fleet.spec.replicas:
            await api.delete("Service", name, fleet.namespace)
    wanted = desired.endpoints_configmap(fleet, endpoints)
    current = await api.get("ConfigMap", names.endpoints_configmap(fleet.name), fleet.namespace)
    if current is None:
        await api.create(wanted)
    elif current.get("data") != wanted["data"]:
        await api.patch("ConfigMap", wanted["metadata"]["name"], fleet.namespace, {"data": wanted["data"]})
    return endpoints


def _with_endpoints(status: Object, fleet: desired.Fleet, endpoints: list[Any]) -> Object:
    updated = dict(status)
    updated["endpoints"] = [endpoint.model_dump(mode="json", by_alias=True) for endpoint in endpoints]
    updated["selector"] = fleet.selector
    updated["conditions"] = conditions.set_condition(
        list(status.get("conditions", [])),
        conditions.ENDPOINTS_RESERVED,
        True,
        "ServicesCreated",
        f"{len(endpoints)} frontend endpoints reserved",
        generation=fleet.generation,
        now=_now(),
    )
    updated["conditions"] = conditions.set_condition(
        updated["conditions"], conditions.INVALID_SPEC, False, "Valid", "", generation=fleet.generation, now=_now()
    )
    return updated


# -- shards ------------------------------------------------------------------------------------


async def _scale_down(api: kube.Api, fleet: desired.Fleet, shards: _Shards, notify: Notify) -> None:
    for shard in sorted(index for index in shards.pods if index >= fleet.spec.replicas):
        for pod in shards.pods.pop(shard):
            await api.delete("Pod", pod["metadata"]["name"], fleet.namespace)
        notify("Normal", "ShardRemoved", f"shard {shard} removed by scaling to {fleet.spec.replicas}")


def _broken(pods: list[Object], layout: planner.PodLayout) -> str | None:
    if len(pods) != layout.pods_per_shard:
        return f"{layout.pods_per_shard - len(pods)} of {layout.pods_per_shard} pods missing"
    failed = [pod["metadata"]["name"] for pod in pods if pod.get("status", {}).get("phase") in ("Failed", "Succeeded")]
    if failed:
        return f"pods ended: {', '.join(failed)}"
    return None


async def _remove_broken_shards(
    api: kube.Api, fleet: desired.Fleet, shards: _Shards, status: Object, notify: Notify
) -> dict[int, tuple[int, str | None]]:
    """Delete what is left of incomplete shards (whole or nothing); count the restarts."""
    previous = {item["index"]: item for item in status.get("shards", [])}
    restarts: dict[int, tuple[int, str | None]] = {
        index: (int(item.get("restarts", 0)), item.get("lastError")) for index, item in previous.items()
    }
    for shard in sorted(shards.pods):
        reason = _broken(shards.pods[shard], fleet.layout)
        if reason is None:
            continue
        count = restarts.get(shard, (0, None))[0] + 1
        restarts[shard] = (count, reason)
        for pod in shards.pods.pop(shard):
            await api.delete("Pod", pod["metadata"]["name"], fleet.namespace)
        notify("Warning", "ShardRestarting", f"shard {shard} is re-placed (restart {count}): {reason}")
    return restarts


async def _inventory(api: kube.Api, fleet: desired.Fleet) -> list[planner.NodeInfo]:
    resource = fleet.spec.resources.gpu_resource
    used: dict[str, int] = {}
    for pod in await api.list("Pod", fields={"status.phase": operators.not_in(["Succeeded", "Failed"])}):
        node = pod.get("spec", {}).get("nodeName")
        if node:
            used[node] = used.get(node, 0) + _gpus(pod, resource)
    nodes = []
    for node in await api.list("Node"):
        allocatable = int(str(node.get("status", {}).get("allocatable", {}).get(resource, "0")))
        schedulable = not node.get("spec", {}).get("unschedulable", False)
        nodes.append(
            planner.NodeInfo(
                name=node["metadata"]["name"],
                labels=node["metadata"].get("labels", {}),
                allocatable_gpus=allocatable,
                allocated_gpus=used.get(node["metadata"]["name"], 0),
                schedulable=schedulable,
            )
        )
    return nodes


def _gpus(pod: Object, resource: str) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        requests = container.get("resources", {}).get("requests", {}) or {}
        total += int(str(requests.get(resource, "0")))
    return total


async def _place_missing(api: kube.Api, fleet: desired.Fleet, shards: _Shards, notify: Notify) -> dict[int, str]:
    missing = [shard for shard in range(fleet.spec.replicas) if shard not in shards.pods]
    if not missing:
        return {}
    spec = fleet.spec
    parallelism = checks.parallelism(spec.parallelism)
    request = planner.PlacementRequest(
        fleet=fleet.name,
        shard_indices=missing,
        layout=fleet.layout,
        nvlink_span=parallelism.nvlink_span,
        gpus_per_node=spec.resources.gpus_per_node,
        clique_label=spec.placement.clique_label,
        require_clique=spec.placement.nvlink == "Required",
        spread_shards=spec.placement.spread_shards,
        node_selector=dict(spec.placement.node_selector),
        existing={shard: _existing_placement(pods, spec.placement.clique_label) for shard, pods in shards.pods.items()},
    )
    plan = planner.plan_placement(request, await _inventory(api, fleet))
    for shard, placement in sorted(plan.placed.items()):
        created = [await api.create(pod) for pod in desired.shard_pods(fleet, shard, placement)]
        shards.pods[shard] = created
        where = f"clique {placement.clique}" if placement.clique else "nodes"
        notify("Normal", "ShardPlaced", f"shard {shard} placed on {where}: {', '.join(p.node for p in placement.pods)}")
    for _shard, reason in sorted(plan.unplaced.items()):
        notify("Warning", "Unschedulable", reason)
    return dict(plan.unplaced)


def _existing_placement(pods: list[Object], clique_label: str) -> planner.ShardPlacement:
    affinity = pods[0]["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [{}])
    clique = next((e["values"][0] for e in terms[0].get("matchExpressions", []) if e.get("key") == clique_label), None)
    node_values: list[str] = next(
        (e["values"] for e in terms[0].get("matchExpressions", []) if e.get("key") == "kubernetes.io/hostname"), []
    )
    return planner.ShardPlacement(
        clique=clique,
        pods=tuple(planner.PodPlacement(node=node, gpus=0) for node in node_values),
    )


# -- status ------------------------------------------------------------------------------------


def _pod_ready(pod: Object) -> bool:
    status = pod.get("status", {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])
    return status.get("phase") == "Running" and bool(status.get("podIP")) and ready


def _shard_status(
    fleet: desired.Fleet, shard: int, pods: list[Object] | None, unplaced: str | None, restarts: tuple[int, str | None]
) -> Object:
    count, last_error = restarts
    entry: Object = {"index": shard, "restarts": count}
    if pods:
        entry["pods"] = [pod["metadata"]["name"] for pod in pods]
        entry["nodes"] = [pod["spec"].get("nodeName") or "" for pod in pods]
        clique = _existing_placement(pods, fleet.spec.placement.clique_label).clique
        if clique is not None:
            entry["clique"] = clique
        entry["phase"] = "Ready" if all(_pod_ready(pod) for pod in pods) else "Starting"
    elif count > MAX_SHARD_RESTARTS:
        entry["phase"] = "Failed"
    else:
        entry["phase"] = "Pending"
    error = unplaced or last_error
    if error:
        entry["lastError"] = error
    return entry


def _observed(
    status: Object,
    fleet: desired.Fleet,
    shards: _Shards,
    unplaced: dict[int, str],
    restarts: dict[int, tuple[int, str | None]],
) -> Object:
    replicas = fleet.spec.replicas
    entries = [
        _shard_status(fleet, shard, shards.pods.get(shard), unplaced.get(shard), restarts.get(shard, (0, None)))
        for shard in range(replicas)
    ]
    ready = sum(1 for entry in entries if entry["phase"] == "Ready")
    updated = dict(status)
    updated.update(
        {
            "observedGeneration": fleet.generation,
            "replicas": sum(1 for entry in entries if entry.get("pods")),
            "readyReplicas": ready,
            "shards": entries,
        }
    )
    now = _now()
    found = list(updated.get("conditions", []))
    if unplaced:
        found = conditions.set_condition(
            found,
            conditions.PLACED,
            False,
            "Unschedulable",
            "; ".join(unplaced[s] for s in sorted(unplaced)),
            generation=fleet.generation,
            now=now,
        )
    else:
        found = conditions.set_condition(
            found,
            conditions.PLACED,
            True,
            "AllShardsPlaced",
            f"{replicas} shards placed",
            generation=fleet.generation,
            now=now,
        )
    found = conditions.set_condition(
        found,
        conditions.READY,
        ready == replicas,
        "AllShardsReady" if ready == replicas else "ShardsNotReady",
        f"{ready} of {replicas} shards ready",
        generation=fleet.generation,
        now=now,
    )
    degraded = 0 < ready < replicas
    found = conditions.set_condition(
        found,
        conditions.DEGRADED,
        degraded,
        "ShardsUnavailable" if degraded else "AsDesired",
        f"{replicas - ready} of {replicas} shards not ready" if degraded else "",
        generation=fleet.generation,
        now=now,
    )
    updated["conditions"] = found
    return updated


def _invalid(status: Object, message: str, generation: int) -> Object:
    updated = dict(status)
    now = _now()
    found = conditions.set_condition(
        list(status.get("conditions", [])),
        conditions.INVALID_SPEC,
        True,
        "InvalidSpec",
        message,
        generation=generation,
        now=now,
    )
    found = conditions.set_condition(
        found, conditions.READY, False, "InvalidSpec", message, generation=generation, now=now
    )
    updated["conditions"] = found
    updated["observedGeneration"] = generation
    return updated


def _comparable(status: Object) -> str:
    return json.dumps(status, sort_keys=True, default=str)


async def _write_status(api: kube.Api, body: Object, status: Object) -> None:
    current = body.get("status") or {}
    if _comparable(current) == _comparable({**current, **status}):
        return
    metadata = body["metadata"]
    await api.patch_status("MegatronGeneration", metadata["name"], metadata["namespace"], status)
    body["status"] = {**current, **status}
