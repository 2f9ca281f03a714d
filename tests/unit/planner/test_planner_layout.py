"""Table-driven tests of megafleet.planner.layout: sizes, rank order, frontends, pods, membership."""

from __future__ import annotations

import pytest

from megafleet import planner
from megafleet.planner import Membership, Parallelism, PodLayout, RankCoord


def test_all_is_sorted_and_complete() -> None:
    assert planner.__all__ == sorted(planner.__all__)
    public = {name for name in vars(planner) if not name.startswith("_")} - {"layout", "placement", "validation"}
    assert set(planner.__all__) == public


@pytest.mark.parametrize(
    ("parallelism", "shard_size", "nvlink_span"),
    [
        (Parallelism(), 1, 1),
        (Parallelism(tensor=8), 8, 8),
        (Parallelism(tensor=8, pipeline=2), 16, 8),
        (Parallelism(tensor=2, context=2), 4, 4),
        (Parallelism(tensor=2, expert=8), 2, 8),
        (Parallelism(tensor=4, expert=2, expert_tensor=2), 4, 4),
        (Parallelism(tensor=16), 16, 16),
    ],
    ids=["default", "tp8", "tp8-pp2", "tp2-cp2", "tp2-ep8", "tp4-ep2-etp2", "tp16"],
)
def test_sizes(parallelism: Parallelism, shard_size: int, nvlink_span: int) -> None:
    assert parallelism.shard_size == shard_size
    assert parallelism.nvlink_span == nvlink_span


def _coords(parallelism: Parallelism, data_parallel: int) -> list[tuple[int, int, int, int]]:
    return [(c.tp, c.cp, c.dp, c.pp) for c in planner.rank_coordinates(parallelism, data_parallel)]


@pytest.mark.parametrize(
    ("parallelism", "data_parallel", "expected"),
    [
        (Parallelism(), 1, [(0, 0, 0, 0)]),
        (Parallelism(tensor=4), 1, [(0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)]),
        (
            Parallelism(tensor=2, pipeline=2),
            2,
            [
                (0, 0, 0, 0),
                (1, 0, 0, 0),
                (0, 0, 1, 0),
                (1, 0, 1, 0),
                (0, 0, 0, 1),
                (1, 0, 0, 1),
                (0, 0, 1, 1),
                (1, 0, 1, 1),
            ],
        ),
        (Parallelism(tensor=2, context=2), 1, [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0)]),
        (Parallelism(pipeline=2), 2, [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 1, 1)]),
    ],
    ids=["single", "tp4", "tp2-pp2-dp2", "tp2-cp2", "pp2-dp2"],
)
def test_rank_coordinates(parallelism: Parallelism, data_parallel: int, expected: list[tuple[int, ...]]) -> None:
    assert _coords(parallelism, data_parallel) == expected
    ranks = [c.rank for c in planner.rank_coordinates(parallelism, data_parallel)]
    assert ranks == list(range(len(expected)))


def test_rank_coord_is_frozen() -> None:
    coord = planner.rank_coordinates(Parallelism(), 1)[0]
    assert coord == RankCoord(rank=0, tp=0, cp=0, dp=0, pp=0)
    with pytest.raises(AttributeError):
        coord.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("parallelism", "data_parallel"),
    [(Parallelism(tensor=0), 1), (Parallelism(), 0), (Parallelism(expert=0), 1)],
    ids=["tp0", "dp0", "ep0"],
)
def test_rank_coordinates_rejects_bad_sizes(parallelism: Parallelism, data_parallel: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        planner.rank_coordinates(parallelism, data_parallel)


@pytest.mark.parametrize(
    ("parallelism", "world_size", "expected"),
    [
        # The NeMo RL case: a TP*PP stride would pick 0 and 4; PP is the slowest axis, so it is 0 and 2.
        (Parallelism(tensor=2, pipeline=2), 8, [0, 2]),
        (Parallelism(tensor=8), 8, [0]),
        (Parallelism(tensor=8), 32, [0, 8, 16, 24]),
        (Parallelism(), 4, [0, 1, 2, 3]),
        (Parallelism(tensor=4, pipeline=2), 16, [0, 4]),
        (Parallelism(tensor=8, pipeline=2), 16, [0]),
        (Parallelism(pipeline=4), 8, [0, 1]),
        # CP > 1: every CP rank of the first stage has tp_rank 0, so frontends = DP x CP.
        (Parallelism(tensor=2, context=2), 8, [0, 2, 4, 6]),
    ],
    ids=["tp2-pp2-w8", "tp8-w8", "tp8-w32", "tp1-w4", "tp4-pp2-w16", "tp8-pp2-w16", "pp4-w8", "tp2-cp2-w8"],
)
def test_frontend_ranks(parallelism: Parallelism, world_size: int, expected: list[int]) -> None:
    ranks = planner.frontend_ranks(parallelism, world_size)
    assert list(ranks) == expected
    data_parallel = world_size // parallelism.shard_size
    coords = planner.rank_coordinates(parallelism, data_parallel)
    assert [c.rank for c in coords if c.tp == 0 and c.pp == 0] == expected


@pytest.mark.parametrize(
    ("parallelism", "world_size"),
    [(Parallelism(tensor=2, pipeline=2), 6), (Parallelism(tensor=8), 0), (Parallelism(tensor=0), 8)],
    ids=["not-multiple", "empty-world", "tp0"],
)
def test_frontend_ranks_rejects(parallelism: Parallelism, world_size: int) -> None:
    with pytest.raises(ValueError):
        planner.frontend_ranks(parallelism, world_size)


@pytest.mark.parametrize(
    ("parallelism", "gpus_per_node", "expected"),
    [
        (Parallelism(), 0, PodLayout(pods_per_shard=1, gpus_per_pod=0, ranks_per_pod=1)),
        (Parallelism(), 8, PodLayout(pods_per_shard=1, gpus_per_pod=1, ranks_per_pod=1)),
        (Parallelism(tensor=4), 8, PodLayout(pods_per_shard=1, gpus_per_pod=4, ranks_per_pod=4)),
        (Parallelism(tensor=8), 8, PodLayout(pods_per_shard=1, gpus_per_pod=8, ranks_per_pod=8)),
        (Parallelism(tensor=8, pipeline=2), 8, PodLayout(pods_per_shard=2, gpus_per_pod=8, ranks_per_pod=8)),
        (Parallelism(tensor=16), 4, PodLayout(pods_per_shard=4, gpus_per_pod=4, ranks_per_pod=4)),
        (Parallelism(tensor=3), 8, PodLayout(pods_per_shard=1, gpus_per_pod=3, ranks_per_pod=3)),
    ],
    ids=["cpu", "tp1-g8", "tp4-g8", "tp8-g8", "tp8-pp2-g8", "tp16-gb200", "tp3-g8-validation-decides"],
)
def test_pod_layout(parallelism: Parallelism, gpus_per_node: int, expected: PodLayout) -> None:
    assert planner.pod_layout(parallelism, gpus_per_node) == expected


@pytest.mark.parametrize(
    ("parallelism", "gpus_per_node", "match"),
    [
        (Parallelism(tensor=2), 0, "CPU shard runs one rank"),
        (Parallelism(tensor=4, pipeline=3), 8, "not a whole number"),
        (Parallelism(), -1, "must not be negative"),
        (Parallelism(pipeline=0), 8, "at least 1"),
    ],
    ids=["cpu-tp2", "12-on-8", "negative-gpus", "pp0"],
)
def test_pod_layout_rejects(parallelism: Parallelism, gpus_per_node: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        planner.pod_layout(parallelism, gpus_per_node)


def test_ranks_of_pod_are_contiguous() -> None:
    layout = planner.pod_layout(Parallelism(tensor=16), 4)
    spans = [layout.ranks_of_pod(p) for p in range(4)]
    assert [(r.start, r.stop) for r in spans] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    with pytest.raises(ValueError, match="outside"):
        layout.ranks_of_pod(4)


@pytest.mark.parametrize(
    ("parallelism", "gpus_per_node", "expected"),
    [
        (Parallelism(tensor=16), 4, True),
        (Parallelism(tensor=8), 8, False),
        (Parallelism(tensor=8, pipeline=2), 8, False),
        (Parallelism(tensor=4, expert=8), 4, True),
        (Parallelism(tensor=2, context=4), 4, True),
        (Parallelism(), 0, False),
    ],
    ids=["tp16-g4", "tp8-g8", "tp8-pp2-g8", "ep8-g4", "tp2-cp4-g4", "cpu"],
)
def test_needs_clique(parallelism: Parallelism, gpus_per_node: int, expected: bool) -> None:
    assert planner.needs_clique(parallelism, gpus_per_node) is expected


@pytest.mark.parametrize(
    ("trainer", "live", "shard_size", "expected"),
    [
        (8, [0, 1, 2], 4, Membership(world_size=20, trainer_world_size=8, offsets={0: 8, 1: 12, 2: 16})),
        (8, [0, 2], 4, Membership(world_size=16, trainer_world_size=8, offsets={0: 8, 2: 12})),
        (8, [2, 0], 4, Membership(world_size=16, trainer_world_size=8, offsets={0: 8, 2: 12})),
        (1, [3], 16, Membership(world_size=17, trainer_world_size=1, offsets={3: 1})),
        (4, [], 8, Membership(world_size=4, trainer_world_size=4, offsets={})),
    ],
    ids=["all-live", "dead-shard-leaves-no-gap", "order-free", "single", "none-live"],
)
def test_rank_offsets(trainer: int, live: list[int], shard_size: int, expected: Membership) -> None:
    assert planner.rank_offsets(trainer, live, shard_size) == expected


@pytest.mark.parametrize(
    ("trainer", "live", "shard_size", "match"),
    [
        (8, [1, 1], 4, "duplicates"),
        (8, [-1], 4, "negative"),
        (0, [0], 4, "trainer_world_size"),
        (8, [0], 0, "shard_size"),
    ],
    ids=["duplicate", "negative", "no-trainer", "empty-shard"],
)
def test_rank_offsets_rejects(trainer: int, live: list[int], shard_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        planner.rank_offsets(trainer, live, shard_size)
