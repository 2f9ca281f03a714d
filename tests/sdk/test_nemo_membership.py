"""NeMo RL's refit membership and fleet health over a fleet, against a fake operator
(:class:`helpers.nemo_fakes.FakeOperator`): ``set_refit_membership`` with NeMo's packing, the rebuilt
ranks of the live shards (``_refit_ranked_workers``), ``rebuild_collective`` as a new RefitSession of
exactly those shards after a lost member broke the old one, and NeMo's fleet-health monitor fed from
the fleet's shard states (``attach_fleet_health``). The monitor and the membership are
:mod:`helpers.nemo_fleet_health`'s stand-ins, written from NeMo RL's contract.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers import nemo_reshard_trainer
from helpers.nemo_fakes import FLEET, NAMESPACE, FakeOperator, fleet_object, install
from helpers.nemo_fleet_health import Monitor, RefitMembership, ShardState, plan_refit_membership
from megafleet.sdk import errors, nemo
from megafleet.sdk.nemo import fleet_health, refit_wire_nemo

INFO = {"model.embed_tokens.weight": ((64, 16), torch.float32), "lm_head.weight": ((64, 16), torch.float32)}


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(refit_wire_nemo, "POLL_SECONDS", 0.01)


@pytest.fixture
def operator(monkeypatch: pytest.MonkeyPatch) -> FakeOperator:
    return install(monkeypatch, fleet_object(replicas=3))


@pytest.fixture
def generation_(operator: FakeOperator) -> Iterator[nemo.MegafleetGeneration]:
    made = nemo.nemo_factory(FLEET, NAMESPACE, trainer_bucket_bytes=4096)(config={"generation": {"_pad_token_id": 0}})
    yield made
    made.shutdown()


def sessions(operator: FakeOperator) -> list[dict[str, Any]]:
    return operator.of("RefitSession")


def test_a_lost_member_breaks_the_session_and_the_trainers_rebuild_goes_on_with_the_survivors(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    generation_.prepare_refit_info(INFO)
    generation_.init_collective("10.0.0.1", 29500, 5, train_world_size=2)  # 3 shards x 1 rank
    generation_.update_weights_from_collective()
    (first,) = sessions(operator)
    assert "shards" not in first["spec"], "every shard until NeMo names a membership"

    operator.break_with = ("MemberLost", "shard 1, pod tiny-s1-p0 restarted")
    with pytest.raises(errors.RefitFailed, match="MemberLost"):
        generation_.update_weights_from_collective()

    # NeMo's recovery: plan over the survivors, record it, rebuild on a fresh port, send the refit info again
    operator.break_with = None
    membership = plan_refit_membership([2, 0], per_shard=1, train_world_size=2)
    generation_.set_refit_membership(membership)
    assert [(w.shard, w.rank, w.original_rank) for w in generation_._refit_ranked_workers()] == [(0, 0, 0), (2, 1, 2)]
    generation_.rebuild_collective(membership, "10.0.0.1", 29600)
    generation_.prepare_refit_info(INFO)
    generation_.update_weights_from_collective()

    (rebuilt,) = sessions(operator)
    assert rebuilt["metadata"]["name"] != first["metadata"]["name"], "the broken session is gone"
    assert rebuilt["spec"]["shards"] == [0, 2]
    world = rebuilt["spec"]["nemoCollective"]
    assert (world["port"], world["worldSize"], world["trainerWorldSize"]) == (29600, 4, 2)
    assert rebuilt["spec"]["refitInfo"]["tensors"] == len(INFO)

    # the lost shard healed: NeMo's next rebuild takes every shard again
    everyone = plan_refit_membership([0, 1, 2], per_shard=1, train_world_size=2)
    generation_.rebuild_collective(everyone, "10.0.0.1", 29700)
    (back,) = sessions(operator)
    assert back["spec"]["shards"] == [0, 1, 2] and back["spec"]["nemoCollective"]["worldSize"] == 5


def test_memberships_nemo_would_not_make_or_the_fleet_cannot_field_are_refused_before_anything_is_made(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    gap = RefitMembership(4, 2, {0: 0, 2: 2}, 1)  # a hole where shard 1 was: NeMo never packs so
    with pytest.raises(ValueError, match="not NeMo's packing"):
        generation_.set_refit_membership(gap)
    outside = plan_refit_membership([0, 3], per_shard=1, train_world_size=2)
    with pytest.raises(ValueError, match=r"names shards \[3\]"):
        generation_.rebuild_collective(outside, "10.0.0.1", 29600)
    wide = plan_refit_membership([0, 1], per_shard=2, train_world_size=2)  # the fleet's shards have 1 rank
    with pytest.raises(ValueError, match="membership's 2 shards x 1 ranks"):
        generation_.rebuild_collective(wide, "10.0.0.1", 29600)
    assert sessions(operator) == []


def shard_states(operator: FakeOperator, *phases: tuple[str, int | None]) -> None:
    fleet = operator.objects[("MegatronGeneration", NAMESPACE, FLEET)]
    fleet["status"]["replicas"] = len(phases)
    fleet["status"]["shards"] = [
        {"index": index, "phase": phase, **({} if version is None else {"weightVersion": version})}
        for index, (phase, version) in enumerate(phases)
    ]


def test_nemos_monitor_learns_the_fleets_shard_states_and_a_healed_shard_is_healthy_only_after_a_refit(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    monitor = Monitor(3)
    shard_states(operator, ("Ready", 4), ("Starting", None), ("Ready", 4))
    generation_.attach_fleet_health(monitor, selector=object())
    assert monitor.state_of(1) is ShardState.RESTARTING and monitor.state_of(0) is ShardState.HEALTHY

    shard_states(operator, ("Ready", 4), ("Stale", None), ("Ready", 4))  # healed, no weights yet
    generation_.sync_fleet_health()
    assert monitor.state_of(1) is ShardState.STALE
    generation_.sync_fleet_health()
    assert monitor.calls.count(("mark_loaded", 1)) == 1, "told once"

    generation_.prepare_refit_info(INFO)
    generation_.init_collective("10.0.0.1", 29500, 5, train_world_size=2)
    operator.on_succeeded = lambda version: shard_states(
        operator, ("Ready", version), ("Ready", version), ("Ready", version)
    )
    generation_.update_weights_from_collective()  # syncs after the refit
    assert monitor.state_of(1) is ShardState.HEALTHY and ("report_refit", 1) in monitor.calls

    with pytest.raises(ValueError, match="tracks 2 shards but the fleet has 3"):
        generation_.attach_fleet_health(Monitor(2), selector=object())


@pytest.mark.parametrize(
    ("phase", "version", "state", "event"),
    [
        ("Starting", None, "healthy", "restarting"),
        ("Failed", None, "dead", "restarting"),
        ("Loading", None, "restarting", None),
        ("Stale", 3, "restarting", "loaded"),
        ("Ready", 3, "healthy", "loaded"),  # serving an older version than the fleet's: out of service
        ("Ready", 4, "stale", "refit"),
        ("Ready", 4, "suspect", "alive"),
        ("Ready", 4, "retired", None),
    ],
)
def test_each_shard_phase_tells_nemos_monitor_what_nemos_rule_allows(
    phase: str, version: int | None, state: str, event: str | None
) -> None:
    assert fleet_health.monitor_event(phase, version, 4, state) == event


def test_nemos_reshard_refit_info_is_read_and_checked_against_the_fleets_ranks(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(4),
    }
    fits = nemo_reshard_trainer.Layout(pp=1, tp=2, gen_ranks=3, gen_tp=1, layers=1)
    generation_.init_collective("10.0.0.1", 29500, 5, train_world_size=2)  # the fleet's ranks are known now
    generation_.prepare_nccl_reshard_refit_info(nemo_reshard_trainer.refit_info(weights, fits))
    other = dataclasses.replace(fits, gen_ranks=2)
    with pytest.raises(ValueError, match="built for 2 inference ranks; the fleet has 3"):
        generation_.prepare_nccl_reshard_refit_info(nemo_reshard_trainer.refit_info(weights, other))
    grouped = nemo_reshard_trainer.refit_info(weights, fits)
    grouped["per_layer_params"]["model.layers.0"][0]["grouped_expert_proj"] = "up_proj"
    with pytest.raises(ValueError, match="grouped MoE experts"):
        generation_.prepare_nccl_reshard_refit_info(grouped)
    with pytest.raises(RuntimeError, match=r"call init_nccl_reshard_comm_group\(...\) and prepare_nccl_reshard"):
        generation_.nccl_reshard_refit()  # the stages first (tests/sdk/test_nemo_reshard_sdk.py)
