"""The pure parts of the engine's NeMo M-to-N reshard refits, as tables: whether NeMo's refit info fits
what a rank holds (:func:`~megafleet_engine.refit_attempts.sources.nemo_reshard.check_layout`), each
rank's place in the stage communicators, the agent's join body, and how a pod's ranks' memberships of
the stages combine into its answer. The transfer itself is proven against a NeMo-style trainer in
tests/refit/test_refit_nemo_reshard.py (protocol) and test_refit_nemo_reshard_agent.py (engines).
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
import torch

from helpers import nemo_reshard_trainer as trainer
from megafleet_engine import siblings
from megafleet_engine.refit_attempts import memberships, reports, reshard_stages
from megafleet_engine.refit_attempts.sources import nemo_reshard
from megafleet_protocol import agent_api
from megafleet_protocol.refit import nemo_reshard_info, wire

GATE, DOWN = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"
WEIGHTS = {
    GATE: torch.zeros(8, 4, dtype=torch.bfloat16),
    DOWN: torch.zeros(4, 8, dtype=torch.bfloat16),
    NORM: torch.zeros(4),
}
FULL = {name: tuple(tensor.shape) for name, tensor in WEIGHTS.items()}


def info(gen_ranks: int, gen_tp: int) -> nemo_reshard_info.ReshardInfo:
    """NeMo's refit info of :data:`WEIGHTS` from one stage of TP 2 into ``gen_ranks`` of TP ``gen_tp``."""
    layout = trainer.Layout(pp=1, tp=2, gen_ranks=gen_ranks, gen_tp=gen_tp, layers=1)
    return nemo_reshard_info.ReshardInfo.parse(trainer.refit_info(WEIGHTS, layout))


def whole(*names: str) -> list[wire.Region]:
    return [wire.Region.whole(name) for name in names]


Expected = str | list[wire.Region]
"""The misfit's message, or the regions the rank receives of the bulk (in the trainer's order)."""
LAYOUTS: dict[str, tuple[nemo_reshard_info.ReshardInfo, int, list[wire.Region], dict[str, Any], Expected]] = {
    # name: (refit info, stage rank, regions held, full shapes held, expected)
    "replicas holding whole tensors get whole boxes": (
        info(2, 1),
        3,
        whole(GATE, DOWN, NORM),
        FULL,
        whole(GATE, DOWN),
    ),
    "a TP rank holding its rows of gate and columns of down": (
        info(2, 2),
        3,
        [wire.Region(GATE, 0, 4, 8), wire.Region(DOWN, 1, 4, 8), *whole(NORM)],
        FULL,
        [wire.Region(GATE, 0, 4, 8), wire.Region(DOWN, 1, 4, 8)],
    ),
    "a rank holding more than its box (planned for TP 2, it is TP 1)": (
        info(2, 2),
        2,
        whole(GATE, DOWN, NORM),
        FULL,
        "another inference layout",
    ),
    "a TP rank holding the other half": (
        info(2, 2),
        2,
        [wire.Region(GATE, 0, 4, 8), wire.Region(DOWN, 1, 4, 8), *whole(NORM)],
        FULL,
        r"gives rank 2 \[0, 4\) of dimension 0 of model.layers.0.mlp.gate_proj.weight, but this rank keeps \[4, 8\)",
    ),
    "a tensor that is neither bulk nor misc": (
        info(2, 1),
        2,
        whole(GATE, DOWN, NORM, "lm_head.weight"),
        {**FULL, "lm_head.weight": (11, 4)},
        "its misc tensors: the trainer's refit info lacks 1 parameters",
    ),
    "a bulk tensor of another shape": (info(2, 1), 2, whole(GATE, DOWN, NORM), {**FULL, GATE: (16, 4)}, "holds shape"),
    "a rank outside the destination mesh": (info(2, 1), 4, whole(GATE, DOWN, NORM), FULL, "not in its destination"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_refit_info_fits_only_a_rank_whose_boxes_cover_what_it_keeps(name: str) -> None:
    parsed, rank, held, required, expected = LAYOUTS[name]
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            nemo_reshard.check_layout(parsed, rank, held, required)
        return
    receives = nemo_reshard.check_layout(parsed, rank, held, required)
    assert [entry.region for entry in receives] == expected


JOIN = reshard_stages.StageJoinRequest(
    session="s", stages=(("10.0.0.1", 100), ("10.0.0.2", 200)), trainer_ranks_per_stage=2, sub_world_size=6,
    rank_offset=4,
)  # fmt: skip


@pytest.mark.parametrize(
    ("local_rank", "rank"), [(0, 4), (1, 5), (2, None)], ids=["first", "second", "past the stages' ranks"]
)
def test_a_shard_rank_is_the_same_rank_in_every_stage_communicator(local_rank: int, rank: int | None) -> None:
    if rank is None:
        with pytest.raises(ValueError, match=r"not an inference rank of the stage communicators: those are 2 \.\. 5"):
            JOIN.worlds(local_rank)
        return
    worlds = JOIN.worlds(local_rank)
    assert [(w.stage, w.address, w.port, w.world_size, w.rank, w.train_ranks) for w in worlds] == [
        (0, "10.0.0.1", 100, 6, rank, 2),
        (1, "10.0.0.2", 200, 6, rank, 2),
    ]


@pytest.mark.parametrize(
    ("offset", "ok"), [(2, True), (5, True), (1, False), (6, False)], ids=["first", "last", "trainer's", "past"]
)
def test_the_agents_join_body_takes_only_an_inference_rank_offset(offset: int, ok: bool) -> None:
    body = {
        "session": "s",
        "stages": [{"address": "10.0.0.1", "port": 100}],
        "trainerRanksPerStage": 2,
        "subWorldSize": 6,
        "rankOffset": offset,
    }
    if not ok:
        with pytest.raises(pydantic.ValidationError, match="not an inference rank of a stage communicator"):
            agent_api.NemoReshardJoinRequest.model_validate(body)
        return
    parsed = reshard_stages.StageJoinRequest.of(agent_api.NemoReshardJoinRequest.model_validate(body), "10.0.1.1")
    assert (parsed.stages, parsed.rank_offset, parsed.local_address) == ((("10.0.0.1", 100),), offset, "10.0.1.1")


def world(rank: int, reshard: dict[str, Any] | None) -> dict[str, Any]:
    return {"session": "s", "phase": "joined", "rank": rank, "reshard": reshard}


def stages(rank: int, phase: str = "joined", error: str | None = None) -> dict[str, Any]:
    return {"phase": phase, "stages": 2, "rank": rank, "error": error}


COMBINED: dict[str, tuple[list[dict[str, Any]], dict[str, Any] | None]] = {
    "no rank joined stages": ([world(4, None), world(5, None)], None),
    "every rank joined": ([world(4, stages(2)), world(5, stages(3))], stages(2)),
    "one still joining": ([world(4, stages(2)), world(5, stages(3, "joining"))], stages(2, "joining")),
    "one failed": (
        [world(4, stages(2)), world(5, stages(3, "failed", "store timeout"))],
        stages(2, "failed", "rank 3: store timeout"),
    ),
    "one never asked": (
        [world(4, stages(2)), world(5, None)],
        stages(2, "failed", "a rank of this pod has not joined the stage communicators"),
    ),
}


@pytest.mark.parametrize("name", sorted(COMBINED))
def test_a_pods_stage_membership_is_its_least_advanced_ranks(name: str) -> None:
    ranks, expected = COMBINED[name]
    combined = siblings.combine_world(ranks)
    assert combined is not None and combined["phase"] == "joined"
    assert combined.get("reshard") == expected


def test_the_refit_status_shows_the_stages_with_nemos_world_and_a_joined_megatron_group_first() -> None:
    nemo = memberships.WorldSnapshot("s", "joined", 4, "nemo", reshard=memberships.ReshardSnapshot("joined", 2, 2))
    megatron = memberships.WorldSnapshot("m", "joined", 4)
    assert reports.shown_world(None, nemo) == (nemo, "nemo")
    assert reports.shown_world(megatron, nemo) == (megatron, "megatron")
    assert reports.shown_world(memberships.WorldSnapshot("m", "left", 4), nemo) == (nemo, "nemo")
    shown = reports.world(nemo)
    assert shown is not None and shown.reshard == agent_api.NemoReshardStatus(phase="joined", stages=2, rank=2)
