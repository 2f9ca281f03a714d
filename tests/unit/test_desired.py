"""The pure builders of a fleet's objects."""

from __future__ import annotations

from typing import Any

from megafleet import desired, names, planner
from megafleet.api import v1alpha1
from megafleet.objects import Object


def fleet(**spec: object) -> desired.ParsedFleet:
    raw = {"model": {"source": "/models/m"}, "parallelism": {"tensor": 16}, "resources": {"gpusPerNode": 4}, **spec}
    return desired.ParsedFleet("big", "rl", "uid-1", 3, v1alpha1.MegatronGenerationSpec.model_validate(raw))


PLACEMENT = planner.ShardPlacement(
    clique="uuid.1", pods=tuple(planner.PodPlacement(node=f"gb-{i}", gpus=4) for i in range(4))
)


def env(pod: Object) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in pod["spec"]["containers"][0]["env"]}


def test_a_tp16_shard_becomes_four_pods_pinned_to_its_clique_and_nodes() -> None:
    pods = desired.shard_pods(fleet(), 2, PLACEMENT)

    assert [pod["metadata"]["name"] for pod in pods] == ["big-s2-p0", "big-s2-p1", "big-s2-p2", "big-s2-p3"]
    for index, pod in enumerate(pods):
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        term = terms["nodeSelectorTerms"][0]
        # By node name (the scheduler's pre-filter then looks at that node only) and clique label.
        assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": [f"gb-{index}"]}]
        assert {e["key"]: e["values"] for e in term["matchExpressions"]} == {"nvidia.com/gpu.clique": ["uuid.1"]}
        assert pod["spec"]["subdomain"] == "big-ranks"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4"
        values = env(pod)
        assert values["MEGAFLEET_RANK"] == str(index * 4)
        assert values["MEGAFLEET_WORLD_SIZE"] == "16"
        assert values["MEGAFLEET_MASTER_ADDR"] == "big-s2-p0.big-ranks.rl.svc"
        assert pod["metadata"]["labels"][names.LABEL_POD_INDEX] == str(index)
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    ports = [[p["name"] for p in pod["spec"]["containers"][0]["ports"]] for pod in pods]
    assert ports[0] == ["shard-2", "agent", "metrics"] and ports[1] == ["agent", "metrics"]  # one frontend
    assert pods[0]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] == "shard-2"


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


def test_frontends_services_give_each_shard_a_port_that_only_its_frontend_pod_carries() -> None:
    wide = fleet(replicas=250)
    services = desired.frontends_services(wide)
    assert [s["metadata"]["name"] for s in services] == ["big-f0", "big-f1", "big-f2"]
    last = services[2]
    assert last["spec"]["type"] == "ClusterIP"
    assert last["spec"]["selector"] == {
        names.LABEL_FLEET: "big",
        names.LABEL_COMPONENT: "engine",
        names.LABEL_POD_INDEX: "0",
    }
    assert last["metadata"]["labels"][names.LABEL_COMPONENT] == "frontends"
    ports = last["spec"]["ports"]
    assert len(ports) == 50
    assert ports[7] == {"name": "shard-207", "protocol": "TCP", "port": 8007, "targetPort": "shard-207"}
    # The shard's port name is on its frontend pod alone: the EndpointSlice controller leaves every
    # other selected pod out of that port's endpoints.
    frontend, worker = desired.shard_pods(wide, 207, PLACEMENT)[:2]
    assert [p["name"] for p in frontend["spec"]["containers"][0]["ports"]] == ["shard-207", "agent", "metrics"]
    assert frontend["spec"]["containers"][0]["ports"][0]["containerPort"] == 8000
    assert "shard-207" not in str(worker["spec"]["containers"][0]["ports"])
    assert desired.frontends_services(fleet(replicas=0)) == []


def test_a_shard_port_counts_down_where_counting_up_would_pass_65535() -> None:
    high = fleet(replicas=120, frontend={"port": 65500})
    assert [desired.frontend_port(high, shard) for shard in (0, 5, 99, 100, 105)] == [65500, 65495, 65401, 65500, 65495]
    assert desired.frontend_port(fleet(frontend={"port": 65436}), 99) == 65535


def test_services_of_a_fleet_and_of_a_legacy_fleet() -> None:
    two = fleet(replicas=2)
    assert [s["metadata"]["name"] for s in desired.services(two, legacy=False)] == ["big-f0", "big-ranks"]
    legacy = desired.services(two, legacy=True)
    assert [s["metadata"]["name"] for s in legacy] == ["big-s0", "big-s1", "big-ranks"]
    assert legacy[1]["spec"]["selector"] == {
        names.LABEL_FLEET: "big",
        names.LABEL_SHARD: "1",
        names.LABEL_POD_INDEX: "0",
    }
    ranks = desired.ranks_service(two)
    assert ranks["spec"]["clusterIP"] == "None"
    assert ranks["spec"]["selector"] == {names.LABEL_FLEET: "big", names.LABEL_COMPONENT: "engine"}
    assert ranks["spec"]["publishNotReadyAddresses"] is True  # ranks resolve each other before Ready
    assert desired.services(fleet(replicas=0), legacy=False) == []
    assert desired.legacy_frontends(legacy) and not desired.legacy_frontends(desired.services(two, legacy=False))


def test_endpoint_and_configmap_publish_clusterip_and_dns_urls() -> None:
    two = fleet(replicas=2)
    (service,) = desired.frontends_services(two)
    allocated = {**service, "spec": {**service["spec"], "clusterIP": "10.96.0.10"}}
    endpoints = [desired.endpoint(two, shard, allocated) for shard in range(2)]
    configmap = desired.endpoints_configmap(two, endpoints)
    assert configmap["data"]["urls"] == "http://10.96.0.10:8000/v1\nhttp://10.96.0.10:8001/v1\n"
    assert configmap["data"]["dns-urls"].splitlines()[1] == "http://big-f0.rl.svc:8001/v1"
    assert endpoints[1].service == "big-f0"
    legacy = {
        **desired.frontend_service(two, 1),
        "spec": {**desired.frontend_service(two, 1)["spec"], "clusterIP": "10.96.0.11"},
    }
    assert desired.endpoint(two, 1, legacy).url == "http://10.96.0.11:8000/v1"  # a legacy shard's own Service


def test_a_one_pod_shard_has_no_ranks_service_and_meets_on_loopback() -> None:
    one = fleet(parallelism={"tensor": 8}, resources={"gpusPerNode": 8})
    assert one.layout.pods_per_shard == 1
    assert [s["metadata"]["name"] for s in desired.services(one, legacy=False)] == ["big-f0"]
    placement = planner.ShardPlacement(clique=None, pods=(planner.PodPlacement(node="n5", gpus=8),))
    (pod,) = desired.shard_pods(one, 0, placement)
    assert env(pod)["MEGAFLEET_MASTER_ADDR"] == "127.0.0.1"
    assert "subdomain" not in pod["spec"]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n5"]}]}
    ]


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
    """The kubelet expands ``$(NAME)`` in env values and turns ``$$`` into ``$``
    (docs/incidents.md#env-dollar-expansion)."""
    parsed = fleet(model={"source": "/models/$(MEGAFLEET_HOST)", "servedName": "a$$b$(MEGAFLEET_SHARD)"})

    values = env(desired.shard_pods(parsed, 0, PLACEMENT)[0])

    assert values["MEGAFLEET_MODEL_SOURCE"] == "/models/$$(MEGAFLEET_HOST)"
    assert values["MEGAFLEET_SERVED_MODEL_NAME"] == "a$$$$b$$(MEGAFLEET_SHARD)"


def test_the_operator_sets_exactly_the_env_a_spec_may_not_set() -> None:
    from megafleet_protocol import env as pod_env

    parsed = fleet(frontend={"apiKeySecret": {"name": "keys"}})

    written = {item["name"] for item in desired.shard_pods(parsed, 0, PLACEMENT)[0]["spec"]["containers"][0]["env"]}

    assert written - set(desired.CACHE_ENV) == set(pod_env.SET_BY_OPERATOR)


def test_the_dev_runner_expands_env_as_the_kubelet_does() -> None:
    from megafleet_dev import runner

    defined = {"A": "x"}

    assert runner.expand("$(A)-$$(A)-$(B)-$$-$-$(", defined) == "x-$(A)-$(B)-$-$-$("
    assert runner.expand(desired.literal("/m/$(A)$$"), defined) == "/m/$(A)$$"


POD_ADDITIONS: dict[str, object] = {
    "labels": {"team": "rl", names.LABEL_FLEET: "spoofed"},
    "annotations": {"example.com/owner": "alice", names.ANNOTATION_TEMPLATE_HASH: "spoofed"},
    "serviceAccountName": "engine-sa",
    "automountServiceAccountToken": True,
    "priorityClassName": "rl-high",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}],
    "volumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "llama", "readOnly": True}},
        {"name": "kernels", "persistentVolumeClaim": {"claimName": "kernel-cache"}},
        {"name": "host-data", "hostPath": {"path": "/data/ckpt", "type": "Directory"}},
    ],
    "volumeMounts": [
        {"name": "models", "mountPath": "/models", "readOnly": True},
        {"name": "host-data", "mountPath": "/tmp/ckpt", "subPath": "v1"},
    ],
    "shmSize": "16Gi",
    "cache": {"volume": "kernels"},
}


def test_the_pod_template_carries_the_users_volumes_identity_and_metadata() -> None:
    parsed = fleet(
        pod=POD_ADDITIONS,
        resources={"gpusPerNode": 4, "extra": {"rdma/ib": "1", "ephemeral-storage": "200Gi"}},
        engine={
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
            "envFrom": [{"configMapRef": {"name": "nccl-tuning"}, "prefix": "NCCL_"}],
        },
    )

    pod = desired.shard_pods(parsed, 1, PLACEMENT)[1]
    spec, container = pod["spec"], pod["spec"]["containers"][0]

    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["team"] == "rl" and labels[names.LABEL_FLEET] == "big"  # the operator's keys win
    assert labels[names.LABEL_SHARD] == "1" and labels[names.LABEL_POD_INDEX] == "1"
    assert annotations == {"example.com/owner": "alice", names.ANNOTATION_TEMPLATE_HASH: desired.template_hash(parsed)}
    assert spec["serviceAccountName"] == "engine-sa" and spec["automountServiceAccountToken"] is True
    assert spec["priorityClassName"] == "rl-high" and spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "llama", "readOnly": True}}
    assert volumes["host-data"]["hostPath"] == {"path": "/data/ckpt", "type": "Directory"}
    assert volumes[names.VOLUME_SHM]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert names.VOLUME_CACHE not in volumes  # the user's volume holds the caches
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert mounts[names.CACHE_MOUNT]["name"] == "kernels"
    assert mounts[names.SHM_MOUNT]["name"] == names.VOLUME_SHM
    assert mounts["/models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert mounts["/tmp/ckpt"]["subPath"] == "v1"
    assert mounts[names.AGENT_TOKEN_MOUNT]["readOnly"] is True
    assert len({mount["mountPath"] for mount in container["volumeMounts"]}) == len(container["volumeMounts"])
    limits = container["resources"]["limits"]
    assert limits["rdma/ib"] == "1" and limits["ephemeral-storage"] == "200Gi" and limits["nvidia.com/gpu"] == "4"
    assert container["resources"]["requests"] == limits
    assert container["envFrom"] == [{"prefix": "NCCL_", "configMapRef": {"name": "nccl-tuning"}}]
    token = next(item for item in container["env"] if item["name"] == "HF_TOKEN")
    assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def test_by_default_every_cache_points_into_a_per_pod_emptydir_and_shm_is_memory_backed() -> None:
    pod = desired.shard_pods(fleet(), 0, PLACEMENT)[0]
    spec, container = pod["spec"], pod["spec"]["containers"][0]

    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    assert volumes[names.VOLUME_CACHE] == {"name": names.VOLUME_CACHE, "emptyDir": {}}
    assert volumes[names.VOLUME_SHM]["emptyDir"] == {"medium": "Memory"}  # bounded by the memory limit
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec and "imagePullSecrets" not in spec and "envFrom" not in container
    values = env(pod)
    for variable in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR"):
        assert values[variable].startswith(names.CACHE_MOUNT), variable
    assert values["HOME"] == names.TMP_MOUNT
    writable = {mount["mountPath"] for mount in container["volumeMounts"] if not mount.get("readOnly")}
    assert writable >= {names.TMP_MOUNT, names.CACHE_MOUNT, names.SHM_MOUNT}


def test_a_cache_variable_in_engine_env_replaces_the_operators() -> None:
    pod = desired.shard_pods(fleet(engine={"env": [{"name": "HF_HOME", "value": "/models/hf"}]}), 0, PLACEMENT)[0]

    names_written = [item["name"] for item in pod["spec"]["containers"][0]["env"]]

    assert names_written.count("HF_HOME") == 1
    assert env(pod)["HF_HOME"] == "/models/hf"


def test_the_cache_emptydir_takes_its_size_limit() -> None:
    pod = desired.shard_pods(fleet(pod={"cache": {"sizeLimit": "50Gi"}}), 0, PLACEMENT)[0]
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes[names.VOLUME_CACHE]["emptyDir"] == {"sizeLimit": "50Gi"}


def test_every_pod_template_field_rolls_the_fleet() -> None:
    base = desired.template_hash(fleet())
    changed: list[dict[str, Any]] = [
        {"pod": {"labels": {"team": "rl"}}},
        {"pod": {"annotations": {"a": "b"}}},
        {"pod": {"serviceAccountName": "sa"}},
        {"pod": {"priorityClassName": "high"}},
        {"pod": {"imagePullSecrets": [{"name": "regcred"}]}},
        {"pod": {"shmSize": "8Gi"}},
        {"pod": {"cache": {"sizeLimit": "1Gi"}}},
        {"pod": {"volumes": [{"name": "m", "emptyDir": {}}], "volumeMounts": [{"name": "m", "mountPath": "/m"}]}},
        {"resources": {"gpusPerNode": 4, "extra": {"rdma/ib": "1"}}},
        {"engine": {"envFrom": [{"secretRef": {"name": "s"}}]}},
        {"engine": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}},
    ]
    hashes = {desired.template_hash(fleet(**spec)) for spec in changed}
    assert base not in hashes and len(hashes) == len(changed)


def test_an_operator_upgrade_does_not_roll_fleets_that_leave_the_new_fields_unset() -> None:
    """The hashes the operator computed before spec.pod, resources.extra, engine.envFrom and env
    valueFrom existed (main at b8c7848): unchanged, so upgrading the operator rolls no shard. These
    fleets' refit.staging is off: the API server stored that default (off until staging became auto)
    in every fleet created since the field existed, and it stays stored across the CRD upgrade."""
    with_env = fleet(engine={"env": [{"name": "A", "value": "b"}]}, refit={"staging": "off"})
    cpu = desired.ParsedFleet(
        "big",
        "rl",
        "u",
        1,
        v1alpha1.MegatronGenerationSpec.model_validate(
            {
                "model": {"source": "tiny://"},
                "resources": {"gpusPerNode": 0, "cpu": "1", "memory": "2Gi"},
                "engine": {"backend": "transformers"},
                "refit": {"staging": "off"},
            }
        ),
    )
    assert desired.template_hash(with_env) == "f7eba6d1285fa1b8"
    assert desired.template_hash(cpu) == "f2c324051a1f41ad"


def test_a_fleet_stored_before_refit_staging_existed_reads_auto_and_rolls_once() -> None:
    """A fleet whose stored spec has no refit.staging (created before the field) reads the default,
    auto, after the CRD upgrade: its engines must start again to allocate the staging copy, so its
    hash changes (one roll, shard by shard). Its earlier hash is the same spec's with staging off."""
    unset = fleet()
    stored_off = fleet(refit={"staging": "off"})

    assert unset.spec.refit.staging == "auto"
    assert desired.template_hash(unset) != desired.template_hash(stored_off)
    assert desired.template_hash(unset) == desired.template_hash(fleet(refit={"staging": "auto"}))


def test_refit_staging_reaches_the_engines_and_rolls_the_fleet_only_when_on() -> None:
    """The engines allocate the staging copy at start, so staging (and, while it is on, its headroom)
    shapes the pod; the other refit settings are read per refit and roll nothing."""
    base = desired.template_hash(fleet(refit={"staging": "off"}))
    staged = fleet(refit={"staging": "auto", "stagingHeadroomMiB": 2048})
    values = env(desired.shard_pods(staged, 0, PLACEMENT)[0])
    defaults = env(desired.shard_pods(fleet(), 0, PLACEMENT)[0])

    assert (values["MEGAFLEET_REFIT_STAGING"], values["MEGAFLEET_REFIT_STAGING_HEADROOM_MIB"]) == ("auto", "2048")
    # A fleet without a refit section stages: the env says so (the engine's own default, unset, is off).
    assert (defaults["MEGAFLEET_REFIT_STAGING"], defaults["MEGAFLEET_REFIT_STAGING_HEADROOM_MIB"]) == ("auto", "1024")
    assert env(desired.shard_pods(fleet(refit={"staging": "off"}), 0, PLACEMENT)[0])["MEGAFLEET_REFIT_STAGING"] == "off"
    assert desired.template_hash(staged) != base
    assert desired.template_hash(fleet(refit={"staging": "required", "stagingHeadroomMiB": 2048})) not in (
        base,
        desired.template_hash(staged),
    )
    assert desired.template_hash(fleet(refit={"staging": "auto"})) != desired.template_hash(staged)
    unchanged = [
        {"refit": {"staging": "off", "stagingHeadroomMiB": 2048}},
        {"refit": {"staging": "off", "inFlight": "drain", "integrity": "checksum", "timeoutSeconds": 60}},
    ]
    assert {desired.template_hash(fleet(**spec)) for spec in unchanged} == {base}


def test_user_mounts_may_not_take_or_cover_the_operators() -> None:
    assert v1alpha1.mount_problem("/models") is None
    assert v1alpha1.mount_problem("/tmp/checkpoint") is None  # inside the scratch emptyDir is fine
    assert v1alpha1.mount_problem(f"{names.CACHE_MOUNT}/hub") is None
    for path in ("/tmp", "/dev", "/var", "/var/run", names.AGENT_TOKEN_MOUNT, f"{names.AGENT_TOKEN_MOUNT}/x"):
        assert v1alpha1.mount_problem(path) is not None, path
    assert v1alpha1.mount_problem("/models/../tmp") is not None
