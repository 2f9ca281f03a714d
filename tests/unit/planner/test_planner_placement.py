"""Scenario tests of megafleet.planner.placement: real-world node shapes, packing, spreading, reasons."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from megafleet.planner import (
    DEFAULT_CLIQUE_LABEL,
    NodeInfo,
    Parallelism,
    PlacementPlan,
    PlacementRequest,
    PodPlacement,
    ShardPlacement,
    plan_placement,
    pod_layout,
)


def _node(
    name: str,
    gpus: int = 8,
    used: int = 0,
    *,
    clique: str | None = None,
    schedulable: bool = True,
    labels: Mapping[str, str] | None = None,
) -> NodeInfo:
    all_labels = dict(labels or {})
    if clique is not None:
        all_labels[DEFAULT_CLIQUE_LABEL] = clique
    return NodeInfo(name=name, labels=all_labels, allocatable_gpus=gpus, allocated_gpus=used, schedulable=schedulable)


def _gb200(
    cliques: Sequence[str] = ("a", "b"), nodes: int = 18, busy: Mapping[str, int] | None = None
) -> list[NodeInfo]:
    """GB200 NVL72-style racks: ``nodes`` nodes x 4 GPUs per clique; ``busy`` fully uses the first N nodes."""
    busy = busy or {}
    return [
        _node(f"{c}-{i:02d}", 4, 4 if i < busy.get(c, 0) else 0, clique=f"uuid.{c}")
        for c in cliques
        for i in range(nodes)
    ]


def _request(
    parallelism: Parallelism, gpus_per_node: int, shards: Sequence[int], **options: object
) -> PlacementRequest:
    return PlacementRequest(
        fleet="rl/policy-gen",
        shard_indices=shards,
        layout=pod_layout(parallelism, gpus_per_node),
        nvlink_span=parallelism.nvlink_span,
        gpus_per_node=gpus_per_node,
        **options,  # type: ignore[arg-type]
    )


def _nodes_of(plan: PlacementPlan) -> dict[int, list[str]]:
    return {shard: [pod.node for pod in placement.pods] for shard, placement in plan.placed.items()}


def _cliques_of(plan: PlacementPlan) -> dict[int, str | None]:
    return {shard: placement.clique for shard, placement in plan.placed.items()}


def test_llama_8b_tp8_on_8_gpu_nodes() -> None:
    nodes = [_node("n2", used=4), _node("n1"), _node("n0")]
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [0, 1]), nodes)
    assert plan.unplaced == {}
    assert plan.placed == {
        0: ShardPlacement(clique=None, pods=(PodPlacement("n0", 8),)),
        1: ShardPlacement(clique=None, pods=(PodPlacement("n1", 8),)),
    }


def test_tp8_third_shard_does_not_fit_a_half_used_node() -> None:
    nodes = [_node("n0"), _node("n1"), _node("n2", used=4)]
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [0, 1, 2]), nodes)
    assert sorted(plan.placed) == [0, 1]
    assert plan.unplaced[2] == (
        "shard 2 needs 1 pod of 8 GPUs; the eligible nodes fit 0 (0 of 3 nodes have 8 free GPUs); "
        "free GPUs, add nodes, or reduce spec.replicas"
    )


def test_tp8_pp2_spans_two_whole_nodes() -> None:
    nodes = [_node(f"n{i}") for i in range(4)]
    plan = plan_placement(_request(Parallelism(tensor=8, pipeline=2), 8, [0, 1]), nodes)
    assert _nodes_of(plan) == {0: ["n0", "n1"], 1: ["n2", "n3"]}
    assert all(pod.gpus == 8 for placement in plan.placed.values() for pod in placement.pods)


def test_tp8_pp2_prefers_one_clique_but_needs_none() -> None:
    # NVLink span 8 fits a node, so pipeline stages may cross cliques; one clique is still used when it fits.
    nodes = [_node("x0", clique="x"), _node("y0", clique="y"), _node("y1", clique="y")]
    plan = plan_placement(_request(Parallelism(tensor=8, pipeline=2), 8, [0, 1]), nodes)
    assert plan.placed[0] == ShardPlacement(clique="y", pods=(PodPlacement("y0", 8), PodPlacement("y1", 8)))
    assert plan.unplaced[1].startswith("shard 1 needs 2 pods of 8 GPUs each; the eligible nodes fit 1")


def test_gb200_tp16_pack_keeps_shards_inside_one_clique() -> None:
    plan = plan_placement(_request(Parallelism(tensor=16), 4, range(5)), _gb200())
    assert plan.unplaced == {}
    # Pack: four shards fill 16 of clique a's 18 nodes; the fifth cannot fit a's last 2 and goes whole to b.
    assert _cliques_of(plan) == {0: "uuid.a", 1: "uuid.a", 2: "uuid.a", 3: "uuid.a", 4: "uuid.b"}
    assert _nodes_of(plan)[4] == ["b-00", "b-01", "b-02", "b-03"]
    for placement in plan.placed.values():
        assert placement.clique is not None
        assert {pod.node.split("-")[0] for pod in placement.pods} == {placement.clique.removeprefix("uuid.")}
    used = [pod.node for placement in plan.placed.values() for pod in placement.pods]
    assert len(used) == len(set(used)) == 20


def test_gb200_prefers_fuller_clique_that_fits() -> None:
    # Clique a has 14 of 18 nodes busy (4 free), b is empty: pack fills a, so b stays whole.
    plan = plan_placement(_request(Parallelism(tensor=16), 4, [0, 1]), _gb200(busy={"a": 14}))
    assert _cliques_of(plan) == {0: "uuid.a", 1: "uuid.b"}
    assert _nodes_of(plan)[0] == ["a-14", "a-15", "a-16", "a-17"]


def test_gb200_shard_never_splits_across_cliques() -> None:
    # 3 free nodes in each clique: 6 nodes free in total, but no clique holds the 4 a shard needs.
    plan = plan_placement(_request(Parallelism(tensor=16), 4, [2]), _gb200(busy={"a": 15, "b": 15}))
    assert plan.placed == {}
    assert plan.unplaced == {
        2: "shard 2 needs 4 pods of 4 GPUs each in one NVLink clique (node label nvidia.com/gpu.clique); "
        "the roomiest clique fits 3 (clique uuid.a: 3 of 18 nodes have 4 free GPUs); "
        "free GPUs, add nodes, or reduce spec.replicas"
    }


def test_gb200_without_required_clique_falls_back_to_several() -> None:
    request = _request(Parallelism(tensor=16), 4, [0], require_clique=False)
    plan = plan_placement(request, _gb200(busy={"a": 15, "b": 15}))
    assert plan.placed[0].clique is None
    assert [pod.node for pod in plan.placed[0].pods] == ["a-15", "a-16", "a-17", "b-15"]


def test_gb200_without_required_clique_still_prefers_one() -> None:
    request = _request(Parallelism(tensor=16), 4, [0], require_clique=False)
    plan = plan_placement(request, _gb200(busy={"a": 15}))
    assert plan.placed[0].clique == "uuid.b"


def test_gb200_fleet_that_does_not_fit_reports_each_shard() -> None:
    plan = plan_placement(_request(Parallelism(tensor=16), 4, range(10)), _gb200())
    assert sorted(plan.placed) == list(range(8))
    assert sorted(plan.unplaced) == [8, 9]
    assert "the roomiest clique fits 2 (clique uuid.a: 2 of 18 nodes have 4 free GPUs)" in plan.unplaced[8]
    assert plan.unplaced[9].startswith("shard 9 needs 4 pods of 4 GPUs each in one NVLink clique")


def test_clique_shard_ignores_unlabelled_nodes() -> None:
    nodes = [_node(f"n{i}", 4) for i in range(8)]
    plan = plan_placement(_request(Parallelism(tensor=16), 4, [0]), nodes)
    assert "no eligible node has that label" in plan.unplaced[0]
    assert "relax the clique requirement" in plan.unplaced[0]
    relaxed = plan_placement(_request(Parallelism(tensor=16), 4, [0], require_clique=False), nodes)
    assert _nodes_of(relaxed) == {0: ["n0", "n1", "n2", "n3"]}


def test_clique_shard_never_uses_an_unlabelled_node_even_if_it_is_big_enough() -> None:
    # gpusPerNode says 4, so a TP=8 shard is two pods that need a clique; a 16-GPU node without
    # the clique label is not a clique, however many GPUs it has.
    nodes = [_node("big", 16), _node("c-0", 4, clique="c"), _node("c-1", 4, clique="c")]
    plan = plan_placement(_request(Parallelism(tensor=8), 4, [0, 1]), nodes)
    assert plan.placed == {0: ShardPlacement(clique="c", pods=(PodPlacement("c-0", 4), PodPlacement("c-1", 4)))}
    assert "the roomiest clique fits 0" in plan.unplaced[1]


def test_custom_clique_label() -> None:
    nodes = [_node(f"n{i}", 4, labels={"example.com/rack": "r1"}) for i in range(4)]
    plan = plan_placement(_request(Parallelism(tensor=16), 4, [0], clique_label="example.com/rack"), nodes)
    assert plan.placed[0].clique == "r1"


@pytest.mark.parametrize(
    ("spread", "expected"),
    [
        (False, {0: "uuid.a", 1: "uuid.a", 2: "uuid.a", 3: "uuid.a"}),
        (True, {0: "uuid.a", 1: "uuid.b", 2: "uuid.a", 3: "uuid.b"}),
    ],
    ids=["pack", "spread"],
)
def test_spread_vs_pack(spread: bool, expected: dict[int, str]) -> None:
    plan = plan_placement(_request(Parallelism(tensor=16), 4, range(4), spread_shards=spread), _gb200())
    assert _cliques_of(plan) == expected


@pytest.mark.parametrize(
    ("spread", "expected"),
    [(False, {0: ["n0"], 1: ["n0"], 2: ["n1"]}), (True, {0: ["n0"], 1: ["n1"], 2: ["n2"]})],
    ids=["pack-best-fit", "spread-one-per-node"],
)
def test_spread_vs_pack_on_plain_nodes(spread: bool, expected: dict[int, list[str]]) -> None:
    nodes = [_node("n0"), _node("n1"), _node("n2")]
    plan = plan_placement(_request(Parallelism(tensor=4), 8, range(3), spread_shards=spread), nodes)
    assert _nodes_of(plan) == expected


def test_pack_prefers_the_fullest_node_that_fits() -> None:
    nodes = [_node("n0"), _node("n1", used=4), _node("n2", used=6)]
    plan = plan_placement(_request(Parallelism(tensor=4), 8, [0]), nodes)
    assert _nodes_of(plan) == {0: ["n1"]}


def test_spread_counts_shards_already_running() -> None:
    running = ShardPlacement(clique="uuid.a", pods=tuple(PodPlacement(f"a-{i:02d}", 4) for i in range(4)))
    request = _request(Parallelism(tensor=16), 4, [1], spread_shards=True, existing={0: running})
    plan = plan_placement(request, _gb200(busy={"a": 4}))
    assert _cliques_of(plan) == {1: "uuid.b"}


def test_existing_entry_for_a_requested_shard_is_ignored() -> None:
    stale = ShardPlacement(clique="uuid.a", pods=tuple(PodPlacement(f"a-{i:02d}", 4) for i in range(4)))
    request = _request(Parallelism(tensor=16), 4, [0], spread_shards=True, existing={0: stale})
    assert _cliques_of(plan_placement(request, _gb200())) == {0: "uuid.a"}


def test_unschedulable_and_unselected_nodes_are_ignored() -> None:
    nodes = [
        _node("n0", schedulable=False, labels={"pool": "rl"}),
        _node("n1", labels={"pool": "batch"}),
        _node("n2", labels={"pool": "rl"}),
    ]
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [0, 1], node_selector={"pool": "rl"}), nodes)
    assert _nodes_of(plan) == {0: ["n2"]}
    assert "the eligible nodes fit 0 (0 of 1 nodes have 8 free GPUs)" in plan.unplaced[1]


@pytest.mark.parametrize(
    ("selector", "phrase"),
    [
        ({"pool": "rl"}, "no schedulable node matches the node selector pool=rl (2 nodes, 1 unschedulable)"),
        ({}, "no schedulable node (1 nodes, 1 unschedulable); add or uncordon nodes"),
    ],
    ids=["selector", "cordoned"],
)
def test_no_eligible_node(selector: dict[str, str], phrase: str) -> None:
    nodes = [_node("n0", schedulable=False)]
    if selector:
        nodes.append(_node("n1", labels={"pool": "batch"}))
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [0, 3], node_selector=selector), nodes)
    assert sorted(plan.unplaced) == [0, 3]
    assert plan.unplaced[3].startswith(f"shard 3: {phrase}")


def test_pods_larger_than_any_node() -> None:
    nodes = [_node("n0", 4), _node("n1", 4)]
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [0]), nodes)
    assert "the largest eligible node has 4 allocatable GPUs; check spec.resources.gpusPerNode" in plan.unplaced[0]


def test_overcommitted_node_counts_as_full() -> None:
    nodes = [_node("n0", 8, 10), _node("n1", 8, 0)]
    plan = plan_placement(_request(Parallelism(tensor=4), 8, [0, 1, 2]), nodes)
    assert _nodes_of(plan) == {0: ["n1"], 1: ["n1"]}
    assert list(plan.unplaced) == [2]


def test_cpu_layout_round_robins_over_eligible_nodes() -> None:
    nodes = [
        _node("gpu-0", 8, 8),
        _node("cpu-1", 0),
        _node("cpu-0", 0),
        _node("cpu-2", 0, schedulable=False),
    ]
    plan = plan_placement(_request(Parallelism(), 0, range(4)), nodes)
    assert plan.unplaced == {}
    assert _nodes_of(plan) == {0: ["cpu-0"], 1: ["cpu-1"], 2: ["gpu-0"], 3: ["cpu-0"]}
    assert all(pod.gpus == 0 for placement in plan.placed.values() for pod in placement.pods)


def test_cpu_layout_counts_running_pods() -> None:
    running = ShardPlacement(clique=None, pods=(PodPlacement("cpu-0", 0),))
    plan = plan_placement(
        _request(Parallelism(), 0, [1], existing={0: running}), [_node("cpu-0", 0), _node("cpu-1", 0)]
    )
    assert _nodes_of(plan) == {1: ["cpu-1"]}


def test_lower_shards_win_regardless_of_request_order() -> None:
    nodes = [_node("n0")]
    plan = plan_placement(_request(Parallelism(tensor=8), 8, [5, 2, 9]), nodes)
    assert list(plan.placed) == [2]
    assert sorted(plan.unplaced) == [5, 9]


def test_node_order_does_not_matter() -> None:
    nodes = _gb200(busy={"a": 5, "b": 9})
    request = _request(Parallelism(tensor=16), 4, range(6), spread_shards=True)
    expected = plan_placement(request, nodes)
    shuffled = list(nodes)
    random.Random(7).shuffle(shuffled)
    assert plan_placement(request, shuffled) == expected


@pytest.mark.parametrize(
    ("shards", "nodes", "match"),
    [
        ([1, 1], [_node("n0")], "unique and non-negative"),
        ([-1], [_node("n0")], "unique and non-negative"),
        ([0], [_node("n0"), _node("n0")], "node names must be unique"),
    ],
    ids=["duplicate-shard", "negative-shard", "duplicate-node"],
)
def test_rejects_bad_requests(shards: list[int], nodes: list[NodeInfo], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_placement(_request(Parallelism(tensor=8), 8, shards), nodes)
