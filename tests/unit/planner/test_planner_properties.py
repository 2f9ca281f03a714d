"""Property-based tests (hypothesis) of the planner's invariants.

Layout: Megatron rank order, frontends, pods and membership agree with simple reference models.
Validation: a spec that validates always has a well-defined layout. Placement: whole shards, no
over-commit, NVLink groups never split across cliques, every requested shard accounted for.
"""

from __future__ import annotations

import collections
import itertools
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from megafleet.planner import (
    DEFAULT_CLIQUE_LABEL,
    FleetSettings,
    NodeInfo,
    Parallelism,
    PlacementPlan,
    PlacementRequest,
    frontend_ranks,
    needs_clique,
    plan_placement,
    pod_layout,
    rank_coordinates,
    rank_offsets,
    validate,
)

# The machine is shared and busy: no per-example deadline, few examples.
FAST = settings(max_examples=60, deadline=None)

small = st.integers(min_value=1, max_value=4)
powers = st.sampled_from([1, 2, 4, 8, 16])


@FAST
@given(tp=small, cp=small, dp=small, pp=small)
def test_rank_coordinates_follow_reshape_pp_dp_cp_tp(tp: int, cp: int, dp: int, pp: int) -> None:
    par = Parallelism(tensor=tp, context=cp, pipeline=pp)
    # Reference: arange(world).reshape(PP, DP, CP, TP) enumerates (pp, dp, cp, tp) with tp fastest.
    grid = itertools.product(range(pp), range(dp), range(cp), range(tp))
    expected = [(rank, t, c, d, p) for rank, (p, d, c, t) in enumerate(grid)]
    assert [(c.rank, c.tp, c.cp, c.dp, c.pp) for c in rank_coordinates(par, dp)] == expected


@FAST
@given(tp=small, cp=small, dp=small, pp=small)
def test_frontends_are_the_tp0_pp0_ranks(tp: int, cp: int, dp: int, pp: int) -> None:
    par = Parallelism(tensor=tp, context=cp, pipeline=pp)
    world = par.shard_size * dp
    frontends = list(frontend_ranks(par, world))
    assert frontends == [c.rank for c in rank_coordinates(par, dp) if c.tp == 0 and c.pp == 0]
    assert len(frontends) == dp * cp
    if cp == 1:
        assert len(frontends) == dp


@FAST
@given(tp=powers, pp=st.sampled_from([1, 2, 4]), gpus_per_node=st.sampled_from([1, 2, 4, 8]))
def test_pods_hold_every_rank_of_a_shard_once(tp: int, pp: int, gpus_per_node: int) -> None:
    par = Parallelism(tensor=tp, pipeline=pp)
    layout = pod_layout(par, gpus_per_node)
    ranks = [rank for pod in range(layout.pods_per_shard) for rank in layout.ranks_of_pod(pod)]
    assert ranks == list(range(par.shard_size))
    assert layout.pods_per_shard * layout.gpus_per_pod == par.shard_size
    assert layout.gpus_per_pod <= gpus_per_node


@FAST
@given(
    trainer=st.integers(min_value=1, max_value=64),
    live=st.sets(st.integers(min_value=0, max_value=20), max_size=8),
    shard_size=st.integers(min_value=1, max_value=16),
)
def test_membership_packs_live_shards_after_the_trainer(trainer: int, live: set[int], shard_size: int) -> None:
    order = list(live)
    random.Random(len(order)).shuffle(order)
    membership = rank_offsets(trainer, order, shard_size)
    assert set(membership.offsets) == live
    covered = sorted(rank for offset in membership.offsets.values() for rank in range(offset, offset + shard_size))
    assert covered == list(range(trainer, membership.world_size))
    by_shard = [membership.offsets[shard] for shard in sorted(live)]
    assert by_shard == sorted(by_shard)


fleet_settings = st.builds(
    FleetSettings,
    parallelism=st.builds(
        Parallelism,
        tensor=st.sampled_from([0, 1, 2, 3, 4, 8, 16]),
        pipeline=st.sampled_from([1, 2, 3]),
        context=st.sampled_from([1, 2]),
        expert=st.sampled_from([1, 2, 4, 8]),
        expert_tensor=st.sampled_from([1, 2]),
    ),
    replicas=st.integers(min_value=-1, max_value=4),
    gpus_per_node=st.sampled_from([0, 1, 4, 8]),
    backend=st.sampled_from(["megatron", "transformers"]),
    kv_cache_mode=st.sampled_from(["persist", "offload", "recompute"]),
    cuda_graphs=st.booleans(),
    weights_initial=st.sampled_from(["checkpoint", "refit"]),
    refit_transport=st.sampled_from(["broadcast", "reshard"]),
    checkpoint=st.sampled_from([None, "", "/ckpt"]),
)


@settings(max_examples=150, deadline=None)
@given(fleet_settings)
def test_valid_settings_have_a_well_defined_layout(fleet: FleetSettings) -> None:
    problems = validate(fleet)
    assert problems == validate(fleet)
    assert all(p.field.startswith("spec.") and p.message for p in problems)
    if problems:
        return
    par, per_node = fleet.parallelism, fleet.gpus_per_node
    layout = pod_layout(par, per_node)
    assert layout.pods_per_shard * max(layout.ranks_per_pod, 1) == par.shard_size
    assert par.nvlink_span <= par.shard_size
    if needs_clique(par, per_node):
        assert layout.pods_per_shard > 1
    if per_node:
        # Shards pack nodes: either whole nodes, or a divisor of a node.
        assert par.shard_size % per_node == 0 or per_node % par.shard_size == 0


@st.composite
def clusters(draw: Any) -> list[NodeInfo]:
    """Up to 3 racks of alike nodes; a rack is one clique or has no clique label."""
    nodes = []
    for rack in range(draw(st.integers(min_value=1, max_value=3))):
        clique = draw(st.sampled_from([None, f"c{rack}", f"c{rack}", "c0"]))
        allocatable = draw(st.sampled_from([0, 4, 4, 8, 8]))
        pool = draw(st.sampled_from(["rl", "rl", "other"]))
        for i in range(draw(st.integers(min_value=1, max_value=10))):
            labels = {"pool": pool} | ({DEFAULT_CLIQUE_LABEL: clique} if clique else {})
            nodes.append(
                NodeInfo(
                    name=f"r{rack}-node-{i:02d}",
                    labels=labels,
                    allocatable_gpus=allocatable,
                    allocated_gpus=draw(st.sampled_from([0, 0, 0, 0, 0, allocatable // 2, allocatable])),
                    schedulable=draw(st.sampled_from([True, True, True, True, False])),
                )
            )
    return nodes


@st.composite
def requests(draw: Any) -> PlacementRequest:
    gpus_per_node = draw(st.sampled_from([0, 4, 4, 8, 8]))
    if gpus_per_node:
        par = Parallelism(
            tensor=draw(st.sampled_from([1, 2, 4, 8, 8, 16, 16])), pipeline=draw(st.sampled_from([1, 1, 2]))
        )
    else:
        par = Parallelism()
    return PlacementRequest(
        fleet="ns/fleet",
        shard_indices=sorted(draw(st.sets(st.integers(min_value=0, max_value=9), min_size=1, max_size=6))),
        layout=pod_layout(par, gpus_per_node),
        nvlink_span=par.nvlink_span,
        gpus_per_node=gpus_per_node,
        require_clique=draw(st.booleans()),
        spread_shards=draw(st.booleans()),
        node_selector=draw(st.sampled_from([{}, {"pool": "rl"}])),
    )


def _check_accounting(request: PlacementRequest, plan: PlacementPlan) -> None:
    assert set(plan.placed) | set(plan.unplaced) == set(request.shard_indices)
    assert not set(plan.placed) & set(plan.unplaced)
    assert all(reason.startswith(f"shard {shard}") for shard, reason in plan.unplaced.items())


def _check_whole_shards(request: PlacementRequest, plan: PlacementPlan) -> None:
    layout = request.layout
    for placement in plan.placed.values():
        assert len(placement.pods) == layout.pods_per_shard
        assert all(pod.gpus == layout.gpus_per_pod for pod in placement.pods)
        ranks = [rank for pod in range(len(placement.pods)) for rank in layout.ranks_of_pod(pod)]
        assert ranks == list(range(layout.pods_per_shard * layout.ranks_per_pod))


def _check_nodes(request: PlacementRequest, nodes: list[NodeInfo], plan: PlacementPlan) -> None:
    by_name = {node.name: node for node in nodes}
    placed_gpus: collections.Counter[str] = collections.Counter()
    for placement in plan.placed.values():
        for pod in placement.pods:
            node = by_name[pod.node]
            assert node.schedulable
            assert all(node.labels.get(key) == value for key, value in request.node_selector.items())
            placed_gpus[pod.node] += pod.gpus
    for name, gpus in placed_gpus.items():
        if gpus:
            assert by_name[name].allocated_gpus + gpus <= by_name[name].allocatable_gpus


def _check_cliques(request: PlacementRequest, nodes: list[NodeInfo], plan: PlacementPlan) -> None:
    cliques = {node.name: node.labels.get(DEFAULT_CLIQUE_LABEL) for node in nodes}
    for placement in plan.placed.values():
        shared = {cliques[pod.node] for pod in placement.pods}
        assert placement.clique == (shared.pop() if len(shared) == 1 else None)
        if request.needs_clique and request.require_clique:
            assert placement.clique is not None


@settings(max_examples=200, deadline=None)
@given(request=requests(), nodes=clusters())
def test_placement_invariants(request: PlacementRequest, nodes: list[NodeInfo]) -> None:
    plan = plan_placement(request, nodes)
    _check_accounting(request, plan)
    _check_whole_shards(request, plan)
    _check_nodes(request, nodes, plan)
    _check_cliques(request, nodes, plan)
    # Shards are equal and capacity only shrinks: once one does not fit, no later one does.
    if plan.unplaced:
        assert all(shard < min(plan.unplaced) for shard in plan.placed)


@FAST
@given(request=requests(), nodes=clusters(), seed=st.integers(min_value=0, max_value=1000))
def test_placement_is_deterministic(request: PlacementRequest, nodes: list[NodeInfo], seed: int) -> None:
    shuffled = list(nodes)
    random.Random(seed).shuffle(shuffled)
    assert plan_placement(request, shuffled) == plan_placement(request, nodes)
