"""Reconcile one MegatronGeneration: validate, reserve endpoints, place shards whole, create their
pods, observe them and write status (DESIGN.md section 5).

Called by the Kopf handlers (:mod:`megafleet.handlers`) on create, update, resume, a timer and
events of the fleet's pods. Level-based and idempotent: it reads what exists, compares it with what
the spec asks for, and writes only the difference, so a reconcile with nothing to change makes no
API writes. Endpoints are reserved, and written to status and the ConfigMap, before any pod exists.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from lightkube import operators

from megafleet import agent_client, backoff, conditions, desired, kube, names, planner
from megafleet.api import checks, v1alpha1
from megafleet_protocol import agent_api

log = logging.getLogger(__name__)

Object = dict[str, Any]
Notify = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)

MAX_SHARD_RESTARTS = 5
"""Re-placements of one shard before it is left ``Failed`` (bounded restarts)."""
DRAIN_TIMEOUT_SECONDS = 30.0
"""How long a frontend may finish in-flight requests before its shard's pods are deleted."""


_PLACEMENT_LOCK = asyncio.Lock()
"""Serialises inventory-plan-create across the fleets this operator reconciles concurrently."""
_CATCH_UP_BACKOFF = backoff.Backoff()
"""Delays between checkpoint catch-ups of a shard that keep failing, keyed by (namespace, fleet,
shard, version, checkpoint)."""


def _ignore(kind: str, reason: str, message: str) -> None:
    pass


@dataclasses.dataclass
class _Shards:
    """Pods of the fleet grouped by shard index, and the shards whose pods are still terminating
    (a shard is re-placed only once its old pods are gone: pod names are stable)."""

    pods: dict[int, list[Object]]
    terminating: set[int]

    @classmethod
    def of(cls, pods: list[Object]) -> _Shards:
        grouped: dict[int, list[Object]] = {}
        terminating: set[int] = set()
        for pod in pods:
            shard = int(pod["metadata"]["labels"][names.LABEL_SHARD])
            if pod["metadata"].get("deletionTimestamp"):
                terminating.add(shard)
                continue
            grouped.setdefault(shard, []).append(pod)
        for members in grouped.values():
            members.sort(key=lambda pod: int(pod["metadata"]["labels"].get(names.LABEL_POD_INDEX, "0")))
        return cls(grouped, terminating)

    async def remove(self, api: kube.Api, namespace: str, shard: int) -> None:
        """Delete every pod of ``shard`` (whole or nothing); it is placed again once they are gone."""
        for pod in self.pods.pop(shard, []):
            await api.delete("Pod", pod["metadata"]["name"], namespace)
        self.terminating.add(shard)


async def reconcile(api: kube.Api, agents: agent_client.AgentClient, body: Object, *, notify: Notify = _ignore) -> None:
    """Bring the objects and status of one fleet in line with its spec."""
    metadata = body["metadata"]
    status: Object = dict(body.get("status") or {})
    spec, problems = checks.parse_spec(body.get("spec") or {})
    generation = int(metadata.get("generation", 1))
    if spec is None or problems:
        message = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
        await _report_invalid(api, body, status, message, generation, notify)
        return
    fleet = desired.ParsedFleet(metadata["name"], metadata["namespace"], metadata["uid"], generation, spec)
    missing = await _missing_references(api, fleet)
    if missing:
        await _report_invalid(api, body, status, missing, generation, notify)
        return
    token = await _ensure_agent_secret(api, fleet)
    endpoints = await _reserve_endpoints(api, fleet, notify)
    status = _with_endpoints(status, fleet, endpoints)
    await _write_status(api, body, status)  # published before any pod is created
    pods = await api.list("Pod", namespace=fleet.namespace, labels={names.LABEL_FLEET: fleet.name})
    shards = _Shards.of(pods)
    refit_state = status.get("refit") or {}
    refitting = refit_state.get("active") is not None  # scaling and rolling wait for the refit
    if not refitting:
        await _scale_down(api, agents, fleet, shards, token, notify)
    restarts = await _remove_broken_shards(api, fleet, shards, status, notify)
    if not refitting:
        await _roll_one_shard(api, agents, fleet, shards, token, notify)
    exhausted = {shard for shard, (count, _) in restarts.items() if count > MAX_SHARD_RESTARTS}
    # Once a refit moved the fleet past the checkpoint, new pods start without weights (Stale).
    defer = refit_state.get("currentVersion") is not None
    unplaced = {} if refitting else await _place_missing(api, fleet, shards, exhausted, notify, defer_weights=defer)
    reports = await _ask_agents(agents, shards, token)
    await _fence_stale(agents, shards, reports, refit_state, token, notify)
    await _catch_up(agents, fleet, shards, reports, refit_state, token, notify)
    status = _observed(status, fleet, shards, unplaced, restarts, reports)
    status = _verify_addresses(status, fleet, shards, reports, notify)
    await _write_status(api, body, status)


async def _missing_references(api: kube.Api, fleet: desired.ParsedFleet) -> str | None:
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


async def _ensure_agent_secret(api: kube.Api, fleet: desired.ParsedFleet) -> str:
    """The fleet's agent token, created once and never rotated by a reconcile."""
    secret = await api.get("Secret", names.agent_secret(fleet.name), fleet.namespace)
    if secret is None:
        secret = await api.create(desired.agent_secret(fleet, secrets.token_urlsafe(32)))
    return base64.b64decode(secret["data"][names.AGENT_TOKEN_KEY]).decode()


async def _ask_agents(
    agents: agent_client.AgentClient, shards: _Shards, token: str
) -> dict[int, list[agent_client.AgentState | None]]:
    """Agent reports by shard, in pod order; ``None`` for a pod that is not Running yet."""
    reports: dict[int, list[agent_client.AgentState | None]] = {}
    for shard, pods in shards.pods.items():
        ips = [pod.get("status", {}).get("podIP") if _pod_running(pod) else None for pod in pods]
        answers = iter(await agents.states([ip for ip in ips if ip], token))
        reports[shard] = [next(answers) if ip else None for ip in ips]
    return reports


async def _reserve_endpoints(api: kube.Api, fleet: desired.ParsedFleet, notify: Notify) -> list[Any]:
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


def _with_endpoints(status: Object, fleet: desired.ParsedFleet, endpoints: list[Any]) -> Object:
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
        now=conditions.now(),
    )
    updated["conditions"] = conditions.set_condition(
        updated["conditions"],
        conditions.INVALID_SPEC,
        False,
        "Valid",
        "",
        generation=fleet.generation,
        now=conditions.now(),
    )
    return updated


# -- shards ------------------------------------------------------------------------------------


async def _drain(agents: agent_client.AgentClient, pods: list[Object], token: str, timeout_seconds: float) -> None:
    """Close a shard's frontend and let in-flight requests finish (bounded) before its pods go."""
    frontend_ip = pods[0].get("status", {}).get("podIP") if pods else None
    if frontend_ip:
        await agents.suspend(frontend_ip, token, mode="drain", timeout_seconds=timeout_seconds)


async def _scale_down(
    api: kube.Api,
    agents: agent_client.AgentClient,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    token: str,
    notify: Notify,
) -> None:
    for shard in sorted(index for index in shards.pods if index >= fleet.spec.replicas):
        await _drain(agents, shards.pods[shard], token, DRAIN_TIMEOUT_SECONDS)
        await shards.remove(api, fleet.namespace, shard)
        notify("Normal", "ShardRemoved", f"shard {shard} drained and removed by scaling to {fleet.spec.replicas}")


async def _roll_one_shard(
    api: kube.Api,
    agents: agent_client.AgentClient,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    token: str,
    notify: Notify,
) -> None:
    """Template changes roll one shard at a time, and only while every other shard runs."""
    if shards.terminating or any(shard not in shards.pods for shard in range(fleet.spec.replicas)):
        return
    if not all(_pod_running(pod) for pods in shards.pods.values() for pod in pods):
        return
    current = desired.template_hash(fleet)
    for shard in sorted(shards.pods):
        if any(
            pod["metadata"].get("annotations", {}).get(names.ANNOTATION_TEMPLATE_HASH) != current
            for pod in shards.pods[shard]
        ):
            await _drain(agents, shards.pods[shard], token, DRAIN_TIMEOUT_SECONDS)
            await shards.remove(api, fleet.namespace, shard)
            notify("Normal", "ShardRolling", f"shard {shard} is replaced to apply the changed pod template")
            return


def _broken(pods: list[Object], layout: planner.PodLayout) -> str | None:
    if len(pods) != layout.pods_per_shard:
        return f"{layout.pods_per_shard - len(pods)} of {layout.pods_per_shard} pods missing"
    failed = [pod["metadata"]["name"] for pod in pods if pod.get("status", {}).get("phase") in ("Failed", "Succeeded")]
    if failed:
        return f"pods ended: {', '.join(failed)}"
    return None


async def _remove_broken_shards(
    api: kube.Api, fleet: desired.ParsedFleet, shards: _Shards, status: Object, notify: Notify
) -> dict[int, tuple[int, str | None]]:
    """Delete what is left of incomplete shards (whole or nothing); count the restarts."""
    previous = {item["index"]: item for item in status.get("shards", [])}
    restarts: dict[int, tuple[int, str | None]] = {
        index: (int(item.get("restarts", 0)), item.get("lastError")) for index, item in previous.items()
    }
    for shard, item in sorted(previous.items()):
        gone = shard not in shards.pods and shard not in shards.terminating
        if item.get("pods") and gone and shard < fleet.spec.replicas:
            count = restarts.get(shard, (0, None))[0] + 1
            restarts[shard] = (count, f"pods gone: {', '.join(item['pods'])}")
            notify("Warning", "ShardRestarting", f"shard {shard} is re-placed (restart {count}): its pods are gone")
    for shard in sorted(shards.pods):
        reason = _broken(shards.pods[shard], fleet.layout)
        if reason is None:
            continue
        count = restarts.get(shard, (0, None))[0] + 1
        restarts[shard] = (count, reason)
        await shards.remove(api, fleet.namespace, shard)
        notify("Warning", "ShardRestarting", f"shard {shard} is re-placed (restart {count}): {reason}")
    return restarts


async def _inventory(api: kube.Api, fleet: desired.ParsedFleet) -> list[planner.NodeInfo]:
    resource = fleet.spec.resources.gpu_resource
    used: dict[str, int] = {}
    for pod in await api.list("Pod", fields={"status.phase": operators.not_in(["Succeeded", "Failed"])}):
        node = pod.get("spec", {}).get("nodeName") or _pinned_node(pod)
        if node:
            used[node] = used.get(node, 0) + _gpus(pod, resource)
    nodes = []
    for node in await api.list("Node"):
        allocatable = int(str(node.get("status", {}).get("allocatable", {}).get(resource, "0")))
        schedulable = not node.get("spec", {}).get("unschedulable", False) and tolerates(
            fleet.spec.placement.tolerations, node.get("spec", {}).get("taints") or []
        )
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


def _pinned_node(pod: Object) -> str | None:
    """The node a not-yet-bound pod is pinned to by a one-node hostname affinity (ours are), so
    GPUs promised to pods the scheduler has not bound yet are not handed out twice."""
    affinity = pod.get("spec", {}).get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms", []):
        for expression in term.get("matchExpressions", []):
            values = expression.get("values", [])
            if expression.get("key") == "kubernetes.io/hostname" and expression.get("operator") == "In":
                return str(values[0]) if len(values) == 1 else None
    return None


def tolerates(tolerations: list[v1alpha1.Toleration], taints: list[Object]) -> bool:
    """Whether pods with ``tolerations`` may be scheduled onto a node with ``taints``, as the
    scheduler decides it (only NoSchedule and NoExecute taints keep pods away)."""
    for taint in taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_matches(toleration, taint) for toleration in tolerations):
            return False
    return True


def _matches(toleration: v1alpha1.Toleration, taint: Object) -> bool:
    if toleration.effect is not None and toleration.effect != taint.get("effect"):
        return False
    if toleration.key is None:
        return toleration.operator == "Exists"
    if toleration.key != taint.get("key"):
        return False
    return toleration.operator == "Exists" or toleration.value == taint.get("value")


def _gpus(pod: Object, resource: str) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        requests = container.get("resources", {}).get("requests", {}) or {}
        total += int(str(requests.get(resource, "0")))
    return total


async def _place_missing(
    api: kube.Api,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    exhausted: set[int],
    notify: Notify,
    *,
    defer_weights: bool = False,
) -> dict[int, str]:
    skip = shards.terminating | exhausted
    missing = [shard for shard in range(fleet.spec.replicas) if shard not in shards.pods and shard not in skip]
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
    async with _PLACEMENT_LOCK:  # fleets place one at a time, each seeing what the others took
        plan = planner.plan_placement(request, await _inventory(api, fleet))
        for shard, placement in sorted(plan.placed.items()):
            created = [
                await api.create(pod)
                for pod in desired.shard_pods(fleet, shard, placement, defer_weights=defer_weights)
            ]
            shards.pods[shard] = created
            where = f"clique {placement.clique}" if placement.clique else "nodes"
            nodes = ", ".join(p.node for p in placement.pods)
            notify("Normal", "ShardPlaced", f"shard {shard} placed on {where}: {nodes}")
    for _shard, reason in sorted(plan.unplaced.items()):
        notify("Warning", "Unschedulable", reason)
    return dict(plan.unplaced)


def _existing_placement(pods: list[Object], clique_label: str) -> planner.ShardPlacement:
    """Where a running shard sits: each pod's node (bound, else pinned) and the shard's clique."""
    affinity = pods[0]["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [{}])
    clique = next((e["values"][0] for e in terms[0].get("matchExpressions", []) if e.get("key") == clique_label), None)
    nodes = [pod["spec"].get("nodeName") or _pinned_node(pod) or "" for pod in pods]
    return planner.ShardPlacement(clique=clique, pods=tuple(planner.PodPlacement(node=n, gpus=0) for n in nodes))


# -- status ------------------------------------------------------------------------------------


async def _fence_stale(
    agents: agent_client.AgentClient,
    shards: _Shards,
    reports: dict[int, list[agent_client.AgentState | None]],
    refit_state: Object,
    token: str,
    notify: Notify,
) -> None:
    """A shard serving another version than the fleet's current one (restarted, or added by scaling
    after a refit) stops serving until a refit brings it up to date: never a mix of versions."""
    current = refit_state.get("currentVersion")
    if current is None or refit_state.get("active") is not None:
        return
    for shard, answers in reports.items():
        serving = [a for a in answers if a is not None and a.state == "ready" and a.weight_version != current]
        for pod, answer in zip(shards.pods[shard], answers, strict=True):
            if answer in serving:
                await agents.suspend(pod["status"]["podIP"], token, mode="abort", timeout_seconds=10)
        if serving:
            notify(
                "Warning",
                "ShardStale",
                f"shard {shard} serves version {serving[0].weight_version}, "
                f"the fleet is at {current}: fenced until the next refit",
            )


async def _catch_up(
    agents: agent_client.AgentClient,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    reports: dict[int, list[agent_client.AgentState | None]],
    refit_state: Object,
    token: str,
    notify: Notify,
    *,
    delays: backoff.Backoff = _CATCH_UP_BACKOFF,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """A shard behind the fleet's current version (restarted or added after a refit, or left Stale by
    a failed attempt) loads it from the checkpoint the last successful Refit came from, when it came
    from one; otherwise it stays Stale, not routed, until the next refit includes it. A catch-up
    that failed is tried again after growing delays (``delays``: 10 s, 20 s, ... 5 min), each
    failure reported once as a ``CatchUpFailed`` Warning."""
    current, path = refit_state.get("currentVersion"), refit_state.get("currentCheckpoint")
    fleet_key = (fleet.namespace, fleet.name)
    delays.forget(lambda key: not isinstance(key, tuple) or key[:2] != fleet_key or key[3:] == (current, path))
    if current is None or path is None or refit_state.get("active") is not None:
        return
    body = agent_api.CheckpointRefitRequest(
        version=current,
        path=path,
        timeout_seconds=fleet.spec.refit.timeout_seconds,
        kv_cache_mode=fleet.spec.engine.kv_cache_mode,
    )
    for shard, answers in sorted(reports.items()):
        if any(a is None or a.error is not None or a.state == "failed" for a in answers):
            continue  # not every pod of the shard can take it yet
        if all(a is not None and a.weight_version == current and a.state != "stale" for a in answers):
            continue
        ips = [pod["status"]["podIP"] for pod in shards.pods[shard]]
        progress = [await agents.refit_status(ip, token) for ip in ips]
        if all(p is not None and p.version == current and p.phase not in _SETTLED for p in progress):
            continue  # already catching up
        failed = [p for p in progress if p is not None and p.version == current and p.phase == "failed"]
        left, failures = delays.wait((*fleet_key, shard, current, path), failed=bool(failed), now=clock())
        if failures is not None:
            notify(
                "Warning",
                "CatchUpFailed",
                f"shard {shard} could not load version {current} from {path} ({failures} in a row: "
                f"{failed[0].error}); next try in {left:.0f} s",
            )
        if left > 0:
            continue
        refused = [error for ip in ips if (error := await agents.refit_start(ip, token, body))]
        if refused:
            notify("Warning", "CatchUpRefused", f"shard {shard} cannot load version {current}: {refused[0]}")
        else:
            notify("Normal", "ShardCatchingUp", f"shard {shard} loads version {current} from {path}")


_SETTLED = ("idle", "succeeded", "failed")
"""Refit phases an agent reports when no attempt runs."""


def _pod_running(pod: Object) -> bool:
    status = pod.get("status", {})
    return status.get("phase") == "Running" and bool(status.get("podIP"))


_AGENT_PHASES = {"loading": "Loading", "stale": "Stale", "suspended": "Refitting", "failed": "Failed"}


def _phase_from_agents(
    reports: list[agent_client.AgentState | None], current_version: int | None = None
) -> tuple[str, str | None, int | None]:
    """(shard phase, error, weight version) from the agents of one shard's pods."""
    phase, error, version = _raw_phase(reports)
    if current_version is not None and phase in ("Ready", "Refitting") and version != current_version:
        return "Stale", f"serves version {version}, the fleet is at {current_version}", version
    if current_version is not None and phase == "Loading":  # started after a refit, without weights
        return "Stale", f"has no weights yet, the fleet is at version {current_version}", version
    return phase, error, version


def _raw_phase(reports: list[agent_client.AgentState | None]) -> tuple[str, str | None, int | None]:
    if any(report is None for report in reports):
        return "Starting", None, None
    answered = [report for report in reports if report is not None]
    for report in answered:
        if report.error is not None:
            return "Starting", report.error, None
    for state, phase in _AGENT_PHASES.items():
        failing = [report for report in answered if report.state == state]
        if failing:
            return phase, failing[0].last_error, failing[0].weight_version
    return "Ready", None, answered[0].weight_version if answered else None


def _shard_status(
    fleet: desired.ParsedFleet,
    shard: int,
    pods: list[Object] | None,
    unplaced: str | None,
    restarts: tuple[int, str | None],
    reports: list[agent_client.AgentState | None],
    terminating: bool,
    current_version: int | None,
) -> Object:
    count, last_error = restarts
    entry: Object = {"index": shard, "restarts": count}
    if pods:
        entry["pods"] = [pod["metadata"]["name"] for pod in pods]
        entry["nodes"] = [pod["spec"].get("nodeName") or "" for pod in pods]
        clique = _existing_placement(pods, fleet.spec.placement.clique_label).clique
        if clique is not None:
            entry["clique"] = clique
        phase, agent_error, version = _phase_from_agents(reports, current_version)
        entry["phase"] = phase
        # A shard that serves again has recovered: only its restart count remembers the failure.
        last_error = None if phase == "Ready" else agent_error or last_error
        if version is not None:
            entry["weightVersion"] = version
    elif count > MAX_SHARD_RESTARTS:
        entry["phase"] = "Failed"
        last_error = f"gave up after {count - 1} restarts; last: {last_error}"
    elif terminating:
        entry["phase"] = "Draining"
    else:
        entry["phase"] = "Pending"
    error = unplaced or last_error
    if error:
        entry["lastError"] = error
    return entry


def _observed(
    status: Object,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    unplaced: dict[int, str],
    restarts: dict[int, tuple[int, str | None]],
    reports: dict[int, list[agent_client.AgentState | None]],
) -> Object:
    replicas = fleet.spec.replicas
    entries = [
        _shard_status(
            fleet,
            shard,
            shards.pods.get(shard),
            unplaced.get(shard),
            restarts.get(shard, (0, None)),
            reports.get(shard, []),
            shard in shards.terminating,
            None if (status.get("refit") or {}).get("active") else (status.get("refit") or {}).get("currentVersion"),
        )
        for shard in range(replicas)
    ]
    versions = {entry.get("weightVersion") for entry in entries if entry["phase"] == "Ready"}
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
    if len(versions) == 1 and None not in versions:
        updated["weightVersion"] = versions.pop()
    else:
        updated.pop("weightVersion", None)
    now = conditions.now()
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
    updated["conditions"] = _weights_current(found, entries, status.get("refit") or {}, fleet.generation, now)
    return updated


def _weights_current(
    found: list[conditions.Condition], entries: list[Object], refit_state: Object, generation: int, now: str
) -> list[conditions.Condition]:
    """WeightsCurrent: every shard serves the fleet's current version (the last successful Refit's,
    else the one every shard started with) and no refit is running."""
    versions = {entry.get("weightVersion") for entry in entries}
    target = refit_state.get("currentVersion")
    if refit_state.get("active"):
        return conditions.set_condition(
            found,
            conditions.WEIGHTS_CURRENT,
            False,
            "Refitting",
            f"refit {refit_state['active']} is running",
            generation=generation,
            now=now,
        )
    current = (
        bool(entries) and None not in versions and (versions == {target} if target is not None else len(versions) == 1)
    )
    stale = sorted(entry["index"] for entry in entries if target is not None and entry.get("weightVersion") != target)
    message = (
        f"every shard serves version {versions.pop()}"
        if current
        else f"shards {stale} are not at version {target}"
        if stale
        else "not every shard has weights yet"
    )
    return conditions.set_condition(
        found,
        conditions.WEIGHTS_CURRENT,
        current,
        "Current" if current else "Behind",
        message,
        generation=generation,
        now=now,
    )


def _verify_addresses(
    status: Object,
    fleet: desired.ParsedFleet,
    shards: _Shards,
    reports: dict[int, list[agent_client.AgentState | None]],
    notify: Notify,
) -> Object:
    """EndpointsVerified: each frontend serves where its reserved Service sends traffic (pod 0's IP
    on the Service's target port). EndpointSlices cannot prove it here: they reject loopback IPs."""
    reserved, served = [], []
    for shard in sorted(shards.pods):
        frontend = (reports.get(shard) or [None])[0]
        if frontend is None or frontend.served_address is None:
            continue
        pod_ip = shards.pods[shard][0]["status"]["podIP"]
        reserved.append(f"shard {shard}: {pod_ip}:{fleet.spec.frontend.port}")
        served.append(f"shard {shard}: {frontend.served_address}")
    now = conditions.now()
    found = list(status.get("conditions", []))
    previous = (conditions.find(found, conditions.ENDPOINTS_VERIFIED) or {}).get("status")
    if not served:
        found = conditions.set_condition(
            found,
            conditions.ENDPOINTS_VERIFIED,
            False,
            "NoFrontendServing",
            "no frontend reports an address yet",
            generation=fleet.generation,
            now=now,
        )
    elif reserved == served:
        found = conditions.set_condition(
            found,
            conditions.ENDPOINTS_VERIFIED,
            True,
            "Verified",
            f"{len(served)} frontends serve where their endpoints point",
            generation=fleet.generation,
            now=now,
        )
    else:
        message = f"reserved: {', '.join(reserved)}; served: {', '.join(served)}"
        found = conditions.set_condition(
            found, conditions.ENDPOINTS_VERIFIED, False, "Mismatch", message, generation=fleet.generation, now=now
        )
        if (
            previous != "False"
            or (conditions.find(status.get("conditions", []), conditions.ENDPOINTS_VERIFIED) or {}).get("reason")
            != "Mismatch"
        ):
            notify("Warning", "EndpointsMismatch", message)
    return {**status, "conditions": found}


async def _report_invalid(
    api: kube.Api, body: Object, status: Object, message: str, generation: int, notify: Notify
) -> None:
    """InvalidSpec=True with every problem; the Warning Event only when it turns invalid."""
    was_invalid = (conditions.find(status.get("conditions", []), conditions.INVALID_SPEC) or {}).get("status")
    await _write_status(api, body, _invalid(status, message, generation))
    if was_invalid != "True":
        notify("Warning", "InvalidSpec", message)


def _invalid(status: Object, message: str, generation: int) -> Object:
    updated = dict(status)
    now = conditions.now()
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
