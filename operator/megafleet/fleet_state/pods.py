"""A typed view of a fleet's pods, parsed once where they are listed, and their agents' reports.

Called by the reconcile steps (:mod:`megafleet.reconcile`) and by the Refit and RefitSession
controllers (:mod:`megafleet.refits`). Control logic reads these fields, never the pod JSON. A
shard's pods are in pod order (pod 0 hosts the frontend); a shard with a terminating pod is only
``terminating``: pod names are stable, so it is placed again only once the old pods are gone.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from megafleet import agent_client, desired, kube, names
from megafleet.fleet_state import ownership
from megafleet.objects import Object

Reports = dict[int, list[agent_client.AgentState | None]]
"""Agent reports by shard, in pod order; ``None`` for a pod that is not running yet."""

HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_FIELD = "metadata.name"


class Index(Protocol):
    """What :func:`observe` reads of the operator's watch-fed cache
    (:class:`megafleet.reconcile.cache.Cache`): the objects carrying a fleet's label, once filled."""

    @property
    def ready(self) -> bool: ...

    def fleet_objects(self, kind: str, namespace: str, fleet: str) -> list[Object]: ...


@dataclasses.dataclass(frozen=True)
class Pod:
    """What the operator reads of one of its pods. Empty strings stand for fields the API server
    has not filled in yet."""

    name: str
    shard: int
    index: int
    """The pod's index in its shard (pod 0 hosts the frontend rank)."""
    phase: str
    ip: str
    node: str
    """The node the scheduler bound the pod to."""
    pinned_node: str | None
    """The node the pod is pinned to (its affinity, or the hostname node selector Kueue injected)."""
    clique: str | None
    """The clique label value the pod's node affinity requires."""
    template_hash: str | None
    deleting: bool
    exit_reason: str | None = None
    """Why its engine last exited on an error: the container's termination message (the engine writes
    it: :mod:`megafleet_engine.termination`), else the kubelet's reason and exit code (``OOMKilled
    (exit code 137)``), else, once the pod ended, the pod's own message (an eviction); cut to
    :data:`REASON_CHARACTERS`. None: it never did."""
    engine_restarts: int = 0
    """How often the kubelet restarted its engine container in place."""

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.ip)

    @property
    def ended(self) -> bool:
        return self.phase in ("Failed", "Succeeded")

    @property
    def placed_on(self) -> str:
        """The bound node, else the pinned one ('' when neither is known)."""
        return self.node or self.pinned_node or ""


def parse(raw: Object, *, clique_label: str) -> Pod:
    """The view of one pod the operator created (it carries the shard label)."""
    metadata, spec, status = raw["metadata"], raw.get("spec") or {}, raw.get("status") or {}
    labels = metadata.get("labels") or {}
    return Pod(
        name=metadata["name"],
        shard=int(labels[names.LABEL_SHARD]),
        index=int(labels.get(names.LABEL_POD_INDEX, "0")),
        phase=status.get("phase") or "",
        ip=status.get("podIP") or "",
        node=spec.get("nodeName") or "",
        pinned_node=pinned_node(raw),
        clique=_required_label(spec, clique_label),
        template_hash=(metadata.get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH),
        deleting=bool(metadata.get("deletionTimestamp")),
        exit_reason=exit_reason(status),
        engine_restarts=sum(int(item.get("restartCount") or 0) for item in status.get("containerStatuses") or []),
    )


REASON_CHARACTERS = 1000
"""The most of an exit reason the operator keeps (a shard's ``lastError``, an Event's message): the
kubelet keeps 4 KiB of a termination message, and anyone who may write a pod's status more."""


def exit_reason(status: Object) -> str | None:
    """Why a pod's engine last exited on an error (see :attr:`Pod.exit_reason`), from its ``status``."""
    for container in status.get("containerStatuses") or []:
        for state in (container.get("state") or {}, container.get("lastState") or {}):
            ended = state.get("terminated") or {}
            code = ended.get("exitCode")
            if ended and code != 0:
                message = str(ended.get("message") or "").strip()
                return (message or f"{ended.get('reason') or 'Error'} (exit code {code})")[:REASON_CHARACTERS]
    if status.get("phase") == "Failed" and status.get("message"):
        return str(status["message"]).strip()[:REASON_CHARACTERS]
    return None


def pinned_node(pod: Object) -> str | None:
    """The node a pod is pinned to by a one-node affinity (the operator's pods are): a
    ``metadata.name`` field term, or the hostname label term pods created before it carry; else by a
    hostname node selector (Kueue's TAS injects it into a pod it admitted: ``gang.placedBy: Kueue``).
    A hostname label is taken for the node's name, as the dev cluster and most clusters have it."""
    selected = (pod.get("spec", {}).get("nodeSelector") or {}).get(HOSTNAME_LABEL)
    affinity = pod.get("spec", {}).get("affinity") or {}
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms", []):
        for key, expression in [(NODE_NAME_FIELD, e) for e in term.get("matchFields", [])] + [
            (HOSTNAME_LABEL, e) for e in term.get("matchExpressions", [])
        ]:
            values = expression.get("values", [])
            if expression.get("key") == key and expression.get("operator") == "In":
                return str(values[0]) if len(values) == 1 else None
    return str(selected) if selected else None


def _required_label(spec: Object, label: str) -> str | None:
    """The value the first required node-selector term asks ``label`` to have."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or [{}]
    expressions = terms[0].get("matchExpressions", [])
    return next((str(e["values"][0]) for e in expressions if e.get("key") == label), None)


@dataclasses.dataclass
class Shards:
    """The fleet's pods by shard index, and the shards whose pods are still terminating."""

    pods: dict[int, list[Pod]]
    terminating: set[int]

    @classmethod
    def of(cls, pods: list[Pod]) -> Shards:
        grouped: dict[int, list[Pod]] = {}
        terminating: set[int] = set()
        for pod in pods:
            if pod.deleting:
                terminating.add(pod.shard)
            else:
                grouped.setdefault(pod.shard, []).append(pod)
        for members in grouped.values():
            members.sort(key=lambda pod: pod.index)
        return cls(grouped, terminating)

    def take(self, shard: int) -> list[Pod]:
        """Forget ``shard``'s pods (the caller deletes them); it counts as terminating from now on."""
        self.terminating.add(shard)
        return self.pods.pop(shard, [])


async def observe(api: kube.Api, fleet: desired.ParsedFleet, cache: Index | None = None) -> Shards:
    """The fleet's pods, from the watch-fed ``cache`` when there is one (else a LIST), each parsed
    once. A pod that carries the fleet's label but is not the fleet's own is ignored: it is never
    given the agent token nor counted as a shard."""
    labelled = await labelled_objects(api, cache, "Pod", fleet)
    clique_label = fleet.spec.placement.clique_label
    return Shards.of([parse(pod, clique_label=clique_label) for pod in ownership.only_owned(labelled, fleet)])


async def labelled_objects(api: kube.Api, cache: Index | None, kind: str, fleet: desired.ParsedFleet) -> list[Object]:
    """The pods or Services carrying the fleet's label: from ``cache`` when it is filled, else a LIST."""
    if cache is not None and cache.ready:
        return cache.fleet_objects(kind, fleet.namespace, fleet.name)
    return await api.list(kind, namespace=fleet.namespace, labels={names.LABEL_FLEET: fleet.name})


async def ask_agents(agents: agent_client.AgentClient, shards: Shards, token: str) -> Reports:
    """Every running pod's agent report, by shard in pod order."""
    reports: Reports = {}
    for shard, pods in shards.pods.items():
        ips = [pod.ip if pod.running else None for pod in pods]
        answers = iter(await agents.states([ip for ip in ips if ip], token))
        reports[shard] = [next(answers) if ip else None for ip in ips]
    return reports


async def whole_running(api: kube.Api, fleet: desired.ParsedFleet, *, held: bool = False) -> dict[int, list[Pod]]:
    """Pods of every shard whose pods all exist and run, by shard, in pod order (the shards a refit
    or a RefitSession can count on): below ``spec.replicas``, unless ``held`` (a RefitSession holds
    the fleet: a scale-down waits, so the shards above it are still members)."""
    shards = await observe(api, fleet)
    return {
        shard: members
        for shard, members in shards.pods.items()
        if all(pod.running for pod in members)
        and len(members) == fleet.layout.pods_per_shard
        and (held or shard < fleet.spec.replicas)
    }
