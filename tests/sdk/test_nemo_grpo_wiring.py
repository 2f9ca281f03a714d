"""``nemo_factory``'s result stands wherever NeMo RL's GRPO uses its generation class: GRPO's own call
sites (transcribed from ``nemo_rl/algorithms/grpo.py`` at NVIDIA-NeMo/RL 7ea279a, each with its exact
call shape) are evaluated with ``MegatronGeneration``/``VllmGeneration`` rebound to the factory's
result, as docs/nemo-rl.md ("Wiring") tells users to do.
"""

from __future__ import annotations

import pickle
import textwrap
from typing import Any

import pytest

from megafleet.sdk import nemo
from megafleet.sdk.nemo import factory

URL = "http://fake-frontend/v1"

# grpo.py's class-level and constructor call sites, line numbers at 7ea279a
GRPO_CALL_SITES = {
    "849 colocated placement": """
        MegatronGeneration.init_cluster_placement_groups(cluster, policy_config)
    """,
    "975 NVLink-domain span": """
        gpus_per_instance = MegatronGeneration.nvlink_domain_span(
            policy_config
        )
    """,
    "1062 inference placement (megatron)": """
        MegatronGeneration.init_cluster_placement_groups(
            inference_cluster, policy_config
        )
    """,
    "1070 inference placement (vllm)": """
        {
            "vllm": VllmGeneration,
            "trtllm": TrtllmGeneration,
        }[generation_config["backend"]].init_cluster_placement_groups(
            inference_cluster,
            generation_config,
        )
    """,
    "1189 init_vllm": """
        pg = VllmGeneration(cluster=inference_cluster, config=generation_config)
        pg.finish_generation()
    """,
    "1206 init_megatron_generation": """
        mg = MegatronGeneration(
            config=policy_config,
            tokenizer=tokenizer,
            cluster=None if colocated_inference else inference_cluster,
            policy=policy if colocated_inference else None,
            processor=processor,
            weights_path=weights_path,
            skip_weight_load=not colocated_inference,
        )
    """,
    "1356 deferred vLLM for NeMo Gym": """
        deferred_vllm = VllmGeneration(
            cluster=inference_cluster,
            config=generation_config,
            defer_model_load=True,
        )
        urls = deferred_vllm.dp_openai_server_base_urls
    """,
    "1588 remote transport check": """
        assert isinstance(policy_generation, VllmGeneration)
    """,
    "4178 colocated async check": """
        assert (not colocated_inference) or (
            isinstance(policy_generation, MegatronGeneration)
        ), "Colocated async GRPO is only supported for the Megatron generation backend."
    """,
}


class Tokenizer:
    pad_token_id = 0


def grpo_namespace(bound: type[factory.BoundGeneration]) -> dict[str, Any]:
    """The names GRPO's ``setup`` and ``async_grpo_train`` hold at those call sites."""
    generation_config = {"backend": "vllm", "max_new_tokens": 4, "colocated": {"enabled": False}}
    return {
        "MegatronGeneration": bound,  # what the user rebinds: grpo.MegatronGeneration = nemo_factory(...)
        "VllmGeneration": bound,
        "TrtllmGeneration": object,
        "cluster": object(),
        "inference_cluster": object(),
        "policy_config": {"generation": generation_config, "megatron_cfg": {"tensor_model_parallel_size": 2}},
        "generation_config": generation_config,
        "tokenizer": Tokenizer(),
        "colocated_inference": False,
        "policy": None,
        "processor": None,
        "weights_path": None,
        "policy_generation": bound(config={"max_new_tokens": 4}),
    }


@pytest.mark.parametrize("site", sorted(GRPO_CALL_SITES))
def test_grpos_call_site_runs_on_the_factorys_result(site: str) -> None:
    bound = nemo.nemo_factory("tiny", "rl-team-a", frontends=[URL])
    namespace = grpo_namespace(bound)
    exec(compile(textwrap.dedent(GRPO_CALL_SITES[site]), f"grpo.py:{site}", "exec"), namespace)
    if "gpus_per_instance" in namespace:
        assert namespace["gpus_per_instance"] == 1  # the fleet adds no NVLink domain to the trainer's placement
    for built in ("pg", "mg", "deferred_vllm"):
        if built in namespace:
            assert isinstance(namespace[built], bound)
            assert isinstance(namespace[built], nemo.MegafleetGeneration)
            assert namespace[built].handle.fleet_name == "tiny"
            assert namespace[built].handle.namespace == "rl-team-a"
    if "urls" in namespace:
        assert namespace["urls"] == [URL]


def test_each_factory_call_binds_its_own_fleet_and_options_and_instances_pickle_to_the_adapter() -> None:
    first = nemo.nemo_factory("tiny", "a", frontends=[URL], master_config={"grpo": {"async_grpo": {}}})
    second = nemo.nemo_factory("other", "b", frontends=[URL])
    assert issubclass(first, factory.BoundGeneration) and first is not second
    one, two = first(config={"generation": {}}, tokenizer=Tokenizer()), second(config={})
    assert (one.handle.fleet_name, two.handle.fleet_name) == ("tiny", "other")
    assert one.cfg["_pad_token_id"] == 0 and one.handle.async_flags is not None and two.handle.async_flags is None
    copy = pickle.loads(pickle.dumps(one))  # the async collector's copy: the configuration only
    assert isinstance(copy, nemo.MegafleetGeneration) and copy.handle == one.handle


def test_validate_settings_on_the_bound_class_keeps_the_flags_for_its_instances_only() -> None:
    bound = nemo.nemo_factory("tiny", frontends=[URL])
    master = {"policy": {"generation": {}}, "grpo": {"async_grpo": {"enabled": True, "in_flight_weight_updates": True}}}
    bound.validate_settings(master)
    assert bound(config={}).validated_flags() is not None
    assert nemo.nemo_factory("tiny", frontends=[URL]).validated_flags() is None


def test_the_base_class_is_not_built_without_a_fleet() -> None:
    with pytest.raises(TypeError, match="nemo_factory"):
        factory.BoundGeneration(config={})
