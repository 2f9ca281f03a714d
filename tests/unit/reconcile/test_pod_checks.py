"""The pods a valid spec makes, checked before any exists: the engine's settings with the engine's
own parser (a value it refuses is InvalidSpec naming the variable, not a pod whose engine exits at
start) and the pods' annotations against the API server's bound."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import agent_fakes, kube_fakes
from megafleet import conditions, desired, planner, reconcile, settings
from megafleet.api import v1alpha1
from megafleet.reconcile import context, pod_checks

ROOT = Path(__file__).resolve().parents[3]
NODE = {"kind": "Node", "metadata": {"name": "n0", "labels": {}}, "spec": {}, "status": {"allocatable": {}}}


def fleet(*env: dict[str, Any], **spec: Any) -> desired.ParsedFleet:
    raw = {
        "model": {"source": "tiny://llama"},
        "resources": {"gpusPerNode": 0},
        "engine": {"backend": "transformers", "env": list(env)},
    }
    raw.update(spec)
    return desired.ParsedFleet("gen", "rl", "uid-1", 1, v1alpha1.MegatronGenerationSpec.model_validate(raw))


def variable(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            [variable("MEGAFLEET_REFIT_WAIT_SECONDS", "-5")],
            [("spec.engine.env[0]", "MEGAFLEET_REFIT_WAIT_SECONDS must be at least 0, got -5")],
        ),
        (
            [variable("HF_HOME", "/x"), variable("MEGAFLEET_FUSED_KERNELS", "rm -rf /")],
            [
                (
                    "spec.engine.env[1]",
                    "MEGAFLEET_FUSED_KERNELS must be one of rope-swiglu, off, gemv, all, got 'rm -rf /'",
                )
            ],
        ),
        (
            [variable("MEGAFLEET_KV_CACHE_GIB", "0"), variable("MEGAFLEET_PREFILL_GRAPHS", "yes")],
            [
                ("spec.engine.env[0]", "MEGAFLEET_KV_CACHE_GIB must be at least 1, got 0"),
                ("spec.engine.env[1]", "MEGAFLEET_PREFILL_GRAPHS must be one of true, false, got 'yes'"),
            ],
        ),
        (
            [variable("MEGAFLEET_LOCAL_RANKS", "2")],
            [
                (
                    "spec.engine.env[0]",
                    "MEGAFLEET_RANK 0 plus 2 local rank(s) (MEGAFLEET_LOCAL_RANKS or MEGAFLEET_LOCAL_GPUS) exceeds "
                    "MEGAFLEET_WORLD_SIZE 1",
                )
            ],
        ),
        (
            [
                variable("MEGAFLEET_REFIT_WAIT_SECONDS", "5"),
                variable("MEGAFLEET_FUSED_KERNELS", "gemv"),
                variable("MEGAFLEET_KV_CACHE_GIB", "40"),
                variable("MEGAFLEET_PREFILL_GRAPHS", "true"),
                variable("MEGAFLEET_API_SERVERS", "2"),
                variable("MEGAFLEET_SOMETHING_ELSE", "anything"),
            ],
            [],
        ),
        # Known only to the kubelet: left to the engine (which says why it exits in its termination message).
        ([{"name": "MEGAFLEET_KV_CACHE_GIB", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}], []),
        ([variable("GIB", "0"), variable("MEGAFLEET_KV_CACHE_GIB", "$(GIB)")], []),
    ],
    ids=["negative-wait", "shell-in-kernels", "two-bad", "ranks-beyond-the-world", "valid", "value-from", "expanded"],
)
def test_engine_settings_are_checked_with_the_engines_parser(
    env: list[dict[str, Any]], expected: list[tuple[str, str]]
) -> None:
    assert [(problem.field, problem.message) for problem in pod_checks.problems(fleet(*env))] == expected


def test_a_setting_that_conflicts_with_the_operators_is_refused() -> None:
    found = pod_checks.problems(
        fleet(variable("MEGAFLEET_API_KEY_FILE", "/k"), frontend={"apiKeySecret": {"name": "keys", "key": "api"}})
    )
    assert found == [planner.Problem("spec.engine.env[0]", "set MEGAFLEET_API_KEY or MEGAFLEET_API_KEY_FILE, not both")]


def test_every_pod_of_a_shard_is_checked() -> None:
    """Two pods of four GPUs each: LOCAL_RANKS=2 clashes with each pod's four GPUs."""
    spec = {
        "resources": {"gpusPerNode": 4},
        "parallelism": {"tensor": 8},
        "engine": {"backend": "megatron", "env": [variable("MEGAFLEET_LOCAL_RANKS", "2")]},
    }
    found = pod_checks.problems(fleet(**spec))
    assert found == [
        planner.Problem(
            "spec.engine.env[0]",
            "MEGAFLEET_LOCAL_RANKS 2 must equal MEGAFLEET_LOCAL_GPUS 4: a pod runs one rank per GPU",
        )
    ]


def test_annotations_beyond_what_the_api_server_takes_are_refused() -> None:
    big = {f"example.com/a{k}": "x" * 65536 for k in range(4)}
    [problem] = pod_checks.problems(fleet(pod={"annotations": big}))
    assert problem.field == "spec.pod.annotations" and "the API server refuses more than 262144" in problem.message
    assert pod_checks.problems(fleet(pod={"annotations": {"example.com/a": "x" * 65536}})) == []


def test_a_fleet_with_a_setting_the_engine_refuses_is_invalid_spec_naming_it_and_gets_no_pods() -> None:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"].update(namespace="rl", uid="uid-tiny")
    manifest["spec"]["engine"]["env"] = [variable("MEGAFLEET_REFIT_WAIT_SECONDS", "-5")]
    api = kube_fakes.Api(manifest, NODE)
    events: list[tuple[str, str, str]] = []
    runtime = context.Runtime.of(api, agent_fakes.Agents(), settings.OperatorSettings())

    async def once() -> dict[str, Any]:
        body = await api.get("MegatronGeneration", "tiny", "rl") or {}
        await reconcile.reconcile(runtime, body, notify=lambda *event: events.append(event))
        return await api.get("MegatronGeneration", "tiny", "rl") or {}

    found = asyncio.run(once())

    message = "spec.engine.env[0]: MEGAFLEET_REFIT_WAIT_SECONDS must be at least 0, got -5"
    invalid = conditions.find(found["status"]["conditions"], conditions.INVALID_SPEC) or {}
    assert (invalid.get("status"), invalid.get("message")) == ("True", message)
    assert events == [("Warning", "InvalidSpec", message)]
    assert not [key for key in api.objects if key[0] in ("Pod", "Service")]


FLEET_EXAMPLES = [
    path for path in sorted((ROOT / "examples").rglob("*.yaml")) if "\nkind: MegatronGeneration" in path.read_text()
]


@pytest.mark.parametrize("path", FLEET_EXAMPLES, ids=[path.stem for path in FLEET_EXAMPLES])
def test_the_example_fleets_make_pods_the_engine_and_the_api_server_accept(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    spec = v1alpha1.MegatronGenerationSpec.model_validate(manifest["spec"])
    assert pod_checks.problems(desired.ParsedFleet(manifest["metadata"]["name"], "rl", "uid", 1, spec)) == []


def test_a_fleet_is_checked_once_per_generation() -> None:
    checked = pod_checks.Checked()
    bad = fleet(variable("MEGAFLEET_REFIT_WAIT_SECONDS", "-5"))
    first = checked.problems(bad)
    assert checked.problems(bad) is first and len(first) == 1
    fixed = dataclasses.replace(fleet(variable("MEGAFLEET_REFIT_WAIT_SECONDS", "5")), generation=2)
    assert checked.problems(fixed) == []
