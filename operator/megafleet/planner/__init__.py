"""The planner: pure functions from a fleet spec and a node snapshot to a plan.

The reconcile (:mod:`megafleet.reconcile`) calls it in this order: :func:`validate` the spec, derive the
rank layout (:func:`pod_layout`, :func:`frontend_ranks`, :func:`needs_clique`), then
:func:`plan_placement` for the shards to create; the refit orchestrator calls
:func:`rank_offsets` for the membership of each refit. No Kubernetes calls and no imports outside
the standard library, so everything here is unit-tested without a cluster.
"""

from megafleet.planner.layout import (
    Membership,
    Parallelism,
    PodLayout,
    RankCoord,
    frontend_ranks,
    needs_clique,
    pod_layout,
    rank_coordinates,
    rank_offsets,
)
from megafleet.planner.placement import (
    DEFAULT_CLIQUE_LABEL,
    NodeInfo,
    PlacementPlan,
    PlacementRequest,
    PodPlacement,
    ShardPlacement,
    plan_placement,
)
from megafleet.planner.validation import FleetSettings, Problem, validate

__all__ = [
    "DEFAULT_CLIQUE_LABEL",
    "FleetSettings",
    "Membership",
    "NodeInfo",
    "Parallelism",
    "PlacementPlan",
    "PlacementRequest",
    "PodLayout",
    "PodPlacement",
    "Problem",
    "RankCoord",
    "ShardPlacement",
    "frontend_ranks",
    "needs_clique",
    "plan_placement",
    "pod_layout",
    "rank_coordinates",
    "rank_offsets",
    "validate",
]
