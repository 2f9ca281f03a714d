"""Kueue's pod-group vocabulary: what makes one shard's pods one gang that Kueue admits whole, and
what the operator reads back (a shard waiting for quota, a shard Kueue preempted).

Pure functions over pod and Workload JSON; called by :mod:`megafleet.reconcile.shards` (pods of a
shard joined into a group as they are created) and :mod:`megafleet.reconcile.admission` (what Kueue
decided). docs/kueue.md says why a pod group (and not a Workload the operator writes itself) and
which of the operator's placement and Kueue's admission decides what.

A shard's pods carry the LocalQueue's name (``kueue.x-k8s.io/queue-name``), one group name and the
group's size (``pod-group-name`` / ``pod-group-total-count``): Kueue's pod webhook gates each pod
(``kueue.x-k8s.io/admission``) and Kueue makes one Workload for the group, named after it, which it
admits only when the quota holds every pod; then it ungates them all. The group is marked
``pod-group-serving`` (as Kueue's own LeaderWorkerSet integration marks its groups): its pods
serve until deleted, never "finish". Each incarnation of a shard gets a group of its own name, so a
shard placed again after a preemption never meets its old, evicted Workload.

With ``gang.placedBy: Kueue`` the group also asks Kueue's Topology Aware Scheduling (TAS) to choose
where it runs (:func:`topology_request`): every pod carries the same topology annotation (one clique
of the fleet's clique label, required or preferred) and one role, so Kueue makes a single pod set of
the whole shard and fits all of it in one domain; when it admits the group it injects each pod's node
(a ``kubernetes.io/hostname`` node selector, the Topology's lowest level) and ungates it. The pods
then carry no pin of the operator's.

A group ends when the operator deletes its Workload (:func:`retired` says which), Kueue's own way of
ending a pod group: Kueue then stops what is left of it and takes its finalizer off the pods. Nothing
else ends a serving group: it never finishes, and an evicted one waits in the queue, holding its
deleted pods under Kueue's finalizer, for replacement pods of the same group, which the operator
never makes (a shard placed again is a new group).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

from megafleet.objects import Object

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
GROUP_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
SERVING_ANNOTATION = "kueue.x-k8s.io/pod-group-serving"
ROLE_ANNOTATION = "kueue.x-k8s.io/role-hash"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
"""The scheduling gate Kueue's pod webhook adds and removes once the group is admitted."""
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
"""The gate Kueue's TAS removes from an admitted pod once it wrote the pod's node into its node selector."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
MANAGED_FINALIZER = "kueue.x-k8s.io/managed"
"""Kueue's finalizer on each pod of a group: it holds a deleted pod until Kueue lets the group go."""
TERMINATION_TARGET = "TerminationTarget"
"""The pod condition Kueue sets on each pod it stops (its reason: ``WorkloadEvicted`` for a preemption)."""
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{name}"

ROLE_FRONTEND = "frontend"
ROLE_RANKS = "ranks"
"""A group's roles: Kueue makes a pod set per role. Its own role hash would count each pod's node pin
(the affinity differs per pod), one pod set per pod, and Kueue refuses a group of more than 8."""
ROLE_SHARD = "shard"
"""The one role of a group Kueue places (TAS): a topology request is per pod set, so one pod set
holds the whole shard and Kueue fits all of its pods in one domain (two roles would be two pod sets,
each fitted on its own, possibly in two cliques)."""

REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
UNCONSTRAINED_TOPOLOGY = "kueue.x-k8s.io/podset-unconstrained-topology"
POD_INDEX_LABEL_ANNOTATION = "kueue.x-k8s.io/pod-group-pod-index-label"
"""Names the label holding a pod's index in its group: Kueue's TAS then gives ranks in pod order."""
TOPOLOGY_SHORT = ("doesn't allow to fit", "allows to fit only")
"""What Kueue (v0.17, ``TASFlavorSnapshot``) says when no domain of the Topology holds a pod set."""

GROUP_NAME_CHARACTERS = 63
"""A group name is a label value and the Workload's name."""


def group_name(fleet: str, shard: int, nonce: str | None = None) -> str:
    """A new group name for one incarnation of ``shard``: ``<fleet>-<shard>-<nonce>``, the fleet's
    name shortened (with a hash of it) where the whole would not fit a label value."""
    nonce = nonce or secrets.token_hex(3)
    tail = f"-{shard}-{nonce}"
    room = GROUP_NAME_CHARACTERS - len(tail)
    head = fleet if len(fleet) <= room else f"{fleet[: room - 9]}-{hashlib.sha256(fleet.encode()).hexdigest()[:8]}"
    return f"{head}{tail}".lower()


def topology_request(*, clique_label: str, needs_clique: bool, required: bool) -> dict[str, str]:
    """The TAS annotations of a shard Kueue places: one clique (``clique_label``'s level of the
    Topology), required or preferred (``placement.nvlink``), for a shard whose NVLink span crosses
    nodes; otherwise no constraint (Kueue still chooses the nodes, counting their free capacity)."""
    if not needs_clique:
        return {UNCONSTRAINED_TOPOLOGY: "true"}
    return {REQUIRED_TOPOLOGY if required else PREFERRED_TOPOLOGY: clique_label}


def join(
    pods: list[Object], *, queue: str, group: str, topology: Mapping[str, str] | None = None, index_label: str = ""
) -> list[Object]:
    """``pods`` (one shard, pod 0 first) as one Kueue pod group in ``queue``: labels and annotations
    added. With ``topology`` (:func:`topology_request`) Kueue places the group: one role, the request
    on every pod, and ``index_label`` (the label holding a pod's index) named for Kueue's ranks."""
    joined = []
    for index, pod in enumerate(pods):
        metadata = pod["metadata"]
        labels = {**metadata.get("labels", {}), QUEUE_LABEL: queue, GROUP_LABEL: group}
        role = ROLE_FRONTEND if index == 0 else ROLE_RANKS
        placing: dict[str, str] = {}
        if topology is not None:
            role, placing = ROLE_SHARD, dict(topology)
            if index_label:
                placing[POD_INDEX_LABEL_ANNOTATION] = index_label
        annotations = {
            **metadata.get("annotations", {}),
            GROUP_TOTAL_ANNOTATION: str(len(pods)),
            SERVING_ANNOTATION: "true",
            ROLE_ANNOTATION: role,
            **placing,
        }
        joined.append({**pod, "metadata": {**metadata, "labels": labels, "annotations": annotations}})
    return joined


def group_of(pod: Object) -> str | None:
    """The Kueue group a pod belongs to, if any."""
    group: str | None = (pod["metadata"].get("labels") or {}).get(GROUP_LABEL)
    return group


def retired(pods: list[Object]) -> list[str]:
    """The groups among ``pods`` that are over but still held by Kueue: every pod of the group being
    deleted (the operator removes, and Kueue stops, whole shards) and one still carrying Kueue's
    finalizer. Each incarnation of a shard is a group of its own, so such a group never runs again."""
    members: dict[str, list[Object]] = {}
    for pod in pods:
        group = group_of(pod)
        if group:
            members.setdefault(group, []).append(pod)
    return sorted(
        group
        for group, found in members.items()
        if all(pod["metadata"].get("deletionTimestamp") for pod in found)
        and any(MANAGED_FINALIZER in (pod["metadata"].get("finalizers") or []) for pod in found)
    )


def gated(pod: Object) -> bool:
    """Kueue holds the pod: its group is not admitted (yet, or again)."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(gate.get("name") == ADMISSION_GATE for gate in gates)


def stopped_by_kueue(pod: Object) -> str | None:
    """Why Kueue stopped the pod (its ``TerminationTarget`` condition: the eviction's message, e.g. a
    preemption), or None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == TERMINATION_TARGET and condition.get("status") == "True":
            reason = str(condition.get("reason") or "Stopped")
            message = str(condition.get("message") or "").strip()
            return f"{reason}: {message}" if message else reason
    return None


def waiting_reason(workload: Object | None) -> str:
    """Why Kueue has not admitted a group, from its Workload: the ``QuotaReserved`` condition's
    message (Kueue says which resource of which flavor is short), else the Workload's absence."""
    if workload is None:
        return "Kueue has not made the group's Workload yet"
    for condition in (workload.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "QuotaReserved" and condition.get("status") != "True":
            return str(condition.get("message") or condition.get("reason") or "no quota reserved")
    return "quota reserved, waiting for Kueue to admit the group"


def short_of_topology(reason: str) -> bool:
    """Whether Kueue's reason for not admitting a group is its Topology: no domain holds the pod set
    (e.g. no clique has room for the whole shard), as opposed to the quota."""
    return any(words in reason for words in TOPOLOGY_SHORT)


def awaiting_node(pod: Object) -> str | None:
    """The group of a pod Kueue admitted but has not pinned to its node yet (its admission gate gone,
    its topology gate still on, not bound): the node is in the group's Workload only."""
    spec = pod.get("spec") or {}
    gates = {gate.get("name") for gate in spec.get("schedulingGates") or []}
    if TOPOLOGY_GATE in gates and ADMISSION_GATE not in gates and not spec.get("nodeName"):
        return group_of(pod)
    return None


def assigned_pods(workload: Object | None) -> dict[str, int]:
    """Pods per node that Kueue's TAS assigned a Workload at admission (``status.admission``'s
    topology assignments, v1beta2's compressed slices), for a Topology whose lowest level is the
    hostname; empty for anything else."""
    found: dict[str, int] = {}
    admission = ((workload or {}).get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        topology = assignment.get("topologyAssignment") or {}
        levels = topology.get("levels") or []
        if not levels or levels[-1] != HOSTNAME_LABEL:
            continue
        for piece in topology.get("slices") or []:
            count = int(piece.get("domainCount") or 0)
            values = (piece.get("valuesPerLevel") or [{}])[-1]
            counts = piece.get("podCounts") or {}
            individual = values.get("individual") or {}
            roots = individual.get("roots") or []
            for index in range(count):
                if "universal" in values:
                    host = str(values["universal"])
                elif index < len(roots):
                    host = f"{individual.get('prefix') or ''}{roots[index]}{individual.get('suffix') or ''}"
                else:
                    continue
                listed = counts.get("individual") or []
                pods = (
                    int(counts["universal"])
                    if "universal" in counts
                    else int(listed[index])
                    if index < len(listed)
                    else 0
                )
                found[host] = found.get(host, 0) + pods
    return found
