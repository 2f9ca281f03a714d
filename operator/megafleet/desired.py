"""Pure builders of the objects a fleet owns: Services, ConfigMap, Secret and the pods of a shard.

Called by :mod:`megafleet.reconcile`. No API calls here: each function maps the typed spec (and,
for pods, the planner's placement) to plain Kubernetes JSON, so the shapes are unit-tested alone.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from typing import Any

from megafleet import names, planner
from megafleet.api import checks, v1alpha1
from megafleet_protocol import env, ports

Object = dict[str, Any]


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


def _meta(fleet: ParsedFleet, name: str, component: str, shard: int | None = None) -> Object:
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


def frontend_service(fleet: ParsedFleet, shard: int) -> Object:
    """ClusterIP Service of a shard's frontend: created first, its address is the reserved endpoint."""
    port = fleet.spec.frontend.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(fleet, names.frontend_service(fleet.name, shard), "frontend", shard),
        "spec": {
            "type": "ClusterIP",
            "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_SHARD: str(shard), names.LABEL_POD_INDEX: "0"},
            "ports": [{"name": "http", "protocol": "TCP", "port": port, "targetPort": port}],
        },
    }


def ranks_service(fleet: ParsedFleet, shard: int) -> Object:
    """Headless Service giving every pod of a shard a DNS name; pod 0's is the master address."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(fleet, names.ranks_service(fleet.name, shard), "ranks", shard),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_SHARD: str(shard)},
            "ports": [{"name": "rendezvous", "protocol": "TCP", "port": ports.MASTER_PORT}],
        },
    }


def agent_secret(fleet: ParsedFleet, token: str) -> Object:
    """The per-fleet bearer token agents require from the operator."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(fleet, names.agent_secret(fleet.name), "agent-token"),
        "data": {names.AGENT_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def endpoint(fleet: ParsedFleet, shard: int, cluster_ip: str) -> v1alpha1.Endpoint:
    service = names.frontend_service(fleet.name, shard)
    port = fleet.spec.frontend.port
    return v1alpha1.Endpoint(
        shard=shard,
        url=f"http://{cluster_ip}:{port}/v1",
        dns_url=f"http://{service}.{fleet.namespace}.svc:{port}/v1",
        service=service,
    )


def endpoints_configmap(fleet: ParsedFleet, endpoints: list[v1alpha1.Endpoint]) -> Object:
    """What an RL job mounts or reads: every frontend URL, one per shard."""
    listed = [endpoint.model_dump(mode="json", by_alias=True) for endpoint in endpoints]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(fleet, names.endpoints_configmap(fleet.name), "endpoints"),
        "data": {
            "endpoints.json": json.dumps(listed, indent=2, sort_keys=True),
            "urls": "".join(f"{endpoint.url}\n" for endpoint in endpoints),
            "dns-urls": "".join(f"{endpoint.dns_url}\n" for endpoint in endpoints),
        },
    }


def template_hash(fleet: ParsedFleet) -> str:
    """A hash of every spec field that shapes a pod; pods with another hash are rolled."""
    spec = fleet.spec
    shaping = {
        "model": spec.model,
        "weights": spec.weights,
        "parallelism": spec.parallelism,
        "resources": spec.resources,
        "frontend": spec.frontend,
        "engine": spec.engine,
        "tolerations": spec.placement.tolerations,
        "nodeSelector": spec.placement.node_selector,
    }
    text = json.dumps(
        {key: value if isinstance(value, dict) else _dump(value) for key, value in shaping.items()}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dump(value: object) -> object:
    if isinstance(value, list):
        return [_dump(item) for item in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    return value


def shard_pods(
    fleet: ParsedFleet, shard: int, placement: planner.ShardPlacement, *, defer_weights: bool = False
) -> list[Object]:
    """Every pod of one placed shard, pinned to the placement's nodes (and clique).

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
    placement: planner.ShardPlacement,
    *,
    defer_weights: bool,
) -> Object:
    spec = fleet.spec
    name = names.pod(fleet.name, shard, index)
    metadata = _meta(fleet, name, "engine", shard)
    metadata["labels"][names.LABEL_POD_INDEX] = str(index)
    metadata["annotations"] = {names.ANNOTATION_TEMPLATE_HASH: template_hash(fleet)}
    resources: Object = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    if layout.gpus_per_pod:
        resources[spec.resources.gpu_resource] = str(layout.gpus_per_pod)
    container_ports = [
        {"name": "agent", "containerPort": ports.AGENT_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": ports.METRICS_PORT, "protocol": "TCP"},
    ]
    container: Object = {}
    if index == 0:
        container_ports.insert(0, {"name": "http", "containerPort": spec.frontend.port, "protocol": "TCP"})
        # The frontend's /health answers 503 unless the engine serves (loading, Stale, fenced):
        # such a pod leaves its Service's endpoints. Suspended for a refit it answers 200: requests
        # are held and served by the new version (megafleet_engine.server.build_frontend_app).
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 2,
            "failureThreshold": 1,
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "hostname": name,
            "subdomain": names.ranks_service(fleet.name, shard),
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "affinity": _affinity(fleet, placement, index),
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
                    "ports": container_ports,
                    **container,
                    "resources": {"requests": resources, "limits": resources},
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "volumeMounts": [
                        {"name": "agent-token", "mountPath": names.AGENT_TOKEN_MOUNT, "readOnly": True},
                        {"name": "tmp", "mountPath": "/tmp"},
                    ],
                }
            ],
            "volumes": [
                {"name": "agent-token", "secret": {"secretName": names.agent_secret(fleet.name), "defaultMode": 0o440}},
                {"name": "tmp", "emptyDir": {}},
            ],
        },
    }


def _affinity(fleet: ParsedFleet, placement: planner.ShardPlacement, index: int) -> Object:
    """Pin pod ``index`` to the node the planner chose for it (and the shard's clique), so a
    placement is exactly what the planner decided and its GPUs count before the pod is bound."""
    expressions = [{"key": "kubernetes.io/hostname", "operator": "In", "values": [placement.pods[index].node]}]
    if placement.clique is not None:
        expressions.append({"key": fleet.spec.placement.clique_label, "operator": "In", "values": [placement.clique]})
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": expressions}]}
        }
    }


def _env(fleet: ParsedFleet, shard: int, index: int, layout: planner.PodLayout, *, defer_weights: bool) -> list[Object]:
    spec = fleet.spec
    master = f"{names.pod(fleet.name, shard, 0)}.{names.ranks_service(fleet.name, shard)}.{fleet.namespace}.svc"
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
    # The user's own variables keep Kubernetes' meaning: $(NAME) in them refers to another variable.
    items += [{"name": item.name, "value": item.value} for item in spec.engine.env]
    return items


def literal(value: str) -> str:
    """``value`` escaped for a container's env: the kubelet expands ``$(NAME)`` there and turns ``$$``
    into ``$``, so doubling every ``$`` makes the engine see exactly ``value`` (a model source or served
    name holding ``$(MEGAFLEET_HOST)`` stays that text)."""
    return value.replace("$", "$$")
