"""Table-driven tests of megafleet.planner.validation: one case per rule, field and key phrase."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from megafleet.planner import FleetSettings, Parallelism, Problem, validate

# A valid GPU fleet: Llama-8B-style TP=8 shards on 8-GPU nodes.
_BASE = FleetSettings(
    parallelism=Parallelism(tensor=8),
    replicas=2,
    gpus_per_node=8,
    backend="megatron",
    kv_cache_mode="persist",
    cuda_graphs=True,
    weights_initial="checkpoint",
    refit_transport="broadcast",
    checkpoint="s3://models/llama-3.1-8b",
)

# A valid CPU fleet: transformers backend, one rank per shard.
_CPU = dataclasses.replace(_BASE, parallelism=Parallelism(), gpus_per_node=0, backend="transformers", cuda_graphs=False)


def _settings(base: FleetSettings = _BASE, **changes: Any) -> FleetSettings:
    par = {key: changes.pop(key) for key in list(changes) if key in {f.name for f in dataclasses.fields(Parallelism)}}
    if par:
        changes["parallelism"] = dataclasses.replace(base.parallelism, **par)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "settings",
    [
        _BASE,
        _CPU,
        _settings(tensor=16, gpus_per_node=4),
        _settings(tensor=8, pipeline=2),
        _settings(tensor=4),
        _settings(tensor=8, expert=8),
        _settings(tensor=4, expert=2, expert_tensor=2),
        _settings(replicas=0),
        _settings(kv_cache_mode="offload"),
        _settings(kv_cache_mode="recompute"),
        _settings(weights_initial="refit", checkpoint=None),
        _settings(refit_transport="reshard"),
        _settings(_CPU, refit_transport="reshard"),
        _settings(_CPU, weights_initial="refit", checkpoint=None, kv_cache_mode="recompute"),
        _settings(backend="transformers", tensor=1, gpus_per_node=8),
    ],
    ids=[
        "megatron-tp8",
        "cpu-transformers",
        "gb200-tp16",
        "tp8-pp2",
        "tp4-packs-node",
        "moe-tp8-ep8",
        "moe-ep2-etp2",
        "scaled-to-zero",
        "offload-with-cuda-graphs",
        "recompute-with-cuda-graphs",
        "refit-without-checkpoint",
        "reshard-megatron",
        "reshard-transformers-cpu",
        "cpu-refit-recompute",
        "transformers-on-gpu",
    ],
)
def test_valid(settings: FleetSettings) -> None:
    assert validate(settings) == []


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (_settings(tensor=0), [("spec.parallelism.tensor", "at least 1")]),
        (_settings(pipeline=-1), [("spec.parallelism.pipeline", "at least 1")]),
        (_settings(context=0), [("spec.parallelism.context", "at least 1")]),
        (_settings(expert=0), [("spec.parallelism.expert", "at least 1")]),
        (_settings(expert_tensor=0), [("spec.parallelism.expertTensor", "at least 1")]),
        (_settings(replicas=-1), [("spec.replicas", "0 or more shards")]),
        (_settings(gpus_per_node=-8), [("spec.resources.gpusPerNode", "0 for a CPU fleet")]),
        (
            _settings(tensor=4, pipeline=3),
            [("spec.parallelism.tensor", "= 12 GPUs per shard does not fill whole nodes of 8 GPUs")],
        ),
        (_settings(tensor=3), [("spec.parallelism.tensor", "= 3 GPUs per shard does not pack evenly")]),
        (_settings(tensor=6, gpus_per_node=4), [("spec.parallelism.tensor", "divides 4 or is a multiple of 4")]),
        (_settings(tensor=4, expert=8), [("spec.parallelism.expert", "expert x expertTensor = 8 does not divide")]),
        (_settings(tensor=2, expert=2, expert_tensor=2), [("spec.parallelism.expert", "whose product divides 2")]),
        (
            _settings(_CPU, backend="megatron"),
            [("spec.engine.backend", "backend megatron needs GPUs")],
        ),
        (
            _settings(tensor=4, context=2),
            [("spec.parallelism.context", "no context parallelism")],
        ),
        (_settings(backend="transformers"), [("spec.parallelism.tensor", "backend transformers")]),
        (
            _settings(backend="transformers", tensor=1, pipeline=2, context=2, expert=2),
            [
                ("spec.parallelism.pipeline", "set pipeline to 1"),
                ("spec.parallelism.context", "set context to 1"),
                ("spec.parallelism.expert", "set expert to 1"),
            ],
        ),
        (
            # Two independent inconsistencies, two problems: the expert sizes and the backend.
            _settings(backend="transformers", tensor=1, expert_tensor=2),
            [
                ("spec.parallelism.expert", "expert x expertTensor = 2 does not divide tensor x context = 1"),
                ("spec.parallelism.expertTensor", "set expertTensor to 1"),
            ],
        ),
        (_settings(_CPU, cuda_graphs=True), [("spec.engine.cudaGraphs", "set cudaGraphs to false")]),
        (_settings(checkpoint=None), [("spec.model.source", "no checkpoint source")]),
        (_settings(checkpoint=""), [("spec.model.source", "no checkpoint source")]),
        (_settings(checkpoint="   "), [("spec.model.source", "set spec.weights.initial to refit")]),
        (_settings(backend="vllm"), [("spec.engine.backend", "'vllm' is not one of megatron, transformers")]),
        (_settings(kv_cache_mode="drop"), [("spec.engine.kvCacheMode", "is not one of")]),
        (_settings(weights_initial="s3"), [("spec.weights.initial", "is not one of")]),
        (_settings(refit_transport="nixl"), [("spec.refit.transport", "is not one of")]),
    ],
    ids=[
        "tensor-zero",
        "pipeline-negative",
        "context-zero",
        "expert-zero",
        "expert-tensor-zero",
        "replicas-negative",
        "gpus-per-node-negative",
        "shard-12-on-8",
        "shard-3-on-8",
        "shard-6-on-4",
        "experts-exceed-dense",
        "etp-ep-not-dividing",
        "megatron-on-cpu",
        "megatron-context",
        "transformers-tensor",
        "transformers-every-size",
        "transformers-expert-tensor",
        "cpu-cuda-graphs",
        "checkpoint-none",
        "checkpoint-empty",
        "checkpoint-blank",
        "unknown-backend",
        "unknown-kv-mode",
        "unknown-weights",
        "unknown-transport",
    ],
)
def test_problem(settings: FleetSettings, expected: list[tuple[str, str]]) -> None:
    problems = validate(settings)
    assert [p.field for p in problems] == [field for field, _ in expected], problems
    for problem, (_, phrase) in zip(problems, expected, strict=True):
        assert phrase in problem.message


def test_every_problem_is_reported_in_rule_order() -> None:
    settings = _settings(
        _CPU,
        replicas=-1,
        backend="megatron",
        cuda_graphs=True,
        checkpoint=None,
    )
    assert [p.field for p in validate(settings)] == [
        "spec.replicas",
        "spec.engine.backend",
        "spec.engine.cudaGraphs",
        "spec.model.source",
    ]


def test_bad_size_does_not_cascade() -> None:
    # tensor = 0 would otherwise also trip node packing (0 GPUs) and the expert rule.
    assert validate(_settings(tensor=0, expert=4)) == [
        Problem("spec.parallelism.tensor", "tensor = 0; every parallel size must be at least 1")
    ]


def test_validate_is_stable() -> None:
    settings = _settings(_CPU, backend="megatron", cuda_graphs=True, refit_transport="reshard", checkpoint="")
    assert validate(settings) == validate(settings)
    assert len(validate(settings)) == 3
