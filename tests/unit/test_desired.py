"""The pure builders of a fleet's objects."""

from __future__ import annotations

from megafleet import desired, names, planner
from megafleet.api import v1alpha1


def fleet(**spec: object) -> desired.ParsedFleet:
    raw = {"model": {"source": "/models/m"}, "parallelism": {"tensor": 16}, "resources": {"gpusPerNode": 4}, **spec}
    return desired.ParsedFleet("big", "rl", "uid-1", 3, v1alpha1.MegatronGenerationSpec.model_validate(raw))


PLACEMENT = planner.ShardPlacement(
    clique="uuid.1", pods=tuple(planner.PodPlacement(node=f"gb-{i}", gpus=4) for i in range(4))
)


def env(pod: desired.Object) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in pod["spec"]["containers"][0]["env"]}


def test_a_tp16_shard_becomes_four_pods_pinned_to_its_clique_and_nodes() -> None:
    pods = desired.shard_pods(fleet(), 2, PLACEMENT)

    assert [pod["metadata"]["name"] for pod in pods] == ["big-s2-p0", "big-s2-p1", "big-s2-p2", "big-s2-p3"]
    for index, pod in enumerate(pods):
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        expressions = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
        assert expressions == {
            "kubernetes.io/hostname": [f"gb-{index}"],
            "nvidia.com/gpu.clique": ["uuid.1"],
        }
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4"
        values = env(pod)
        assert values["MEGAFLEET_RANK"] == str(index * 4)
        assert values["MEGAFLEET_WORLD_SIZE"] == "16"
        assert values["MEGAFLEET_MASTER_ADDR"] == "big-s2-p0.big-s2-ranks.rl.svc"
        assert pod["metadata"]["labels"][names.LABEL_POD_INDEX] == str(index)
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    ports = [[p["name"] for p in pod["spec"]["containers"][0]["ports"]] for pod in pods]
    assert ports[0] == ["http", "agent", "metrics"] and ports[1] == ["agent", "metrics"]  # one frontend


def test_pods_run_restricted() -> None:
    pod = desired.shard_pods(fleet(), 0, PLACEMENT)[0]
    container = pod["spec"]["containers"][0]["securityContext"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_template_hash_changes_with_the_engine_but_not_with_replicas() -> None:
    base = desired.template_hash(fleet())
    assert desired.template_hash(fleet(replicas=7)) == base
    assert desired.template_hash(fleet(engine={"maxBatchSize": 8})) != base


def test_endpoint_and_configmap_publish_clusterip_and_dns_urls() -> None:
    endpoints = [desired.endpoint(fleet(), shard, f"10.96.0.{10 + shard}") for shard in range(2)]
    configmap = desired.endpoints_configmap(fleet(), endpoints)
    assert configmap["data"]["urls"] == "http://10.96.0.10:8000/v1\nhttp://10.96.0.11:8000/v1\n"
    assert configmap["data"]["dns-urls"].splitlines()[1] == "http://big-s1.rl.svc:8000/v1"


def test_frontend_service_selects_only_pod_zero_of_its_shard() -> None:
    service = desired.frontend_service(fleet(), 3)
    assert service["spec"]["selector"] == {names.LABEL_FLEET: "big", names.LABEL_SHARD: "3", names.LABEL_POD_INDEX: "0"}
    assert desired.ranks_service(fleet(), 3)["spec"]["clusterIP"] == "None"


def test_tolerations_match_taints_as_the_scheduler_does() -> None:
    from megafleet.reconcile import inventory

    gpu_taint = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    exists = v1alpha1.Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
    equal_other = v1alpha1.Toleration(key="nvidia.com/gpu", operator="Equal", value="absent")
    assert inventory.tolerates([exists], gpu_taint)
    assert not inventory.tolerates([], gpu_taint)
    assert not inventory.tolerates([equal_other], gpu_taint)
    assert inventory.tolerates([], [{"key": "soft", "effect": "PreferNoSchedule"}])
    assert inventory.tolerates([v1alpha1.Toleration(operator="Exists")], gpu_taint)


def test_env_values_reach_the_engine_as_written_never_expanded_by_the_kubelet() -> None:
    """The kubelet expands ``$(NAME)`` in env values and turns ``$$`` into ``$`` (issue 16)."""
    parsed = fleet(model={"source": "/models/$(MEGAFLEET_HOST)", "servedName": "a$$b$(MEGAFLEET_SHARD)"})

    values = env(desired.shard_pods(parsed, 0, PLACEMENT)[0])

    assert values["MEGAFLEET_MODEL_SOURCE"] == "/models/$$(MEGAFLEET_HOST)"
    assert values["MEGAFLEET_SERVED_MODEL_NAME"] == "a$$$$b$$(MEGAFLEET_SHARD)"


def test_the_operator_sets_exactly_the_env_a_spec_may_not_set() -> None:
    from megafleet_protocol import env as pod_env

    parsed = fleet(frontend={"apiKeySecret": {"name": "keys"}})

    written = {item["name"] for item in desired.shard_pods(parsed, 0, PLACEMENT)[0]["spec"]["containers"][0]["env"]}

    assert written == set(pod_env.SET_BY_OPERATOR)


def test_the_dev_runner_expands_env_as_the_kubelet_does() -> None:
    from megafleet_dev import runner

    defined = {"A": "x"}

    assert runner.expand("$(A)-$$(A)-$(B)-$$-$-$(", defined) == "x-$(A)-$(B)-$-$-$("
    assert runner.expand(desired.literal("/m/$(A)$$"), defined) == "/m/$(A)$$"
