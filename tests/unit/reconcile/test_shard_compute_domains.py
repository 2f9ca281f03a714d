"""A shard spanning nodes of one clique gets a ComputeDomain before its pods, its pods a claim on the
domain's channel, and the domain goes with the shard; against an in-memory API
(tests/helpers/kube_fakes.py). The objects themselves: :mod:`megafleet.compute_domain`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from helpers import agent_fakes, kube_fakes
from megafleet import compute_domain, desired, kube, planner, reconcile, settings
from megafleet.api import v1alpha1
from megafleet.reconcile import context

GPU = "nvidia.com/gpu"
CLIQUE = "nvidia.com/gpu.clique"


class Agents(agent_fakes.Agents):
    async def suspend(self, pod_ip: str, token: str, *, mode: str, timeout_seconds: float) -> None:
        pass

    async def close(self) -> None:
        pass


def fleet(*, tensor: int, replicas: int = 1) -> dict[str, Any]:
    spec = {
        "model": {"source": "/models/m"},
        "replicas": replicas,
        "parallelism": {"tensor": tensor},
        "resources": {"gpusPerNode": 4},
        "placement": {"nvlink": "Required"},
    }
    metadata = {"name": "gen", "namespace": "rl", "uid": "uid-gen", "generation": 1}
    return {"apiVersion": "megafleet.dev/v1alpha1", "kind": "MegatronGeneration", "metadata": metadata, "spec": spec}


def nodes(count: int) -> list[dict[str, Any]]:
    return [
        {
            "kind": "Node",
            "metadata": {"name": f"n{i}", "labels": {CLIQUE: "rack-a"}},
            "spec": {},
            "status": {"allocatable": {GPU: "4"}},
        }
        for i in range(count)
    ]


class Recorder:
    """Every create and delete, in order, as ``verb kind name``."""

    def __init__(self, api: kube.Api) -> None:
        self.writes: list[str] = []
        api.observers.append(self.written)

    def written(self, verb: str, kind: str, namespace: str | None, name: str, obj: object) -> None:
        if verb in ("create", "delete"):
            self.writes.append(f"{verb} {kind} {name}")


def reconcile_once(api: kube_fakes.Api, runtime: context.Runtime) -> None:
    body = asyncio.run(api.get("MegatronGeneration", "gen", "rl"))
    asyncio.run(reconcile.reconcile(runtime, body or {}))


def domains(api: kube_fakes.Api) -> list[dict[str, Any]]:
    return [obj for (kind, _, _), obj in sorted(api.objects.items()) if kind == compute_domain.KIND]


def test_a_spanning_shard_gets_its_domain_before_its_pods_and_each_pod_claims_its_channel() -> None:
    api = kube_fakes.Api(fleet(tensor=8), *nodes(2))
    recorder = Recorder(api)

    reconcile_once(api, context.Runtime.of(api, Agents(), settings.OperatorSettings()))

    (domain,) = domains(api)
    name = domain["metadata"]["name"]
    assert name.startswith("gen-s0-cd-")
    assert domain["metadata"]["labels"] == {
        "megafleet.dev/fleet": "gen",
        "megafleet.dev/component": "compute-domain",
        "megafleet.dev/shard": "0",
        "app.kubernetes.io/managed-by": "megafleet",
    }
    assert domain["metadata"]["ownerReferences"][0]["uid"] == "uid-gen"
    assert domain["spec"] == {
        "numNodes": 2,
        "channel": {"resourceClaimTemplate": {"name": name}, "allocationMode": "Single"},
    }
    creates = [write for write in recorder.writes if write.startswith("create")]
    assert creates.index(f"create ComputeDomain {name}") < creates.index("create Pod gen-s0-p0")
    pods = [obj for (kind, _, _), obj in sorted(api.objects.items()) if kind == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        assert compute_domain.channel(pod) == name
        assert pod["spec"]["resourceClaims"] == [{"name": "compute-domain-channel", "resourceClaimTemplateName": name}]
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "compute-domain-channel"}]


def test_a_shard_within_one_node_gets_no_domain_and_no_claims() -> None:
    api = kube_fakes.Api(fleet(tensor=4), *nodes(2))
    recorder = Recorder(api)

    reconcile_once(api, context.Runtime.of(api, Agents(), settings.OperatorSettings()))

    assert domains(api) == []
    assert not any("ComputeDomain" in write for write in recorder.writes)
    assert api.reads.get("list ComputeDomain", 0) == 0
    (pod,) = [obj for (kind, _, _), obj in api.objects.items() if kind == "Pod"]
    assert "resourceClaims" not in pod["spec"] and "claims" not in pod["spec"]["containers"][0]["resources"]


def test_the_domain_goes_with_its_shard_and_a_new_placement_gets_a_new_one() -> None:
    api = kube_fakes.Api(fleet(tensor=8, replicas=2), *nodes(4))
    runtime = context.Runtime.of(api, Agents(), settings.OperatorSettings())
    reconcile_once(api, runtime)
    first = {d["metadata"]["labels"]["megafleet.dev/shard"]: d["metadata"]["name"] for d in domains(api)}
    assert sorted(first) == ["0", "1"]

    # Shard 1's pods go away without the operator (a lost node's pods, deleted by someone else).
    for (kind, namespace, name), obj in list(api.objects.items()):
        if kind == "Pod" and obj["metadata"]["labels"]["megafleet.dev/shard"] == "1":
            del api.objects[(kind, namespace, name)]
    reconcile_once(api, runtime)

    second = {d["metadata"]["labels"]["megafleet.dev/shard"]: d["metadata"]["name"] for d in domains(api)}
    assert second["0"] == first["0"] and second["1"] != first["1"]
    assert len(domains(api)) == 2  # the old placement's domain was deleted before the new one was made
    claimed = {
        compute_domain.channel(obj)
        for (kind, _, _), obj in api.objects.items()
        if kind == "Pod" and obj["metadata"]["labels"]["megafleet.dev/shard"] == "1"
    }
    assert claimed == {second["1"]}

    # Scaling in removes shard 1 and its domain with it.
    api.objects[("MegatronGeneration", "rl", "gen")]["spec"]["replicas"] = 1
    reconcile_once(api, runtime)
    assert [d["metadata"]["name"] for d in domains(api)] == [first["0"]]


class NotServed(kube_fakes.MemoryTransport):
    """An API server without NVIDIA's DRA driver: the ComputeDomain resource does not exist."""

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == compute_domain.KIND:
            raise kube.ApiError(404, "NotFound", "the server could not find the requested resource")
        return await super().create(obj)


def test_without_the_driver_the_pods_are_placed_without_claims_and_an_event_says_why() -> None:
    memory = NotServed(fleet(tensor=8), *nodes(2))
    api = kube.Api(memory)
    events: list[tuple[str, str, str]] = []
    body = asyncio.run(api.get("MegatronGeneration", "gen", "rl")) or {}

    asyncio.run(
        reconcile.reconcile(
            context.Runtime.of(api, Agents(), settings.OperatorSettings()),
            body,
            notify=lambda *event: events.append(event),
        )
    )

    pods = [obj for (kind, _, _), obj in memory.objects.items() if kind == "Pod"]
    assert len(pods) == 2 and all(compute_domain.channel(pod) is None for pod in pods)
    assert ("Warning", "ComputeDomainUnavailable") in [(kind, reason) for kind, reason, _ in events]


@pytest.mark.parametrize(
    ("clique", "nodes_used", "expected"),
    [("rack-a", ("n0", "n1"), True), ("rack-a", ("n0", "n0"), False), (None, ("n0", "n1"), False)],
    ids=["two-nodes-one-clique", "one-node", "no-clique"],
)
def test_only_a_shard_on_several_nodes_of_one_clique_spans(
    clique: str | None, nodes_used: tuple[str, ...], expected: bool
) -> None:
    placement = planner.ShardPlacement(
        clique=clique, pods=tuple(planner.PodPlacement(node=n, gpus=4) for n in nodes_used)
    )
    assert compute_domain.spans_nodes(placement) is expected


def test_with_channel_keeps_the_pod_and_adds_one_claim() -> None:
    parsed = desired.ParsedFleet(
        "gen", "rl", "uid-gen", 1, v1alpha1.MegatronGenerationSpec.model_validate(fleet(tensor=8)["spec"])
    )
    placement = planner.ShardPlacement(
        clique="rack-a", pods=(planner.PodPlacement(node="n0", gpus=4), planner.PodPlacement(node="n1", gpus=4))
    )
    (pod, _) = desired.shard_pods(parsed, 0, placement)
    claimed = compute_domain.with_channel(pod, "gen-s0-cd-abc")
    assert "resourceClaims" not in pod["spec"]  # the original is not changed
    assert {k: v for k, v in claimed["spec"].items() if k != "resourceClaims" and k != "containers"} == {
        k: v for k, v in pod["spec"].items() if k != "containers"
    }
    assert compute_domain.channel(claimed) == "gen-s0-cd-abc"
