"""NeMo RL's in-flight refits through the adapter, from NeMo RL's contract, without NeMo RL, engines or
a control plane (docs/nemo-rl.md, "Refits while NeMo RL generates"; proposal 0003, section 10).

NeMo RL's async GRPO (``nemo_rl/algorithms/async_utils/trajectory_collector.py`` and
``algorithms/grpo.py`` at NVIDIA-NeMo/RL 7ea279a) refits in this order: the collector's
``prepare_for_refit`` (waits for its pending generations unless the engine is async and
``in_flight_weight_updates`` is on), the driver's ``update_weights_from_collective``, the
collector's ``set_weight_version`` and ``resume_after_refit`` (``invalidate_kv_cache()`` with
``recompute_kv_cache_after_weight_updates``). :class:`helpers.nemo_collector.Collector` plays the
collector over a pickled copy of the adapter, :mod:`helpers.nemo_fakes` the API server, the
operator and a frontend whose answers span the refit that lands while they run. Covered: where the
flags are read and in which order, what every Refit asks for on both wires, ``invalidate_kv_cache``
from the last Refit's status, the outputs and counters of samples that span a refit.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pydantic
import pytest
import torch

from helpers import nemo_collector
from helpers.nemo_fakes import FLEET, NAMESPACE, FakeOperator, SpanFrontend, fleet_object, install
from megafleet.sdk import generation, nemo
from megafleet.sdk.nemo import async_flags, batching, kv_invalidation, refit_wire_nemo
from megafleet.sdk.nemo import generation_counters as counters

MIB = 1024 * 1024
INFO = {"model.embed_tokens.weight": ([64, 16], "float32"), "lm_head.weight": ([64, 16], "float32")}
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
TOKENS = 8  # max_new_tokens; the frontend's answers switch versions after 3 tokens
CURRENT = 4  # the fake fleet's status.refit.currentVersion


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # results are plain booleans here
    monkeypatch.setattr(refit_wire_nemo, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(nemo.MegafleetGeneration, "_validated_flags", None)  # validate_settings' memory


@pytest.fixture
def made() -> Iterator[list[nemo.MegafleetGeneration]]:
    adapters: list[nemo.MegafleetGeneration] = []
    yield adapters
    for adapter in adapters:
        adapter.shutdown()


def grpo_master(in_flight: bool, recompute: bool, *, enabled: bool = True) -> dict[str, Any]:
    """NeMo RL's master config for async GRPO with the MegatronGeneration backend (as a mapping)."""
    return {
        "policy": {"generation": {"backend": "megatron", "max_new_tokens": TOKENS, "_pad_token_id": 0}},
        "grpo": {
            "async_grpo": {
                "enabled": enabled,
                "in_flight_weight_updates": in_flight,
                "recompute_kv_cache_after_weight_updates": recompute,
            }
        },
    }


class AsyncGRPOConfig(pydantic.BaseModel, extra="allow"):
    """NeMo RL's ``AsyncGRPOConfig`` (grpo.py:184-198), its defaults."""

    enabled: bool = False
    in_flight_weight_updates: bool = False
    recompute_kv_cache_after_weight_updates: bool = False


class GRPOConfig(pydantic.BaseModel, extra="allow"):
    async_grpo: AsyncGRPOConfig | None = pydantic.Field(default_factory=AsyncGRPOConfig)


class AsyncRLConfig(pydantic.BaseModel, extra="allow"):
    """The single controller's ``AsyncRLConfig`` (single_controller_utils/config.py:391-419), in part."""

    recompute_kv_cache_after_weight_updates: bool = False
    generation_fleet_health: dict[str, Any] = pydantic.Field(default_factory=dict)


class MasterConfig(pydantic.BaseModel, extra="allow"):
    """NeMo RL's pydantic ``MasterConfig``, the parts the adapter reads (attribute access)."""

    policy: dict[str, Any]
    grpo: GRPOConfig = pydantic.Field(default_factory=GRPOConfig)


class SingleControllerMasterConfig(MasterConfig):
    async_rl: AsyncRLConfig = pydantic.Field(default_factory=AsyncRLConfig)


def adapter(made: list[nemo.MegafleetGeneration], **options: Any) -> nemo.MegafleetGeneration:
    generation_config = options.pop("generation", {})
    config = {"generation": {"max_new_tokens": TOKENS, "_pad_token_id": 0, "temperature": 1.0, **generation_config}}
    made.append(nemo.nemo_factory(FLEET, NAMESPACE, **options)(config=config))
    return made[-1]


def joined(generation_: nemo.MegafleetGeneration) -> nemo.MegafleetGeneration:
    """GRPO's setup on the NeMo wire: wake, join NeMo's world, hand over the refit info."""
    generation_.prepare_for_generation()
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    generation_.prepare_refit_info(INFO)
    return generation_


def refit_specs(operator: FakeOperator) -> list[dict[str, Any]]:
    """Each Refit's spec without its fleet, version and source: what it asks of the engines."""
    keep = ("fleetRef", "version", "source")
    return [{k: v for k, v in refit["spec"].items() if k not in keep} for refit in operator.of("Refit")]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# -- where the flags come from --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("master_config", "expected"),
    [
        (grpo_master(True, True), (True, True, "grpo.async_grpo")),
        (grpo_master(True, False), (True, False, "grpo.async_grpo")),
        (grpo_master(False, True), (False, True, "grpo.async_grpo")),
        (grpo_master(True, True, enabled=False), (False, True, "grpo.async_grpo")),  # sync GRPO generates no refit
        ({"grpo": {"async_grpo": None}}, None),
        ({"policy": {}}, None),
        (
            {**grpo_master(False, False), "async_rl": {"recompute_kv_cache_after_weight_updates": True}},
            (True, True, "async_rl (NeMo RL's single controller)"),
        ),
        (
            MasterConfig(
                policy={}, grpo=GRPOConfig(async_grpo=AsyncGRPOConfig(enabled=True, in_flight_weight_updates=True))
            ),
            (True, False, "grpo.async_grpo"),
        ),
        (MasterConfig(policy={}), (False, False, "grpo.async_grpo")),  # NeMo's defaults, read from its model
        (
            SingleControllerMasterConfig(
                policy={}, async_rl=AsyncRLConfig(recompute_kv_cache_after_weight_updates=False)
            ),
            (True, False, "async_rl (NeMo RL's single controller)"),
        ),
    ],
    ids=[
        "both",
        "in-flight",
        "recompute",
        "async-off",
        "no-async-grpo",
        "no-grpo",
        "single-controller",
        "pydantic",
        "pydantic-defaults",
        "pydantic-single-controller",
    ],
)
def test_the_flags_of_nemos_master_config_as_a_mapping_or_its_pydantic_model(
    master_config: Any, expected: tuple[bool, bool, str] | None
) -> None:
    flags = async_flags.from_master_config(master_config)
    found = (
        None
        if flags is None
        else (flags.in_flight_weight_updates, flags.recompute_kv_cache_after_weight_updates, flags.source)
    )
    assert found == expected


@pytest.mark.parametrize(
    ("config", "recompute"),
    [
        ({"mcore_generation_config": {"kv_cache_management_mode": "recompute"}}, True),
        ({"mcore_generation_config": {"kv_cache_management_mode": "persist"}}, False),
        ({"mcore_generation_config": {"kv_cache_management_mode": None}}, None),
        ({"mcore_generation_config": None}, None),
        ({}, None),
    ],
)
def test_the_generation_config_tells_only_the_kv_mode_nemos_setup_wrote(
    config: dict[str, Any], recompute: bool | None
) -> None:
    flags = async_flags.from_generation_config(config)
    assert (None if flags is None else flags.recompute_kv_cache_after_weight_updates) == recompute
    assert flags is None or flags.in_flight_weight_updates is False  # not in the generation config


@pytest.mark.parametrize(
    ("in_flight", "recompute", "spec", "options"),
    [
        (False, False, {"inFlight": "drain"}, {"in_flight": "drain"}),
        (True, False, {"inFlight": "keep"}, {"in_flight": "keep"}),
        (
            False,
            True,
            {"inFlight": "drain", "kvCacheMode": "recompute"},
            {"in_flight": "drain", "kv_cache_mode": "recompute"},
        ),
        (
            True,
            True,
            {"inFlight": "keep", "kvCacheMode": "recompute"},
            {"in_flight": "keep", "kv_cache_mode": "recompute"},
        ),
    ],
)
def test_in_flight_updates_keep_else_drain_and_the_recompute_flag_asks_for_kv_recompute(
    in_flight: bool, recompute: bool, spec: dict[str, str], options: dict[str, str]
) -> None:
    modes = async_flags.modes_for(async_flags.AsyncFlags(in_flight, recompute))
    assert modes.spec_fields() == spec and modes.fleet_options() == options


@pytest.mark.parametrize(
    ("factory", "validated", "generation_config", "spec"),
    [
        (None, None, {}, {"inFlight": "drain"}),
        (None, None, {"kv_cache_management_mode": "recompute"}, {"inFlight": "drain", "kvCacheMode": "recompute"}),
        (None, grpo_master(True, False), {"kv_cache_management_mode": "recompute"}, {"inFlight": "keep"}),
        (
            grpo_master(False, False),
            grpo_master(True, True),
            {"kv_cache_management_mode": "recompute"},
            {"inFlight": "drain"},
        ),
        (grpo_master(True, True), None, {}, {"inFlight": "keep", "kvCacheMode": "recompute"}),
    ],
    ids=["defaults", "generation-config", "validate-settings-first", "factory-first", "factory"],
)
def test_the_flags_come_from_the_factory_then_validate_settings_then_the_generation_config(
    monkeypatch: pytest.MonkeyPatch,
    made: list[nemo.MegafleetGeneration],
    factory: dict[str, Any] | None,
    validated: dict[str, Any] | None,
    generation_config: dict[str, Any],
    spec: dict[str, str],
) -> None:
    operator = install(monkeypatch, fleet_object())
    if validated is not None:
        nemo.MegafleetGeneration.validate_settings(validated)  # the development line, before setup builds it
    options: dict[str, Any] = {} if factory is None else {"master_config": factory}
    generation_ = joined(
        adapter(made, trainer_bucket_bytes=MIB, generation={"mcore_generation_config": generation_config}, **options)
    )
    generation_.update_weights_from_collective()
    generation_.suspend_for_refit()  # the Megatron synchronizer's order makes its Refit here
    generation_.update_weights_from_collective()
    generation_.resume_after_refit()
    assert refit_specs(operator) == [spec, spec]


def test_validate_settings_reads_nemos_pydantic_master_config_and_accepts_fleet_health() -> None:
    master = SingleControllerMasterConfig(policy={"generation": {"backend": "megatron"}})
    nemo.MegafleetGeneration.validate_settings(master)
    assert nemo.MegafleetGeneration.validated_flags() == async_flags.AsyncFlags(
        True, False, "async_rl (NeMo RL's single controller)"
    )
    # fleet health is served now (attach_fleet_health feeds NeMo's monitor); its async flags are read as before
    healthy = SingleControllerMasterConfig(policy={}, async_rl=AsyncRLConfig(generation_fleet_health={"enabled": True}))
    nemo.MegafleetGeneration.validate_settings(healthy)
    assert nemo.MegafleetGeneration.validated_flags() == async_flags.AsyncFlags(
        True, False, "async_rl (NeMo RL's single controller)"
    )


def test_the_cfg_keeps_nemos_kv_cache_management_mode_over_the_fleets(
    monkeypatch: pytest.MonkeyPatch, made: list[nemo.MegafleetGeneration]
) -> None:
    install(monkeypatch, fleet_object(kv_cache_mode="persist"), SpanFrontend(CURRENT))
    nemos = adapter(made, generation={"mcore_generation_config": {"kv_cache_management_mode": "recompute"}})
    fleets = adapter(made)
    for generation_ in (nemos, fleets):
        generation_.prepare_for_generation()  # reads the fleet's engine.kvCacheMode
    assert nemos.cfg["mcore_generation_config"]["kv_cache_management_mode"] == "recompute"  # NeMo's setup wrote it
    assert fleets.cfg["mcore_generation_config"]["kv_cache_management_mode"] == "persist"  # none given: the fleet's


# -- NeMo RL's async refit order, each flag combination, over the NeMo wire --------------------------


@pytest.mark.parametrize(
    ("in_flight", "recompute"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["drain", "keep-persist", "drain-recompute", "keep-recompute"],
)
def test_async_grpos_refit_order_with_each_flag_combination(
    monkeypatch: pytest.MonkeyPatch, made: list[nemo.MegafleetGeneration], in_flight: bool, recompute: bool
) -> None:
    frontend = SpanFrontend(CURRENT)
    operator = install(monkeypatch, fleet_object(kv_cache_mode="persist"), frontend)
    master = grpo_master(in_flight, recompute)
    driver = joined(adapter(made, trainer_bucket_bytes=MIB, master_config=master))
    copy_ = pickle.loads(pickle.dumps(driver))  # what the collector's actor holds
    made.append(copy_)
    collector = nemo_collector.Collector(copy_, master)
    collector.set_weight_version(CURRENT)
    frontend.hold.clear()  # the collector's generations run until the test lets them end
    first = collector.start(PROMPTS)
    wait_for(lambda: len(frontend.bodies) == len(PROMPTS), "the collector's requests")

    preparing = threading.Thread(target=collector.prepare_for_refit)
    preparing.start()
    preparing.join(timeout=0.3)
    if in_flight:  # no wait: NeMo's generations are still running when the Refit is made
        assert not preparing.is_alive() and collector.pending() == 1
    else:
        assert preparing.is_alive(), "NeMo waits for its pending generations before a drained refit"
        frontend.hold.set()
        preparing.join(timeout=10)
    second = collector.start(PROMPTS[:1])  # paused until resume_after_refit
    futures_inference = driver.update_weights_from_collective()
    assert len(frontend.bodies) == len(PROMPTS), "no generation starts while the refit pauses new starts"
    collector.set_weight_version(CURRENT + 1)
    collector.resume_after_refit()
    frontend.hold.set()
    rows, later = collector.finish(first), collector.finish(second)

    assert futures_inference == [True]
    expected_spec = {"inFlight": "keep" if in_flight else "drain"} | ({"kvCacheMode": "recompute"} if recompute else {})
    assert refit_specs(operator) == [expected_spec]
    assert collector.waited_for_generations == (0 if in_flight else 1)
    assert collector.invalidations == ([True] if recompute else [])  # asked only with the recompute flag
    assert collector.invalidate_kv_cache() is (not in_flight or recompute)  # kept with persist: the old KV serves on
    spanning = [CURRENT] * 3 + [CURRENT + 1] * (TOKENS - 3)
    for row in rows:
        assert row["token_weight_versions"] == (spanning if in_flight else [CURRENT] * TOKENS)
        assert (row["weight_version"], row["last_weight_version"]) == (CURRENT, CURRENT + (1 if in_flight else 0))
        assert row["generation_weight_version"] == CURRENT  # NeMo's own stamp: the version at the start
    assert [(row["token_weight_versions"], row["generation_weight_version"]) for row in later] == [
        ([CURRENT + 1] * TOKENS, CURRENT + 1)
    ]
    metrics = collector.metrics()
    assert metrics["megafleet/samples_spanning_refit"] == (len(PROMPTS) if in_flight else 0)
    assert metrics["megafleet/tokens_older_than_latest"] == (3 * len(PROMPTS) if in_flight else 0)


def test_engines_that_could_not_keep_drained_so_nothing_old_serves(
    monkeypatch: pytest.MonkeyPatch, made: list[nemo.MegafleetGeneration]
) -> None:
    operator = install(monkeypatch, fleet_object(kv_cache_mode="persist"))
    operator.cannot_keep = True  # e.g. KeepUnavailable: the Refit's status says it drained
    driver = joined(adapter(made, trainer_bucket_bytes=MIB, master_config=grpo_master(True, False)))
    driver.update_weights_from_collective()
    assert refit_specs(operator) == [{"inFlight": "keep"}]
    assert driver.invalidate_kv_cache() is True
    operator.cannot_keep = False
    driver.update_weights_from_collective()
    assert driver.invalidate_kv_cache() is False  # the last Refit kept with persist


def test_without_an_in_flight_report_the_fleets_kv_mode_answers_as_before(
    monkeypatch: pytest.MonkeyPatch, made: list[nemo.MegafleetGeneration]
) -> None:
    operator = install(monkeypatch, fleet_object(kv_cache_mode="recompute"))
    driver = joined(adapter(made, trainer_bucket_bytes=MIB))
    assert driver.invalidate_kv_cache() is True  # no Refit yet: engine.kvCacheMode recompute
    driver.update_weights_from_collective()
    with operator.lock:  # an operator that does not report status.inFlight
        for (kind, _, _), obj in operator.objects.items():
            if kind == "Refit":
                obj["status"].pop("inFlight")
    assert driver.invalidate_kv_cache() is True


# -- the megafleet wire: what reaches Fleet.refit --------------------------------------------------


def test_the_megafleet_wire_asks_fleet_refit_for_the_modes_and_so_does_a_checkpoint_refit(
    monkeypatch: pytest.MonkeyPatch, made: list[nemo.MegafleetGeneration]
) -> None:
    operator = install(monkeypatch, fleet_object(kv_cache_mode="persist"))
    generation_ = adapter(made, weights=lambda: iter(()), master_config=grpo_master(True, False))
    assert generation_.handle.refit_wire == "megafleet"
    generation_.prepare_for_generation()
    generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1)
    generation_.update_weights_from_collective()
    assert generation_.invalidate_kv_cache() is False  # kept, KV persisted
    generation_.update_weights_from_checkpoint("/checkpoints/step-6")
    clients = generation_._connect()
    fake: Any = clients.fleet
    assert [
        (version, {k: v for k, v in options.items() if k in ("in_flight", "kv_cache_mode")})
        for version, options in fake.refits
    ] == [
        (CURRENT + 1, {"in_flight": "keep"}),
        (CURRENT + 2, {"in_flight": "keep"}),
    ]
    assert refit_specs(operator) == [{"inFlight": "keep"}, {"inFlight": "keep"}]


# -- the answer, the last Refit, the outputs and counters of spanning samples ------------------------


@pytest.mark.parametrize(
    ("in_flight", "answer"),
    [
        ({"effective": "drain", "kvCacheMode": "persist"}, True),
        ({"effective": "abort"}, True),
        ({"requested": "keep", "effective": "keep", "kvCacheMode": "recompute"}, True),
        ({"requested": "keep", "effective": "keep", "kvCacheMode": "persist"}, False),
        ({"requested": "keep", "effective": "keep", "kvCacheMode": "offload"}, False),
        ({"requested": "keep", "effective": "drain", "kvCacheMode": "persist"}, True),
        ({}, None),
    ],
)
def test_invalidate_kv_cache_is_true_iff_no_old_kv_serves_after_the_refit(
    in_flight: dict[str, str], answer: bool | None
) -> None:
    refit = {
        "spec": {"fleetRef": {"name": FLEET}, "version": 5},
        "status": {"phase": "Succeeded", "inFlight": in_flight},
    }
    assert kv_invalidation.answer(refit) is answer


def test_the_last_refit_is_the_fleets_succeeded_one_with_the_highest_version() -> None:
    def refit(fleet: str, version: int, phase: str) -> dict[str, Any]:
        return {
            "metadata": {"name": f"{fleet}-v{version}"},
            "spec": {"fleetRef": {"name": fleet}, "version": version},
            "status": {"phase": phase},
        }

    refits = [
        refit(FLEET, 5, "Succeeded"),
        refit(FLEET, 7, "Succeeded"),
        refit(FLEET, 8, "Failed"),
        refit(FLEET, 9, "Running"),
        refit("other", 20, "Succeeded"),
        refit(FLEET, 6, "Succeeded"),
    ]
    last = kv_invalidation.last_refit(refits, FLEET)
    assert last is not None and last["metadata"]["name"] == f"{FLEET}-v7"
    assert kv_invalidation.last_refit([refit("other", 1, "Succeeded")], FLEET) is None


def answer(tokens: int, spans: tuple[generation.VersionSpan, ...], version: int | None = 11) -> generation.Answer:
    return generation.Answer(
        text="",
        token_ids=list(range(100, 100 + tokens)),
        logprobs=[-0.25] * tokens,
        prompt_token_ids=None,
        finish_reason="length",
        weight_version=version,
        url="http://f/v1",
        shard=0,
        weight_version_spans=spans,
    )


def test_outputs_of_samples_spanning_refits_carry_each_tokens_version_aligned_with_its_logprob() -> None:
    answers = [
        answer(5, (generation.VersionSpan(0, 11), generation.VersionSpan(2, 12), generation.VersionSpan(4, 13))),
        answer(3, (generation.VersionSpan(0, 12),), version=12),
        answer(2, ()),  # an engine that gives no spans: its one version
    ]
    input_ids = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    out = batching.pack_outputs(input_ids, torch.tensor([2, 3, 1]), answers, pad_token_id=0)
    assert out["token_weight_versions"].tolist() == [
        [-1, -1, 11, 11, 12, 12, 13, -1],
        [-1, -1, -1, 12, 12, 12, -1, -1],
        [-1, 11, 11, -1, -1, -1, -1, -1],
    ]
    assert ((out["token_weight_versions"] >= 0) == (out["logprobs"] != 0)).all()  # aligned with the logprobs
    assert out["weight_versions"].tolist() == [11, 12, 11] and out["last_weight_versions"].tolist() == [13, 12, 11]
    assert out["token_weight_versions"].dtype == torch.long

    tally = counters.Counters()
    tally.add(answers)
    logged = tally.logger()
    assert logged["megafleet/samples_spanning_refit"] == 1
    assert logged["megafleet/tokens_older_than_latest"] == 4  # two at 11 and two at 12 under the last, 13
    tally.clear()
    tally.add([answer(4, (generation.VersionSpan(0, None), generation.VersionSpan(2, 3)))])  # unknown: not older
    assert tally.logger()["megafleet/tokens_older_than_latest"] == 0
