"""Pure builders of the objects a fleet owns: Services, ConfigMap, Secret and the pods of a shard.

Called by :mod:`megafleet.reconcile`. No API calls here: each function maps the typed spec (and,
for pods, the planner's placement) to plain Kubernetes JSON, so the shapes are unit-tested alone.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json

from megafleet import names, planner
from megafleet.api import checks, v1alpha1
from megafleet.objects import Object
from megafleet_protocol import env, ports


@dataclasses.dataclass(frozen=True)
class ParsedFleet:
    """The identity of a MegatronGeneration plus its parsed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: v1alpha1.MegatronGenerationSpec

    @property
    def selector(self) -> str:
        """The label selector of the fleet's engine pods (``status.selector``, scale subresource)."""
        return f"{names.LABEL_FLEET}={self.name},{names.LABEL_COMPONENT}=engine"

    @property
    def layout(self) -> planner.PodLayout:
        return planner.pod_layout(checks.parallelism(self.spec.parallelism), self.spec.resources.gpus_per_node)


def metadata(fleet: ParsedFleet, name: str, component: str, shard: int | None = None) -> Object:
    """The metadata of an object the fleet owns: its labels (fleet, component, shard) and the fleet as
    its controlling owner."""
    labels = {names.LABEL_FLEET: fleet.name, names.LABEL_COMPONENT: component, names.LABEL_MANAGED_BY: "megafleet"}
    if shard is not None:
        labels[names.LABEL_SHARD] = str(shard)
    return {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels,
        "ownerReferences": [
            {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": "MegatronGeneration",
                "name": fleet.name,
                "uid": fleet.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


SHARDS_PER_FRONTENDS_SERVICE = 100
"""Shards whose frontends share one ClusterIP Service, each on a port of its own.

kube-apiserver allocates ClusterIPs one at a time under one lock, about 18 ms of control-plane CPU
each: one Service per shard made a 1,000-pod fleet wait on 1,000 allocations. A frontends Service
selects its fleet's frontend pods, and each of its ports targets a container port named after one
shard (:func:`megafleet.names.frontend_port_name`), which only that shard's frontend pod has: the
EndpointSlice controller gives each shard's port that pod alone, and kube-proxy routes it there."""


def frontends_group(shard: int) -> int:
    """The frontends Service a shard's endpoint is on."""
    return shard // SHARDS_PER_FRONTENDS_SERVICE


def frontend_port(fleet: ParsedFleet, shard: int) -> int:
    """A shard's port on its frontends Service: ``spec.frontend.port`` plus the shard's place in its
    group (counted down instead where counting up would pass 65535). Fixed for the shard's life."""
    base, offset = fleet.spec.frontend.port, shard % SHARDS_PER_FRONTENDS_SERVICE
    return base + offset if base + SHARDS_PER_FRONTENDS_SERVICE - 1 <= 65535 else base - offset


def frontends_services(fleet: ParsedFleet) -> list[Object]:
    """The fleet's frontends Services: one per group of up to
    :data:`SHARDS_PER_FRONTENDS_SERVICE` shards, with a port per shard; none without shards."""
    groups: dict[int, list[int]] = {}
    for shard in range(fleet.spec.replicas):
        groups.setdefault(frontends_group(shard), []).append(shard)
    return [_frontends_service(fleet, group, shards) for group, shards in groups.items()]


def _frontends_service(fleet: ParsedFleet, group: int, shards: list[int]) -> Object:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(fleet, names.frontends_service(fleet.name, group), "frontends"),
        "spec": {
            "type": "ClusterIP",
            "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_COMPONENT: "engine", names.LABEL_POD_INDEX: "0"},
            "ports": [
                {
                    "name": names.frontend_port_name(shard),
                    "protocol": "TCP",
                    "port": frontend_port(fleet, shard),
                    "targetPort": names.frontend_port_name(shard),
                }
                for shard in shards
            ],
        },
    }


def frontend_service(fleet: ParsedFleet, shard: int) -> Object:
    """One shard's own ClusterIP Service, the scheme before the frontends Services: a fleet that
    already has one (:func:`legacy_frontends`) keeps it, so an operator upgrade changes no
    published endpoint."""
    port = fleet.spec.frontend.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(fleet, names.frontend_service(fleet.name, shard), "frontend", shard),
        "spec": {
            "type": "ClusterIP",
            "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_SHARD: str(shard), names.LABEL_POD_INDEX: "0"},
            "ports": [{"name": "http", "protocol": "TCP", "port": port, "targetPort": port}],
        },
    }


def legacy_frontends(services: list[Object]) -> bool:
    """The fleet's own Services include a shard's own frontend Service (made by an operator before
    the frontends Services): the fleet keeps one Service per shard for its whole life."""
    return any(
        (service["metadata"].get("labels") or {}).get(names.LABEL_COMPONENT) == "frontend" for service in services
    )


def ranks_service(fleet: ParsedFleet) -> Object:
    """Headless Service giving every engine pod of the fleet a DNS name (``<pod>.<fleet>-ranks``);
    pod 0's is its shard's master address. One per fleet, as its pods' ``subdomain``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(fleet, names.ranks_service(fleet.name), "ranks"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_COMPONENT: "engine"},
            "ports": [{"name": "rendezvous", "protocol": "TCP", "port": ports.MASTER_PORT}],
        },
    }


def services(fleet: ParsedFleet, *, legacy: bool) -> list[Object]:
    """Every Service the fleet needs: its frontends Services (or, ``legacy``, one frontend Service
    per shard), and its ranks Service when a shard has several pods (a one-pod shard's ranks meet
    on the pod itself: nothing to resolve). None without shards."""
    shards = range(fleet.spec.replicas)
    wanted = [frontend_service(fleet, shard) for shard in shards] if legacy else frontends_services(fleet)
    if fleet.layout.pods_per_shard > 1 and fleet.spec.replicas > 0:
        wanted.append(ranks_service(fleet))
    return wanted


def master_address(fleet: ParsedFleet, shard: int) -> str:
    """Where a shard's ranks rendezvous: pod 0's name under the ranks Service, or the loopback
    address for a one-pod shard (every rank runs in that pod)."""
    if fleet.layout.pods_per_shard == 1:
        return LOOPBACK
    return f"{names.pod(fleet.name, shard, 0)}.{names.ranks_service(fleet.name)}.{fleet.namespace}.svc"


def agent_secret(fleet: ParsedFleet, token: str) -> Object:
    """The per-fleet bearer token agents require from the operator."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(fleet, names.agent_secret(fleet.name), "agent-token"),
        "data": {names.AGENT_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def endpoint(fleet: ParsedFleet, shard: int, service: Object) -> v1alpha1.Endpoint:
    """A shard's published endpoint on the Service that carries it (its frontends Service, or its
    own Service in a legacy fleet), at the Service's port for the shard."""
    name = service["metadata"]["name"]
    shard_port = names.frontend_port_name(shard)
    port = next(
        (item["port"] for item in service["spec"]["ports"] if item.get("name") in (shard_port, "http")),
        fleet.spec.frontend.port,
    )
    return v1alpha1.Endpoint(
        shard=shard,
        url=f"http://{service['spec']['clusterIP']}:{port}/v1",
        dns_url=f"http://{name}.{fleet.namespace}.svc:{port}/v1",
        service=name,
    )


def endpoints_configmap(fleet: ParsedFleet, endpoints: list[v1alpha1.Endpoint]) -> Object:
    """What an RL job mounts or reads: every frontend URL, one per shard."""
    listed = [endpoint.model_dump(mode="json", by_alias=True) for endpoint in endpoints]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(fleet, names.endpoints_configmap(fleet.name), "endpoints"),
        "data": {
            "endpoints.json": json.dumps(listed, indent=2, sort_keys=True),
            "urls": "".join(f"{endpoint.url}\n" for endpoint in endpoints),
            "dns-urls": "".join(f"{endpoint.dns_url}\n" for endpoint in endpoints),
        },
    }


def template_hash(fleet: ParsedFleet) -> str:
    """A hash of every spec field that shapes a pod; pods with another hash are rolled.

    Fields added after the first release enter only when set (:data:`_ADDED_LATER`, ``pod`` when not
    its default, ``refit.staging`` and its headroom when staging is not off, ``placement.gang`` when a
    gang scheduler is named), so an operator upgrade
    never rolls a fleet that does not use them."""
    spec = fleet.spec
    shaping: dict[str, object] = {
        "model": spec.model,
        "weights": {"initial": spec.weights.initial},  # catchUp is the operator's, read between refits
        "parallelism": spec.parallelism,
        "resources": spec.resources,
        "frontend": spec.frontend,
        "engine": spec.engine,
        "tolerations": spec.placement.tolerations,
        "nodeSelector": spec.placement.node_selector,
    }
    if spec.pod != v1alpha1.PodSpec():
        shaping["pod"] = spec.pod
    if spec.placement.gang.scheduler != "None":  # Kueue's pod group labels (megafleet.kueue)
        shaping["gang"] = spec.placement.gang
    if spec.refit.staging != "off":  # the engines allocate the staging copy at start
        shaping["refitStaging"] = {"staging": spec.refit.staging, "headroomMiB": spec.refit.staging_headroom_mi_b}
    text = json.dumps(
        {
            key: value if isinstance(value, dict) else _without_added_defaults(_dump(value))
            for key, value in shaping.items()
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_ADDED_LATER: dict[str, object] = {"extra": {}, "envFrom": [], "valueFrom": None, "placedBy": "Operator"}
"""Fields of ``resources``, ``engine``, ``engine.env[]`` and ``placement.gang`` added after the first
release, at their defaults."""


def _without_added_defaults(value: object) -> object:
    if isinstance(value, dict):
        return {
            key: _without_added_defaults(item)
            for key, item in value.items()
            if key not in _ADDED_LATER or item != _ADDED_LATER[key]
        }
    if isinstance(value, list):
        return [_without_added_defaults(item) for item in value]
    return value


def _dump(value: object) -> object:
    if isinstance(value, list):
        return [_dump(item) for item in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    return value


def shard_pods(
    fleet: ParsedFleet, shard: int, placement: planner.ShardPlacement | None, *, defer_weights: bool = False
) -> list[Object]:
    """Every pod of one placed shard, pinned to the placement's nodes (and clique); with no
    ``placement`` (``gang.placedBy: Kueue``: Kueue's Topology Aware Scheduling chooses the clique and
    the nodes when it admits the shard) pinned to nothing but ``placement.nodeSelector``.

    ``defer_weights``: start the engines without weights (``MEGAFLEET_WEIGHTS_INITIAL=refit``) whatever
    ``spec.weights.initial`` says; the reconcile asks for it once a refit has moved the fleet past the
    checkpoint, so a restarted or added shard never serves the checkpoint's stale weights."""
    layout = fleet.layout
    return [
        _pod(fleet, shard, index, layout, placement, defer_weights=defer_weights)
        for index in range(layout.pods_per_shard)
    ]


def _pod(
    fleet: ParsedFleet,
    shard: int,
    index: int,
    layout: planner.PodLayout,
    placement: planner.ShardPlacement | None,
    *,
    defer_weights: bool,
) -> Object:
    spec = fleet.spec
    name = names.pod(fleet.name, shard, index)
    meta = metadata(fleet, name, "engine", shard)
    # The user's labels and annotations first: the operator's own keys win on conflict.
    meta["labels"] = {**spec.pod.labels, **meta["labels"], names.LABEL_POD_INDEX: str(index)}
    meta["annotations"] = {**spec.pod.annotations, names.ANNOTATION_TEMPLATE_HASH: template_hash(fleet)}
    resources: Object = {**spec.resources.extra, "cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if layout.gpus_per_pod:
        resources[spec.resources.gpu_resource] = str(layout.gpus_per_pod)
    container_ports = [
        {"name": "agent", "containerPort": ports.AGENT_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": ports.METRICS_PORT, "protocol": "TCP"},
    ]
    container: Object = {}
    if index == 0:
        port_name = names.frontend_port_name(shard)
        container_ports.insert(0, {"name": port_name, "containerPort": spec.frontend.port, "protocol": "TCP"})
        # The frontend's /health answers 503 unless the engine serves (loading, Stale, fenced):
        # such a pod leaves its Service's endpoints. Suspended for a refit it answers 200: requests
        # are held and served by the new version (megafleet_engine.server.build_frontend_app).
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": port_name},
            "periodSeconds": 2,
            "failureThreshold": 1,
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {
            "hostname": name,
            **({"subdomain": names.ranks_service(fleet.name)} if layout.pods_per_shard > 1 else {}),
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "enableServiceLinks": False,
            **_pod_identity(spec.pod),
            **({"affinity": _affinity(fleet, placement, index)} if placement is not None else {}),
            "nodeSelector": dict(spec.placement.node_selector),
            "tolerations": [
                t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in spec.placement.tolerations
            ],
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "fsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "engine",
                    "image": spec.engine.image,
                    "imagePullPolicy": spec.engine.image_pull_policy,
                    "command": ["megafleet-engine"],
                    "args": list(spec.engine.args),
                    "env": _env(fleet, shard, index, layout, defer_weights=defer_weights),
                    **(
                        {
                            "envFrom": [
                                item.model_dump(mode="json", by_alias=True, exclude_none=True)
                                for item in spec.engine.env_from
                            ]
                        }
                        if spec.engine.env_from
                        else {}
                    ),
                    "ports": container_ports,
                    **container,
                    "resources": {"requests": resources, "limits": resources},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": _mounts(spec.pod),
                }
            ],
            "volumes": _volumes(fleet),
        },
    }


def _pod_identity(pod: v1alpha1.PodSpec) -> Object:
    """The pod-level fields ``spec.pod`` sets: service account, token, classes, pull secrets."""
    fields: Object = {"automountServiceAccountToken": pod.automount_service_account_token}
    if pod.service_account_name:
        fields["serviceAccountName"] = pod.service_account_name
    if pod.priority_class_name:
        fields["priorityClassName"] = pod.priority_class_name
    if pod.runtime_class_name:
        fields["runtimeClassName"] = pod.runtime_class_name
    if pod.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": secret.name} for secret in pod.image_pull_secrets]
    return fields


def _volumes(fleet: ParsedFleet) -> list[Object]:
    """The operator's volumes (agent token, /tmp, /dev/shm, the cache unless a user volume holds it),
    then the user's; validation keeps their names apart (``v1alpha1.PodSpec``)."""
    pod = fleet.spec.pod
    shm: Object = {"medium": "Memory"}
    if pod.shm_size:
        shm["sizeLimit"] = pod.shm_size
    volumes: list[Object] = [
        {
            "name": names.VOLUME_AGENT_TOKEN,
            "secret": {"secretName": names.agent_secret(fleet.name), "defaultMode": 0o440},
        },
        {"name": names.VOLUME_TMP, "emptyDir": {}},
        {"name": names.VOLUME_SHM, "emptyDir": shm},
    ]
    if pod.cache.volume is None:
        cache = {"sizeLimit": pod.cache.size_limit} if pod.cache.size_limit else {}
        volumes.append({"name": names.VOLUME_CACHE, "emptyDir": cache})
    return volumes + [volume.source() for volume in pod.volumes]


def _mounts(pod: v1alpha1.PodSpec) -> list[Object]:
    """The engine container's mounts: the operator's, then the user's (never at or over the operator's)."""
    return [
        {"name": names.VOLUME_AGENT_TOKEN, "mountPath": names.AGENT_TOKEN_MOUNT, "readOnly": True},
        {"name": names.VOLUME_TMP, "mountPath": names.TMP_MOUNT},
        {"name": names.VOLUME_SHM, "mountPath": names.SHM_MOUNT},
        {"name": pod.cache.volume or names.VOLUME_CACHE, "mountPath": names.CACHE_MOUNT},
        *(mount.model_dump(mode="json", by_alias=True, exclude_none=True) for mount in pod.volume_mounts),
    ]


NODE_NAME_FIELD = "metadata.name"
"""The node field a pod's affinity pins it by (:func:`_affinity`)."""
LOOPBACK = "127.0.0.1"

CACHE_ENV = {
    "HOME": names.TMP_MOUNT,
    "XDG_CACHE_HOME": names.CACHE_MOUNT,
    "HF_HOME": f"{names.CACHE_MOUNT}/huggingface",
    "TRITON_CACHE_DIR": f"{names.CACHE_MOUNT}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{names.CACHE_MOUNT}/torchinductor",
    "TORCH_EXTENSIONS_DIR": f"{names.CACHE_MOUNT}/torch_extensions",
    "CUDA_CACHE_PATH": f"{names.CACHE_MOUNT}/nv/ComputeCache",
    "CUTE_DSL_CACHE_DIR": f"{names.CACHE_MOUNT}/cute_dsl",
}
"""Where the engine's libraries write (Hugging Face, Triton, torch inductor and extensions, the CUDA JIT,
the CUTLASS DSL): the root filesystem is read-only, so each points into a writable volume. Set on every
engine pod whatever its image; a variable of the same name in ``engine.env`` replaces it."""


def _affinity(fleet: ParsedFleet, placement: planner.ShardPlacement, index: int) -> Object:
    """Pin pod ``index`` to the node the planner chose for it (and the shard's clique), so a
    placement is exactly what the planner decided and its GPUs count before the pod is bound.

    The node is named by a ``metadata.name`` field selector, not the hostname label: the scheduler
    then filters that one node instead of every node of the cluster (its node-affinity pre-filter
    narrows a ``metadata.name`` term to the named nodes), and a node whose hostname label differs
    from its name is still the one the planner meant."""
    term: Object = {"matchFields": [{"key": NODE_NAME_FIELD, "operator": "In", "values": [placement.pods[index].node]}]}
    if placement.clique is not None:
        clique = {"key": fleet.spec.placement.clique_label, "operator": "In", "values": [placement.clique]}
        term["matchExpressions"] = [clique]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _env(fleet: ParsedFleet, shard: int, index: int, layout: planner.PodLayout, *, defer_weights: bool) -> list[Object]:
    spec = fleet.spec
    master = master_address(fleet, shard)
    values = {
        env.FLEET: fleet.name,
        env.SHARD: str(shard),
        env.MODEL_SOURCE: spec.model.source,
        env.SERVED_MODEL_NAME: spec.model.served_name or fleet.name,
        env.BACKEND: spec.engine.backend,
        env.DTYPE: spec.model.dtype,
        env.MAX_SEQUENCE_LENGTH: str(spec.model.max_sequence_length),
        env.MAX_BATCH_SIZE: str(spec.engine.max_batch_size),
        env.WEIGHTS_INITIAL: "refit" if defer_weights else spec.weights.initial,
        env.KV_CACHE_MODE: spec.engine.kv_cache_mode,
        env.CUDA_GRAPHS: "true" if checks.cuda_graphs_enabled(spec) else "false",
        env.REFIT_STAGING: spec.refit.staging,
        env.REFIT_STAGING_HEADROOM_MIB: str(spec.refit.staging_headroom_mi_b),
        env.TENSOR_PARALLEL: str(spec.parallelism.tensor),
        env.PIPELINE_PARALLEL: str(spec.parallelism.pipeline),
        env.FRONTEND_PORT: str(spec.frontend.port),
        env.AGENT_PORT: str(ports.AGENT_PORT),
        env.METRICS_PORT: str(ports.METRICS_PORT),
        env.AGENT_TOKEN_FILE: f"{names.AGENT_TOKEN_MOUNT}/{names.AGENT_TOKEN_KEY}",
        env.RANK: str(index * layout.ranks_per_pod),  # the pod's first global rank in the shard
        env.WORLD_SIZE: str(layout.pods_per_shard * layout.ranks_per_pod),
        env.LOCAL_GPUS: str(layout.gpus_per_pod),
        env.MASTER_ADDR: master,
        env.MASTER_PORT: str(ports.MASTER_PORT),
    }
    items: list[Object] = [{"name": env.HOST, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    items += [{"name": key, "value": literal(value)} for key, value in values.items()]
    if spec.frontend.api_key_secret is not None:
        items.append(
            {
                "name": env.API_KEY,
                "valueFrom": {
                    "secretKeyRef": {"name": spec.frontend.api_key_secret.name, "key": spec.frontend.api_key_secret.key}
                },
            }
        )
    user = {item.name for item in spec.engine.env}
    items += [{"name": key, "value": value} for key, value in CACHE_ENV.items() if key not in user]
    # The user's own variables keep Kubernetes' meaning: $(NAME) in them refers to another variable.
    items += [_user_variable(item) for item in spec.engine.env]
    return items


def _user_variable(item: v1alpha1.EnvVar) -> Object:
    if item.value_from is None:
        return {"name": item.name, "value": item.value}
    return {"name": item.name, "valueFrom": item.value_from.model_dump(mode="json", by_alias=True, exclude_none=True)}


def literal(value: str) -> str:
    """``value`` escaped for a container's env: the kubelet expands ``$(NAME)`` there and turns ``$$``
    into ``$``, so doubling every ``$`` makes the engine see exactly ``value`` (a model source or served
    name holding ``$(MEGAFLEET_HOST)`` stays that text)."""
    return value.replace("$", "$$")
