"""Placement of a fleet's shards onto nodes: whole shards, NVLink cliques, no over-commit.

The reconcile flow calls :func:`plan_placement` after reserving endpoints and before creating
pods (:mod:`megafleet.reconcile.shards`). It reads a snapshot of the nodes (labels, allocatable and allocated
GPUs, schedulability) that the Kubernetes layer collected, and answers which node each pod of
each requested shard goes to, or, for a shard that does not fit, a reason the user can act on.
The pod builder turns a shard's clique into node affinity. Nothing here talks to Kubernetes.

Rules:

- A shard is placed whole or not at all, and GPUs are consumed as shards are placed, lowest
  shard index first.
- A shard whose NVLink span exceeds one node (more than one pod) needs all its pods in nodes that
  share one value of the clique label (``nvidia.com/gpu.clique`` by default). Without
  ``require_clique`` it may fall back to any nodes, but one clique is still preferred.
- Packing (the default) picks the fitting domain (a clique, or a node without a clique label)
  with the fewest free GPUs, so that whole cliques stay free for later shards; spreading picks
  the domain holding the fewest shards of this fleet. Inside a domain, each pod goes to the node
  with the fewest free GPUs that still fit it. Names break every tie, so output is deterministic.
- CPU layouts (no GPUs per pod) go to the eligible node holding the fewest pods of this fleet.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import megafleet.planner.layout as planner_layout

__all__ = [
    "DEFAULT_CLIQUE_LABEL",
    "NodeInfo",
    "PlacementPlan",
    "PlacementRequest",
    "PodPlacement",
    "ShardPlacement",
    "plan_placement",
]

DEFAULT_CLIQUE_LABEL = "nvidia.com/gpu.clique"
"""Node label whose value names a node's multi-node NVLink domain (set by GPU feature discovery)."""

# A placement domain: (0, clique label value), or (1, node name) for a node without a clique label.
_Domain = tuple[int, str]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What placement needs to know about one node.

    Attributes:
        name: node name.
        labels: node labels (the clique label and whatever the node selector matches).
        allocatable_gpus: GPUs the node offers (``status.allocatable``).
        allocated_gpus: GPUs already requested by pods bound to the node.
        schedulable: False for a cordoned node.
    """

    name: str
    labels: Mapping[str, str]
    allocatable_gpus: int
    allocated_gpus: int
    schedulable: bool = True

    @property
    def free_gpus(self) -> int:
        """GPUs still free; never negative, even on a node that is already over-committed."""
        return max(0, self.allocatable_gpus - self.allocated_gpus)


@dataclasses.dataclass(frozen=True)
class PodPlacement:
    """One pod of a shard: the node it goes to and the GPUs it takes there."""

    node: str
    gpus: int


@dataclasses.dataclass(frozen=True)
class ShardPlacement:
    """Where one shard goes.

    Attributes:
        clique: the clique label value shared by all the shard's nodes, or None if they share none.
        pods: one entry per pod, in pod order (pod p holds shard-local ranks of
            :meth:`~megafleet.planner.layout.PodLayout.ranks_of_pod`).
    """

    clique: str | None
    pods: tuple[PodPlacement, ...]


@dataclasses.dataclass(frozen=True)
class PlacementRequest:
    """The shards of one fleet to place, and how.

    Attributes:
        fleet: the fleet's name (``namespace/name``), for the caller's logs and events.
        shard_indices: shards to place; unique, non-negative.
        layout: pods of one shard (:func:`~megafleet.planner.layout.pod_layout`).
        nvlink_span: largest GPU group needing NVLink (``Parallelism.nvlink_span``).
        gpus_per_node: ``spec.resources.gpusPerNode``; 0 for a CPU fleet.
        clique_label: node label naming a node's NVLink clique.
        require_clique: if False, a shard needing a clique may fall back to nodes of several cliques.
        spread_shards: prefer the domains holding the fewest shards of this fleet over packing.
        node_selector: labels a node must carry to be used.
        existing: shards of this fleet that already run elsewhere (their GPUs are already in
            ``allocated_gpus``); only counted when spreading. Entries for requested shards are ignored.
    """

    fleet: str
    shard_indices: Sequence[int]
    layout: planner_layout.PodLayout
    nvlink_span: int
    gpus_per_node: int
    clique_label: str = DEFAULT_CLIQUE_LABEL
    require_clique: bool = True
    spread_shards: bool = False
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    existing: Mapping[int, ShardPlacement] = dataclasses.field(default_factory=dict)

    @property
    def needs_clique(self) -> bool:
        """Whether each shard's pods must share one NVLink clique."""
        return 0 < self.gpus_per_node < self.nvlink_span and self.layout.pods_per_shard > 1


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Result of :func:`plan_placement`.

    Attributes:
        placed: shard index -> placement, for the shards that fit.
        unplaced: shard index -> why it does not fit and what to change.
    """

    placed: dict[int, ShardPlacement]
    unplaced: dict[int, str]


class _Cluster:
    """Free GPUs and this fleet's usage per domain while one plan is built."""

    def __init__(self, request: PlacementRequest, eligible: Sequence[NodeInfo], nodes: Sequence[NodeInfo]) -> None:
        self.free = {node.name: node.free_gpus for node in eligible}
        self.allocatable = {node.name: node.allocatable_gpus for node in eligible}
        self.clique = {node.name: node.labels.get(request.clique_label) or None for node in nodes}
        self.usage: collections.Counter[_Domain] = collections.Counter()
        self._groups: dict[bool, dict[_Domain, list[str]]] = {}
        for shard, placement in request.existing.items():
            if shard not in request.shard_indices:
                self.count(placement)

    def domain(self, node: str) -> _Domain:
        clique = self.clique.get(node)
        return (0, clique) if clique is not None else (1, node)

    def groups(self, *, cliques_only: bool) -> dict[_Domain, list[str]]:
        """Eligible node names by domain, each list sorted by name; made once per plan (the nodes
        and their domains do not change while it is built, only their free GPUs)."""
        if cliques_only not in self._groups:
            groups: dict[_Domain, list[str]] = {}
            for name in sorted(self.free):
                key = self.domain(name)
                if key[0] == 0 or not cliques_only:
                    groups.setdefault(key, []).append(name)
            self._groups[cliques_only] = groups
        return self._groups[cliques_only]

    def slots(self, names: Iterable[str], gpus: int) -> int:
        return sum(self.free[name] // gpus for name in names)

    def best_domain(self, groups: dict[_Domain, list[str]], pods: int, gpus: int, *, spread: bool) -> _Domain | None:
        """The domain that fits ``pods`` pods of ``gpus`` GPUs with the fewest of this fleet's shards
        (when spreading), then the fewest free GPUs (best fit), then the smallest key; None if none
        fits. One pass over the domains: a plan of 1,000 one-node domains makes it per shard."""
        best: tuple[int, int, _Domain] | None = None
        free, usage = self.free, self.usage
        for key, names in groups.items():
            if len(names) == 1:
                total = free[names[0]]
                slots = total // gpus
            else:
                total = sum(free[name] for name in names)
                slots = sum(free[name] // gpus for name in names)
            if slots < pods:
                continue
            rank = (usage[key] if spread else 0, total, key)
            if best is None or rank < best:
                best = rank
        return None if best is None else best[2]

    def choose(self, names: Sequence[str], pods: int, gpus: int) -> ShardPlacement:
        """Best-fit pods onto ``names``; the caller has checked that they fit."""
        free = {name: self.free[name] for name in names}
        chosen: list[str] = []
        for _ in range(pods):
            node = min((name for name in names if free[name] >= gpus), key=lambda name: (free[name], name))
            free[node] -= gpus
            chosen.append(node)
        return self.shard(sorted(chosen), gpus)

    def shard(self, nodes: Sequence[str], gpus: int) -> ShardPlacement:
        cliques = {self.clique.get(node) for node in nodes}
        clique = cliques.pop() if len(cliques) == 1 else None
        return ShardPlacement(clique=clique, pods=tuple(PodPlacement(node=node, gpus=gpus) for node in nodes))

    def count(self, placement: ShardPlacement) -> None:
        for key in {self.domain(pod.node) for pod in placement.pods}:
            self.usage[key] += 1

    def commit(self, placement: ShardPlacement) -> None:
        for pod in placement.pods:
            self.free[pod.node] -= pod.gpus
        self.count(placement)


def _eligible(request: PlacementRequest, nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    selector = request.node_selector.items()
    matching = (node for node in nodes if node.schedulable and all(node.labels.get(k) == v for k, v in selector))
    return sorted(matching, key=lambda node: node.name)


def _check_inputs(request: PlacementRequest, nodes: Sequence[NodeInfo]) -> list[int]:
    shards = sorted(request.shard_indices)
    if len(set(shards)) != len(shards) or (shards and shards[0] < 0):
        raise ValueError(f"shard indices must be unique and non-negative: {list(request.shard_indices)}")
    if request.layout.pods_per_shard < 1 or request.layout.gpus_per_pod < 0:
        raise ValueError(f"invalid pod layout {request.layout}")
    names = [node.name for node in nodes]
    if len(set(names)) != len(names):
        raise ValueError("node names must be unique")
    return shards


def _pods(count: int, gpus: int) -> str:
    return f"1 pod of {gpus} GPUs" if count == 1 else f"{count} pods of {gpus} GPUs each"


_ACTION = "free GPUs, add nodes, or reduce spec.replicas"


def _no_nodes_reason(request: PlacementRequest, nodes: Sequence[NodeInfo]) -> str:
    cordoned = sum(1 for node in nodes if not node.schedulable)
    if not request.node_selector:
        return f"no schedulable node ({len(nodes)} nodes, {cordoned} unschedulable); add or uncordon nodes"
    selector = ",".join(f"{key}={value}" for key, value in sorted(request.node_selector.items()))
    return (
        f"no schedulable node matches the node selector {selector} ({len(nodes)} nodes, {cordoned} unschedulable); "
        "label nodes to match or change the node selector"
    )


def _domain_summary(cluster: _Cluster, names: Sequence[str], gpus: int) -> str:
    fitting = sum(1 for name in names if cluster.free[name] >= gpus)
    return f"{fitting} of {len(names)} nodes have {gpus} free GPUs"


def _clique_reason(request: PlacementRequest, cluster: _Cluster, shard: int) -> str:
    pods, gpus, label = request.layout.pods_per_shard, request.layout.gpus_per_pod, request.clique_label
    need = f"shard {shard} needs {_pods(pods, gpus)} in one NVLink clique (node label {label})"
    groups = cluster.groups(cliques_only=True)
    if not groups:
        return (
            f"{need}, but no eligible node has that label; label the nodes with their NVLink clique "
            "or relax the clique requirement in spec.placement"
        )
    best = min(groups, key=lambda key: (-cluster.slots(groups[key], gpus), key))
    room = cluster.slots(groups[best], gpus)
    detail = f"clique {best[1]}: {_domain_summary(cluster, groups[best], gpus)}"
    fallback = ""
    if not request.require_clique:
        fallback = f"; all eligible nodes together fit {cluster.slots(cluster.free, gpus)}"
    return f"{need}; the roomiest clique fits {room} ({detail}){fallback}; {_ACTION}"


def _reason(request: PlacementRequest, cluster: _Cluster, shard: int) -> str:
    pods, gpus = request.layout.pods_per_shard, request.layout.gpus_per_pod
    largest = max(cluster.allocatable.values())
    if largest < gpus:
        return (
            f"shard {shard} needs {_pods(pods, gpus)}, but the largest eligible node has {largest} allocatable "
            "GPUs; check spec.resources.gpusPerNode"
        )
    if request.needs_clique:
        return _clique_reason(request, cluster, shard)
    names = sorted(cluster.free)
    room = cluster.slots(names, gpus)
    return (
        f"shard {shard} needs {_pods(pods, gpus)}; the eligible nodes fit {room} "
        f"({_domain_summary(cluster, names, gpus)}); {_ACTION}"
    )


def _place_gpu_shard(request: PlacementRequest, cluster: _Cluster, shard: int) -> ShardPlacement | str:
    pods, gpus = request.layout.pods_per_shard, request.layout.gpus_per_pod
    groups = cluster.groups(cliques_only=request.needs_clique)
    best = cluster.best_domain(groups, pods, gpus, spread=request.spread_shards)
    if best is not None:
        return cluster.choose(groups[best], pods, gpus)
    # No single domain holds the shard: spread over several if its NVLink groups allow it.
    everything = sorted(cluster.free)
    if (not request.needs_clique or not request.require_clique) and cluster.slots(everything, gpus) >= pods:
        return cluster.choose(everything, pods, gpus)
    return _reason(request, cluster, shard)


def _place_cpu(request: PlacementRequest, cluster: _Cluster, shards: Sequence[int]) -> PlacementPlan:
    names = sorted(cluster.free)
    pods_on = collections.Counter(
        pod.node for shard, placement in request.existing.items() if shard not in shards for pod in placement.pods
    )
    placed: dict[int, ShardPlacement] = {}
    for shard in shards:
        chosen: list[str] = []
        for _ in range(request.layout.pods_per_shard):
            node = min(names, key=lambda name: (pods_on[name], name))
            pods_on[node] += 1
            chosen.append(node)
        placed[shard] = cluster.shard(sorted(chosen), 0)
    return PlacementPlan(placed=placed, unplaced={})


def plan_placement(request: PlacementRequest, nodes: Sequence[NodeInfo]) -> PlacementPlan:
    """Place every requested shard whole on the given nodes, or say why it does not fit.

    Args:
        request: the shards and how to place them.
        nodes: a snapshot of all nodes; unschedulable ones and those not matching the node
            selector are ignored. Their order does not matter.

    Returns:
        A plan whose ``placed`` and ``unplaced`` keys together are exactly the requested shards.

    Raises:
        ValueError: repeated or negative shard indices, repeated node names, or an invalid layout.
    """
    shards = _check_inputs(request, nodes)
    eligible = _eligible(request, nodes)
    if not eligible:
        reason = _no_nodes_reason(request, nodes)
        return PlacementPlan(placed={}, unplaced={shard: f"shard {shard}: {reason}" for shard in shards})
    cluster = _Cluster(request, eligible, nodes)
    if request.layout.gpus_per_pod == 0:
        return _place_cpu(request, cluster, shards)
    placed: dict[int, ShardPlacement] = {}
    unplaced: dict[int, str] = {}
    for shard in shards:
        outcome = _place_gpu_shard(request, cluster, shard)
        if isinstance(outcome, str):
            unplaced[shard] = outcome
        else:
            placed[shard] = outcome
            cluster.commit(outcome)
    return PlacementPlan(placed=placed, unplaced=unplaced)
