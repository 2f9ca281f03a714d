"""NeMo RL's M-to-N reshard through the adapter, in the order NeMo's ``NcclReshardWeightSynchronizer``
calls it (written from its contract: ``init_communicator`` then ``sync_weights``, on main and on the
membership line where every build is a rebuild over a membership), against a fake operator
(:class:`helpers.nemo_fakes.FakeOperator`): the stages become the session's ``nemoReshard`` and the
call returns once the members joined them, the refit info is stored for the operator, each
``nccl_reshard_refit`` is one Refit through the session whose refs ``ray.get`` to ``True``, and a
rebuild over the survivors makes a new session with its own stages and info. The members' side (the
engines' routes) is tests/refit/test_refit_nemo_reshard_agent.py's; the operator's is
tests/unit/refits/test_session_reshard.py's.
"""

from __future__ import annotations

import base64
import gzip
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers import nemo_reshard_trainer as trainer
from helpers.nemo_fakes import FLEET, NAMESPACE, FakeOperator, fleet_object, install
from megafleet.sdk import errors, nemo
from megafleet.sdk.nemo import refit_wire_nemo

WEIGHTS = {
    "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
    "model.layers.1.mlp.up_proj.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
    "model.norm.weight": torch.zeros(4),
}
IP, PORT = "10.0.0.1", 29500
STAGE_IPS, STAGE_PORTS = ["10.0.0.1", "10.0.0.2"], [29600, 29601]


class Membership:
    """NeMo's ``RefitMembership``: survivors packed contiguously after the trainer's ranks."""

    def __init__(self, survivors: list[int], *, train_world_size: int = 2) -> None:
        self.shard_prefixes = {shard: position for position, shard in enumerate(sorted(survivors))}
        self.workers_per_shard = 1
        self.train_world_size = train_world_size
        self.world_size = train_world_size + len(survivors)


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


def wire_info(gen_ranks: int = 3) -> dict[str, Any]:
    """What the synchronizer hands to ``prepare_nccl_reshard_refit_info``: 2 stages of 1 trainer rank."""
    return trainer.refit_info(WEIGHTS, trainer.Layout(pp=2, tp=1, gen_ranks=gen_ranks, gen_tp=1, layers=2))


def init_communicator(generation_: nemo.MegafleetGeneration, survivors: list[int] | None = None) -> None:
    """The synchronizer's ``init_communicator`` (main: the whole fleet) or ``_build(membership)``
    (the membership line), with the trainer's futures left out (they run on its side)."""
    inference = 3 if survivors is None else len(survivors)
    stages: dict[str, Any] = {
        "pp_ips": STAGE_IPS,
        "pp_ports": STAGE_PORTS,
        "pp_size": 2,
        "train_ranks_per_stage": 1,
        "sub_world_size": 1 + inference,
    }
    if survivors is None:
        assert generation_.init_collective(IP, PORT, 2 + inference, train_world_size=2) == [True]
        assert generation_.init_nccl_reshard_comm_group(**stages) == [True]
    else:
        membership = Membership(survivors)
        generation_.set_refit_membership(membership)
        assert generation_.rebuild_collective(membership, IP, PORT + 1) == [True]
        assert generation_.rebuild_nccl_reshard_comm_group(membership, **stages) == [True]
    generation_.prepare_nccl_reshard_refit_info(wire_info(inference))


def sync_weights(generation_: nemo.MegafleetGeneration) -> bool:
    """The synchronizer's ``sync_weights``: its success rule over the generation side's results."""
    results = generation_.nccl_reshard_refit(refit_timeout_s=30)
    return all(result for result in results if result is not None)


def stored(operator: FakeOperator, session: dict[str, Any]) -> Any:
    reference = session["spec"]["nemoReshard"]["refitInfo"]
    config_map = operator.objects[("ConfigMap", NAMESPACE, reference["configMapRef"]["name"])]
    return json.loads(gzip.decompress(base64.b64decode(config_map["binaryData"][reference["configMapRef"]["key"]])))


def test_the_synchronizers_order_joins_the_stages_stores_the_info_and_refits_through_the_session(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    init_communicator(generation_)
    assert sync_weights(generation_) and sync_weights(generation_)

    (session,) = operator.of("RefitSession")
    assert session["spec"]["nemoReshard"] | {"refitInfo": None} == {
        "stages": [{"address": "10.0.0.1", "port": 29600}, {"address": "10.0.0.2", "port": 29601}],
        "trainerRanksPerStage": 1,
        "subWorldSize": 4,
        "refitInfo": None,
    }
    assert session["spec"]["nemoReshard"]["refitInfo"]["tensors"] == 3  # two bulk, one misc
    assert stored(operator, session) == wire_info()
    assert "refitInfo" not in session["spec"], "NeMo's reshard sends no collective refit info"
    refits = operator.of("Refit")
    assert [refit["spec"]["source"] for refit in refits] == [{"session": {"name": session["metadata"]["name"]}}] * 2
    assert sorted(refit["spec"]["version"] for refit in refits) == [5, 6]
    assert generation_.weight_version == 6

    with pytest.raises(RuntimeError, match="receives NeMo's M-to-N reshard"):
        generation_.update_weights_from_collective()


def test_the_membership_lines_rebuild_makes_a_new_session_with_its_own_stages_and_info(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    init_communicator(generation_, [0, 1, 2])  # the membership line builds through its rebuild, every shard
    assert sync_weights(generation_)
    operator.break_with = ("MemberLost", "shard 1, pod tiny-s1-p0 restarted")
    with pytest.raises(errors.RefitFailed, match="MemberLost"):
        sync_weights(generation_)

    operator.break_with = None
    init_communicator(generation_, [0, 2])  # reconcile_communicator: rebuild over the survivors
    assert sync_weights(generation_)

    (rebuilt,) = [s for s in operator.of("RefitSession") if s["status"].get("phase") != "Broken"]
    assert rebuilt["spec"]["shards"] == [0, 2] and rebuilt["spec"]["nemoCollective"]["port"] == PORT + 1
    assert rebuilt["spec"]["nemoReshard"]["subWorldSize"] == 3
    assert stored(operator, rebuilt)["gen_world_size"] == 2, "the regenerated plan, sized for the survivors"


def test_stages_that_do_not_fit_the_sessions_world_are_refused_before_anything_changes(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    with pytest.raises(RuntimeError, match="call init_collective"):
        generation_.init_nccl_reshard_comm_group(
            pp_ips=STAGE_IPS, pp_ports=STAGE_PORTS, pp_size=2, train_ranks_per_stage=1, sub_world_size=4
        )
    generation_.init_collective(IP, PORT, 5, train_world_size=2)
    with pytest.raises(ValueError, match="subWorldSize 5 must be trainerRanksPerStage 1 plus the fleet's 3 ranks"):
        generation_.init_nccl_reshard_comm_group(
            pp_ips=STAGE_IPS, pp_ports=STAGE_PORTS, pp_size=2, train_ranks_per_stage=1, sub_world_size=5
        )
    with pytest.raises(ValueError, match="pp_size 3 stages, but 2 pp_ips"):
        generation_.init_nccl_reshard_comm_group(
            pp_ips=STAGE_IPS, pp_ports=STAGE_PORTS, pp_size=3, train_ranks_per_stage=1, sub_world_size=4
        )
    (session,) = operator.of("RefitSession")
    assert "nemoReshard" not in session["spec"]
    with pytest.raises(RuntimeError, match="before nccl_reshard_refit"):
        generation_.nccl_reshard_refit()
    assert operator.of("Refit") == []


def test_the_info_given_before_the_stages_is_stored_once_they_are_joined(
    operator: FakeOperator, generation_: nemo.MegafleetGeneration
) -> None:
    generation_.init_collective(IP, PORT, 5, train_world_size=2)
    generation_.prepare_nccl_reshard_refit_info(wire_info())
    (session,) = operator.of("RefitSession")
    assert "nemoReshard" not in session["spec"]
    generation_.init_nccl_reshard_comm_group(
        pp_ips=STAGE_IPS, pp_ports=STAGE_PORTS, pp_size=2, train_ranks_per_stage=1, sub_world_size=4
    )
    (session,) = operator.of("RefitSession")
    assert stored(operator, session) == wire_info()
    assert sync_weights(generation_)
