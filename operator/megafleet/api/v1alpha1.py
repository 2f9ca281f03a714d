"""``megafleet.dev/v1alpha1``: the typed source of truth for the MegatronGeneration, Refit and
RefitSession kinds.

The CRD YAML in ``crds/`` and the API reference in ``docs/api.md`` are generated from these models
(:mod:`megafleet.api.crd`, ``megafleet crds``); a test fails when the checked-in files drift. Field
descriptions start with the JSON name; units are in names; there are no floats. Cross-field rules
that CEL can express are declared here as ``x-kubernetes-validations`` and enforced by the API
server at admission; the operator re-checks them, and the rules CEL cannot express, through
:func:`megafleet.planner.validate` and reports ``InvalidSpec``.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel, to_snake
from pydantic.config import JsonDict

from megafleet import names
from megafleet_protocol import env as pod_env
from megafleet_protocol import ports, vocabulary

GROUP = "megafleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

NvlinkPolicy = Literal["Required", "Preferred"]
GangScheduler = Literal["None", "Kueue", "KAI", "Volcano"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ConditionStatus = Literal["True", "False", "Unknown"]
ShardPhase = Literal["Pending", "Starting", "Loading", "Ready", "Stale", "Refitting", "Draining", "Failed"]
RefitPhase = Literal["Pending", "Running", "Succeeded", "Failed"]
RefitSessionPhase = Literal["Pending", "Joining", "Joined", "Broken", "Closed", "Failed"]
CopyBackend = Literal["gloo", "nccl"]

# The rules the API server applies to the objects derived from a spec, so that a spec admitted here
# never yields an object the API server refuses (issue 16).
_QUANTITY = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
"""A non-negative Kubernetes resource quantity (``8``, ``500m``, ``64Gi``, ``1e3``)."""
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name: a DNS-1035 label (a letter first, no dots), at most 63 characters."""
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_EXTENDED_RESOURCE = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""An extended resource name: ``<domain>/<name>``, the domain not under kubernetes.io (checked apart)."""
_PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
"""No NUL or other control character: strings that reach a pod's env or command line."""
_NO_NUL = r"^[^\x00]*$"
_HOST = r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$"
"""A host name or an IPv4 or IPv6 address, nothing else (no spaces, no shell)."""
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""An object name most kinds accept (Secret, ConfigMap, PVC, ServiceAccount, PriorityClass)."""
_ABSOLUTE_PATH = r"^(/[^/\x00-\x1f\x7f]+)+$"
"""An absolute path without an empty segment or a trailing slash (``/`` itself is not one)."""
NAME_MAX = 63
"""Derived names (Services, pod host names) and the fleet label value are at most 63 characters."""


def _cel(rule: str, message: str, *, field_path: str | None = None, reason: str | None = None) -> JsonDict:
    """One ``x-kubernetes-validations`` entry: a CEL rule the API server enforces at admission."""
    validation: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        validation["fieldPath"] = field_path
    if reason is not None:
        validation["reason"] = reason
    return validation


def _defaulted(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Schema extra for an optional object field: its complete default, so the API server fills it
    in (CEL rules see every field of it) when the user leaves the object out."""
    return {"default": model().model_dump(mode="json", by_alias=True, exclude_none=True)}


class ApiModel(pydantic.BaseModel):
    """Base of every API object: camelCase JSON names, unknown fields rejected, frozen values."""

    model_config = pydantic.ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, validate_default=True
    )


# -- spec ------------------------------------------------------------------------------------------


class ModelSpec(ApiModel):
    """What model the engines serve."""

    source: str = Field(
        min_length=1,
        max_length=2048,
        pattern=_PRINTABLE,
        description="source is the checkpoint location (a path inside the engine pod, or a URI the "
        "backend can read) holding the model config, tokenizer and, unless weights.initial is refit, "
        "the weights.",
    )
    tokenizer: str | None = Field(
        default=None,
        max_length=2048,
        pattern=_PRINTABLE,
        description="tokenizer is the tokenizer location when it is not in source.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        pattern=_PRINTABLE,
        description="servedName is the model name clients send in the OpenAI API; defaults to the fleet's name.",
    )
    dtype: vocabulary.Dtype = Field(default="bfloat16", description="dtype is the parameter data type of the engines.")
    max_sequence_length: int = Field(
        default=4096,
        ge=16,
        le=1048576,
        description="maxSequenceLength is the longest prompt plus completion, in tokens.",
    )


class WeightsSpec(ApiModel):
    """Where the first weights come from."""

    initial: vocabulary.WeightsInitial = Field(
        default="checkpoint",
        description="initial is checkpoint (load weights from model.source at start) or refit (start "
        "without weights and become Ready only when the first Refit has delivered them; NeMo RL's "
        "skip_weight_load).",
    )


class ParallelismSpec(ApiModel):
    """Parallel sizes of one shard (one data-parallel replica of the model)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(self.tensor * self.context) % (self.expert * self.expertTensor) == 0",
                    "expert * expertTensor must divide tensor * context: each shard is its own engine "
                    "world, so expert groups are carved out of its tensor x context ranks",
                    field_path=".expert",
                ),
            ]
        }
    )

    tensor: int = Field(default=1, ge=1, le=512, description="tensor is the tensor-parallel size (TP).")
    pipeline: int = Field(default=1, ge=1, le=128, description="pipeline is the pipeline-parallel size (PP).")
    context: int = Field(
        default=1,
        ge=1,
        le=64,
        description="context is the context-parallel size (CP); megatron-core's inference engine needs 1.",
    )
    expert: int = Field(default=1, ge=1, le=1024, description="expert is the expert-parallel size (EP).")
    expert_tensor: int = Field(
        default=1, ge=1, le=512, description="expertTensor is the expert tensor-parallel size (ETP)."
    )


_Quantity = Annotated[str, Field(max_length=64, pattern=_QUANTITY)]
_RESOURCE_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_EXTRA_RESOURCES = (
    "extra names resources ([domain/]name) beside cpu, memory and gpuResource, which have their own fields"
)


def _extra_resource_problem(extra: dict[str, str], gpu_resource: str) -> str | None:
    bad = sorted(
        name
        for name in extra
        if not re.fullmatch(_RESOURCE_NAME, name) or len(name) > 316 or name in ("cpu", "memory", gpu_resource)
    )
    return f"{_EXTRA_RESOURCES}, got {bad}" if bad else None


class ResourcesSpec(ApiModel):
    """Hardware of every engine pod."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!self.gpuResource.contains('kubernetes.io/')",
                    "gpuResource must be an extended resource (<domain>/<name>), not one of Kubernetes' own",
                    field_path=".gpuResource",
                ),
                _cel(
                    f"!has(self.extra) || self.extra.all(name, name.matches(r'{_RESOURCE_NAME}') && "
                    "!(name in ['cpu', 'memory', self.gpuResource]))",
                    _EXTRA_RESOURCES,
                    field_path=".extra",
                ),
            ]
        }
    )

    gpus_per_node: int = Field(
        default=8,
        ge=0,
        le=64,
        description="gpusPerNode is how many GPUs one node offers to the fleet; a shard smaller than a "
        "node must divide it, a larger one must be a multiple of it. 0 makes a CPU fleet.",
    )
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        max_length=253,
        pattern=_EXTENDED_RESOURCE,
        description="gpuResource is the extended resource name GPUs are requested by (<domain>/<name>).",
    )
    cpu: str = Field(
        default="8",
        max_length=64,
        pattern=_QUANTITY,
        description="cpu is the CPU request of each engine pod, a non-negative quantity.",
    )
    memory: str = Field(
        default="64Gi",
        max_length=64,
        pattern=_QUANTITY,
        description="memory is the memory request of each engine pod, a non-negative quantity.",
    )
    extra: dict[str, _Quantity] = Field(
        default_factory=dict,
        max_length=32,
        description="extra resources every engine pod requests and is limited to, name to quantity "
        "(e.g. rdma/ib: 1, ephemeral-storage: 200Gi, hugepages-2Mi: 1Gi); not cpu, memory nor gpuResource.",
    )

    @pydantic.model_validator(mode="after")
    def _extra_names(self) -> ResourcesSpec:
        problem = _extra_resource_problem(self.extra, self.gpu_resource)
        if problem:
            raise ValueError(problem)
        return self

    @pydantic.field_validator("gpu_resource")
    @classmethod
    def _extended(cls, name: str) -> str:
        if "kubernetes.io/" in name:
            raise ValueError("gpuResource must be an extended resource (<domain>/<name>), not one of Kubernetes' own")
        return name


_EMPTY_KEY = "operator must be Exists when key is empty (an empty key matches every taint)"
_EXISTS_VALUE = "value must be empty when operator is Exists"


class Toleration(ApiModel):
    """A pod toleration, as in the core API (and refused where the core API refuses it)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(has(self.key) && self.key != '') || self.operator == 'Exists'",
                    _EMPTY_KEY,
                    field_path=".operator",
                ),
                _cel(
                    "self.operator != 'Exists' || !has(self.value) || self.value == ''",
                    _EXISTS_VALUE,
                    field_path=".value",
                ),
            ]
        }
    )

    key: str | None = Field(
        default=None,
        max_length=316,
        pattern=f"^$|{_LABEL_KEY}",
        description="key is the taint key; empty (with operator Exists) matches every taint.",
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="operator is Exists or Equal.")
    value: str | None = Field(
        default=None, max_length=63, pattern=_LABEL_VALUE, description="value is the taint value for Equal."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="effect is the taint effect to match; empty matches all."
    )

    @pydantic.model_validator(mode="after")
    def _core_rules(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError(_EMPTY_KEY)
        if self.operator == "Exists" and self.value:
            raise ValueError(_EXISTS_VALUE)
        return self


class GangSpec(ApiModel):
    """Hints for a gang scheduler; megafleet places shards whole either way."""

    scheduler: GangScheduler = Field(
        default="None", description="scheduler is None, Kueue, KAI or Volcano; megafleet adds its annotations."
    )
    queue: str | None = Field(default=None, max_length=253, description="queue is the scheduler's queue name.")


_LabelValue = Annotated[str, Field(max_length=63, pattern=_LABEL_VALUE)]


class PlacementSpec(ApiModel):
    """Where shards go."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"!has(self.nodeSelector) || self.nodeSelector.all(key, key.matches(r'{_LABEL_KEY}'))",
                    "nodeSelector keys must be label keys ([prefix/]name)",
                    field_path=".nodeSelector",
                ),
            ]
        }
    )

    clique_label: str = Field(
        default="nvidia.com/gpu.clique",
        max_length=316,
        pattern=_LABEL_KEY,
        description="cliqueLabel is the node label naming a node's NVLink domain (clique).",
    )
    nvlink: NvlinkPolicy = Field(
        default="Required",
        description="nvlink is Required (a shard whose NVLink span exceeds a node is placed only inside "
        "one clique) or Preferred (one clique if possible, else any nodes).",
    )
    spread_shards: bool = Field(
        default=False,
        description="spreadShards spreads shards across cliques instead of packing them to keep whole cliques free.",
    )
    node_selector: dict[str, _LabelValue] = Field(
        default_factory=dict, max_length=64, description="nodeSelector restricts the nodes shards may use."
    )

    @pydantic.field_validator("node_selector")
    @classmethod
    def _label_keys(cls, selector: dict[str, str]) -> dict[str, str]:
        bad = sorted(key for key in selector if not re.fullmatch(_LABEL_KEY, key) or len(key) > 316)
        if bad:
            raise ValueError(f"nodeSelector keys must be label keys ([prefix/]name), got {bad}")
        return selector

    tolerations: list[Toleration] = Field(
        default_factory=lambda: [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
        max_length=32,
        description="tolerations are added to every engine pod; the default tolerates GPU node taints.",
    )
    gang: GangSpec = Field(
        default_factory=GangSpec, json_schema_extra=_defaulted(GangSpec), description="gang holds gang-scheduler hints."
    )


class SecretKeyRef(ApiModel):
    """A key in a Secret of the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_LABEL, description="name is the Secret's name.")
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="key is the key in the Secret.",
    )


class FrontendSpec(ApiModel):
    """The OpenAI-compatible HTTP frontends (one per shard)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.port != {ports.AGENT_PORT} && self.port != {ports.METRICS_PORT}",
                    f"port must differ from the agent port {ports.AGENT_PORT} and the metrics port "
                    f"{ports.METRICS_PORT}",
                    field_path=".port",
                ),
            ]
        }
    )

    port: int = Field(default=8000, ge=1024, le=65535, description="port is the frontend's HTTP port.")
    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="apiKeySecret, when set, makes frontends require this key as a bearer token."
    )

    @pydantic.field_validator("port")
    @classmethod
    def _port_free(cls, port: int) -> int:
        if port in (ports.AGENT_PORT, ports.METRICS_PORT):
            raise ValueError(
                f"port must differ from the agent port {ports.AGENT_PORT} and the metrics port {ports.METRICS_PORT}"
            )
        return port


class RefitSpec(ApiModel):
    """How refits from the trainer run."""

    transport: vocabulary.Transport = Field(
        default="broadcast",
        description="transport is broadcast (every inference rank receives full tensors and keeps its "
        "shard) or reshard (each rank receives, point to point, only the slices its layout needs; a "
        "transformers rank holds whole tensors, so it receives all of them).",
    )
    bucket_size_mi_b: int = Field(
        default=1024,
        ge=1,
        le=65536,
        alias="bucketSizeMiB",
        description="bucketSizeMiB is the size of the buckets weights are sent in, in MiB.",
    )
    timeout_seconds: int = Field(
        default=300,
        ge=1,
        le=86400,
        description="timeoutSeconds bounds one refit attempt; the in-pod watchdog aborts past it.",
    )
    history_limit: int = Field(
        default=10,
        ge=1,
        le=1000,
        description="historyLimit is how many finished Refit objects of this fleet are kept.",
    )


class KeySelector(ApiModel):
    """A key of a Secret or ConfigMap in the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="name of the object.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="key in the object.")
    optional: bool | None = Field(default=None, description="optional: a missing object or key is no error.")


class FieldSelector(ApiModel):
    """A field of the pod itself (the core API's fieldRef)."""

    field_path: str = Field(
        min_length=1,
        max_length=256,
        pattern=_PRINTABLE,
        description="fieldPath, e.g. spec.nodeName, status.hostIP or metadata.labels['<key>'].",
    )


class EnvVarSource(ApiModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key and a pod field."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)].filter(x, x).size() == 1",
                    "set exactly one of secretKeyRef, configMapKeyRef and fieldRef",
                ),
            ]
        }
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="secretKeyRef: a key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="configMapKeyRef: a key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="fieldRef: a field of the pod.")

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        if sum(item is not None for item in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError("set exactly one of secretKeyRef, configMapKeyRef and fieldRef")
        return self


_VALUE_OR_FROM = "set value or valueFrom, not both"


class EnvVar(ApiModel):
    """An environment variable for the engine container."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_cel("!has(self.valueFrom) || self.value == ''", _VALUE_OR_FROM)]
        }
    )

    name: str = Field(
        min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="name of the variable."
    )
    value: str = Field(default="", max_length=32768, pattern=_NO_NUL, description="value of the variable.")
    value_from: EnvVarSource | None = Field(
        default=None, description="valueFrom reads the value from a Secret, a ConfigMap or the pod (e.g. HF_TOKEN)."
    )

    @pydantic.model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value_from is not None and self.value:
            raise ValueError(_VALUE_OR_FROM)
        return self


class ObjectRef(ApiModel):
    """An object of the fleet's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="name of the object.")
    optional: bool | None = Field(default=None, description="optional: a missing object is no error.")


class EnvFromSource(ApiModel):
    """Every key of one Secret or ConfigMap as variables (the core API's envFrom)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("has(self.secretRef) != has(self.configMapRef)", "set exactly one of secretRef and configMapRef")
            ]
        }
    )

    prefix: str | None = Field(
        default=None, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="prefix of every name."
    )
    secret_ref: ObjectRef | None = Field(default=None, description="secretRef: the Secret whose keys become variables.")
    config_map_ref: ObjectRef | None = Field(
        default=None, description="configMapRef: the ConfigMap whose keys become variables."
    )

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("set exactly one of secretRef and configMapRef")
        return self


_OPERATOR_ENV = "env may not set the MEGAFLEET_* variables the operator sets on every engine pod"


class EngineSpec(ApiModel):
    """The inference engine inside each pod."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"!has(self.env) || self.env.all(item, !(item.name in {list(pod_env.SET_BY_OPERATOR)}))",
                    _OPERATOR_ENV,
                    field_path=".env",
                ),
            ]
        }
    )

    backend: vocabulary.BackendName = Field(
        default="megatron",
        description="backend is megatron (megatron-core's inference engine, GPU, TP/PP across ranks) "
        "or transformers (Hugging Face transformers, CPU or one GPU).",
    )
    kv_cache_mode: vocabulary.KvCacheMode = Field(
        default="persist",
        description="kvCacheMode is persist (keep KV cache and CUDA graphs across refits), offload "
        "(free them during a refit, rebuild after) or recompute (drop the KV cache after each refit).",
    )
    cuda_graphs: bool | None = Field(
        default=None,
        description="cudaGraphs captures decode steps as CUDA graphs; unset means on for megatron on GPUs, "
        "off otherwise.",
    )
    max_batch_size: int = Field(
        default=64, ge=1, le=4096, description="maxBatchSize is the most requests decoded together."
    )
    image: str = Field(
        default="megafleet/engine:0.1.0",
        min_length=1,
        max_length=1024,
        pattern=r"^[^\s\x00-\x1f\x7f]+$",
        description="image is the engine image.",
    )
    image_pull_policy: PullPolicy = Field(default="IfNotPresent", description="imagePullPolicy of the engine image.")
    args: list[Annotated[str, Field(max_length=4096, pattern=_NO_NUL)]] = Field(
        default_factory=list, max_length=64, description="args are extra engine arguments."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="env is extra engine environment; the MEGAFLEET_* variables the operator sets are refused. "
        "A variable named here replaces the operator's cache variable of that name (see pod.cache).",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=16,
        description="envFrom adds every key of Secrets or ConfigMaps as variables; env and the operator's own "
        "variables win over them (Kubernetes' order).",
    )

    @pydantic.field_validator("env")
    @classmethod
    def _not_operator_env(cls, items: list[EnvVar]) -> list[EnvVar]:
        taken = sorted({item.name for item in items} & set(pod_env.SET_BY_OPERATOR))
        if taken:
            raise ValueError(f"{_OPERATOR_ENV}: {', '.join(taken)}")
        return items


# -- the pod template's additions (spec.pod) -------------------------------------------------------


class LocalObjectReference(ApiModel):
    """An object of the fleet's namespace, by name alone."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="name of the object.")


class PersistentVolumeClaimSource(ApiModel):
    """A PersistentVolumeClaim of the fleet's namespace (e.g. a model or cache volume)."""

    claim_name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="claimName of the PVC.")
    read_only: bool | None = Field(default=None, description="readOnly mounts the claim read-only.")


class HostPathSource(ApiModel):
    """A directory or file of the node (refused by the baseline and restricted Pod Security levels)."""

    path: str = Field(max_length=4096, pattern=_ABSOLUTE_PATH, description="path on the node.")
    type: Literal[
        "", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"
    ] = Field(default="", description="type the path must have; empty checks nothing.")


class EmptyDirSource(ApiModel):
    """A directory that lives as long as the pod."""

    medium: Literal["", "Memory"] = Field(default="", description="medium: empty (node disk) or Memory (tmpfs).")
    size_limit: str | None = Field(
        default=None, max_length=64, pattern=_QUANTITY, description="sizeLimit of the directory, a quantity."
    )


class ConfigMapVolumeSource(ApiModel):
    """Every key of a ConfigMap as a file."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="name of the ConfigMap.")
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="defaultMode of the files.")
    optional: bool | None = Field(default=None, description="optional: a missing ConfigMap is no error.")


class SecretVolumeSource(ApiModel):
    """Every key of a Secret as a file."""

    secret_name: str = Field(
        min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN, description="secretName of the Secret."
    )
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="defaultMode of the files.")
    optional: bool | None = Field(default=None, description="optional: a missing Secret is no error.")


class CsiSource(ApiModel):
    """An inline CSI volume (e.g. a blob-store FUSE driver)."""

    driver: str = Field(min_length=1, max_length=63, pattern=_DNS_SUBDOMAIN, description="driver name.")
    read_only: bool | None = Field(default=None, description="readOnly asks the driver for a read-only volume.")
    fs_type: str | None = Field(default=None, max_length=63, pattern=_PRINTABLE, description="fsType to mount.")
    volume_attributes: dict[str, Annotated[str, Field(max_length=4096, pattern=_PRINTABLE)]] = Field(
        default_factory=dict, max_length=64, description="volumeAttributes passed to the driver."
    )
    node_publish_secret_ref: LocalObjectReference | None = Field(
        default=None, description="nodePublishSecretRef: a Secret the driver is given."
    )


class ImageSource(ApiModel):
    """An OCI image or artifact mounted read-only (the ImageVolume feature; e.g. a model packaged as an image)."""

    reference: str = Field(
        min_length=1, max_length=1024, pattern=r"^[^\s\x00-\x1f\x7f]+$", description="reference of the image."
    )
    pull_policy: PullPolicy | None = Field(default=None, description="pullPolicy of the image.")


class NfsSource(ApiModel):
    """An NFS export."""

    server: str = Field(min_length=1, max_length=253, pattern=_HOST, description="server: host name or IP.")
    path: str = Field(max_length=4096, pattern=_ABSOLUTE_PATH, description="path of the export.")
    read_only: bool | None = Field(default=None, description="readOnly mounts the export read-only.")


_VOLUME_SOURCES = ("persistentVolumeClaim", "hostPath", "emptyDir", "configMap", "secret", "csi", "image", "nfs")
_ONE_SOURCE = f"set exactly one volume source of {', '.join(_VOLUME_SOURCES)}"


class Volume(ApiModel):
    """A volume of every engine pod: its name and exactly one source."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "[" + ", ".join(f"has(self.{source})" for source in _VOLUME_SOURCES) + "].filter(x, x).size() == 1",
                    _ONE_SOURCE,
                ),
            ]
        }
    )

    name: str = Field(min_length=1, max_length=63, pattern=_DNS_LABEL, description="name the mounts refer to.")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="persistentVolumeClaim: a claim of the fleet's namespace."
    )
    host_path: HostPathSource | None = Field(default=None, description="hostPath: a path on the node.")
    empty_dir: EmptyDirSource | None = Field(default=None, description="emptyDir: scratch space of the pod.")
    config_map: ConfigMapVolumeSource | None = Field(default=None, description="configMap: a ConfigMap's keys.")
    secret: SecretVolumeSource | None = Field(default=None, description="secret: a Secret's keys.")
    csi: CsiSource | None = Field(default=None, description="csi: an inline CSI volume.")
    image: ImageSource | None = Field(default=None, description="image: an OCI image mounted read-only.")
    nfs: NfsSource | None = Field(default=None, description="nfs: an NFS export.")

    @pydantic.model_validator(mode="after")
    def _one_source(self) -> Volume:
        if sum(getattr(self, to_snake(source)) is not None for source in _VOLUME_SOURCES) != 1:
            raise ValueError(_ONE_SOURCE)
        return self

    def source(self) -> dict[str, Any]:
        """The volume as the core API writes it."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class VolumeMount(ApiModel):
    """Where a volume of ``pod.volumes`` appears in the engine container."""

    name: str = Field(min_length=1, max_length=63, pattern=_DNS_LABEL, description="name of a pod.volumes entry.")
    mount_path: str = Field(
        max_length=4096, pattern=_ABSOLUTE_PATH, description="mountPath: an absolute path in the container."
    )
    read_only: bool | None = Field(default=None, description="readOnly mounts it read-only.")
    sub_path: str | None = Field(
        default=None,
        max_length=4096,
        pattern=r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$",
        description="subPath mounts this relative path of the volume instead of its root.",
    )


class CacheSpec(ApiModel):
    """Where the engine's library caches go (HF_HOME, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, ...)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel("!has(self.volume) || !has(self.sizeLimit)", "sizeLimit is for the emptyDir: unset it with volume")
            ]
        }
    )

    volume: str | None = Field(
        default=None,
        max_length=63,
        pattern=_DNS_LABEL,
        description="volume names a pod.volumes entry (e.g. a PVC, so compiled kernels survive restarts) mounted "
        "at the cache directory; unset: an emptyDir per pod.",
    )
    size_limit: str | None = Field(
        default=None, max_length=64, pattern=_QUANTITY, description="sizeLimit of the cache emptyDir, a quantity."
    )

    @pydantic.model_validator(mode="after")
    def _one(self) -> CacheSpec:
        if self.volume is not None and self.size_limit is not None:
            raise ValueError("sizeLimit is for the emptyDir: unset it with volume")
        return self


SHM_OVER_MEMORY = "pod.shmSize may not exceed resources.memory: /dev/shm is memory the pod's limit counts"
_RESERVED_VOLUME = (
    f"volume names {', '.join(names.OPERATOR_VOLUMES[:2])} and megafleet-* are the operator's; choose another name"
)
_RESERVED_MOUNT = (
    f"mountPath may not be, nor contain, the operator's mounts {', '.join(names.OPERATOR_MOUNTS)}, nor lie "
    f"inside {names.AGENT_TOKEN_MOUNT}"
)
_MOUNT_NOT_NORMAL = "mountPath may not contain . or .. segments"
_UNKNOWN_VOLUME = "volumeMounts and cache.volume must name a pod.volumes entry"
_ANNOTATION_KEY = "annotation keys must be qualified names ([prefix/]name)"
_LABEL_ENTRY = "labels must be label keys ([prefix/]name) with label values"


def mount_problem(path: str) -> str | None:
    """Why a user mount at ``path`` would clash with the operator's mounts, or None."""
    if posixpath.normpath(path) != path:
        return _MOUNT_NOT_NORMAL
    covers = any(path == owned or owned.startswith(path + "/") for owned in names.OPERATOR_MOUNTS)
    if covers or path.startswith(names.AGENT_TOKEN_MOUNT + "/"):
        return _RESERVED_MOUNT
    return None


def _reserved_volume(name: str) -> bool:
    return name in names.OPERATOR_VOLUMES or name.startswith("megafleet-")


_MOUNT_CEL = (
    "!has(self.volumeMounts) || self.volumeMounts.all(m, "
    + f"{list(names.OPERATOR_MOUNTS)}.all(o, m.mountPath != o && !o.startsWith(m.mountPath + '/')) && "
    + f"!m.mountPath.startsWith('{names.AGENT_TOKEN_MOUNT}/'))"
)


class PodSpec(ApiModel):
    """What every engine pod carries beside what the operator builds: volumes, pod identity, scheduling
    class, metadata. The operator's own labels, annotations, volumes and mounts win over these."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.volumes) || "
                    "self.volumes.all(v, !(v.name in ['agent-token', 'tmp']) && !v.name.startsWith('megafleet-'))",
                    _RESERVED_VOLUME,
                    field_path=".volumes",
                ),
                _cel(_MOUNT_CEL, _RESERVED_MOUNT, field_path=".volumeMounts"),
                _cel(
                    "!has(self.volumeMounts) || self.volumeMounts.all(m, !m.mountPath.contains('/./') && "
                    "!m.mountPath.contains('/../') && "
                    "!m.mountPath.endsWith('/.') && !m.mountPath.endsWith('/..'))",
                    _MOUNT_NOT_NORMAL,
                    field_path=".volumeMounts",
                ),
                _cel(
                    "(!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                    "self.volumes.exists(v, v.name == m.name))) && (!has(self.cache) || !has(self.cache.volume) || "
                    "(has(self.volumes) && self.volumes.exists(v, v.name == self.cache.volume)))",
                    _UNKNOWN_VOLUME,
                    field_path=".volumeMounts",
                ),
                _cel(
                    f"!has(self.labels) || self.labels.all(k, k.matches(r'{_LABEL_KEY}') && "
                    f"self.labels[k].matches(r'{_LABEL_VALUE}'))",
                    _LABEL_ENTRY,
                    field_path=".labels",
                ),
                _cel(
                    f"!has(self.annotations) || self.annotations.all(k, k.matches(r'{_LABEL_KEY}'))",
                    _ANNOTATION_KEY,
                    field_path=".annotations",
                ),
            ]
        }
    )

    labels: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict,
        max_length=64,
        description="labels added to every engine pod; the operator's own (megafleet.dev/*, "
        "app.kubernetes.io/managed-by) win on conflict.",
    )
    annotations: dict[str, Annotated[str, Field(max_length=65536)]] = Field(
        default_factory=dict,
        max_length=64,
        description="annotations added to every engine pod; the operator's own (megafleet.dev/template-hash) "
        "win on conflict.",
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="serviceAccountName of the engine pods (it must exist); unset: the namespace's default.",
    )
    automount_service_account_token: bool = Field(
        default=False,
        description="automountServiceAccountToken mounts the service account's token (e.g. for workload "
        "identity to a model store); engines do not call the Kubernetes API.",
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="priorityClassName of the engine pods (it must exist).",
    )
    runtime_class_name: str | None = Field(
        default=None,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="runtimeClassName of the engine pods (e.g. nvidia where the GPU runtime is not the default).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="imagePullSecrets: Secrets for pulling the engine image (and image volumes).",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="volumes of every engine pod (PVC, hostPath, emptyDir, ConfigMap, Secret, CSI, image, NFS), "
        "mounted by volumeMounts; agent-token, tmp and megafleet-* are the operator's names.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]},
        description=f"volumeMounts of the engine container; the operator's mounts ({', '.join(names.OPERATOR_MOUNTS)}) "
        "cannot be taken or covered.",
    )
    shm_size: str | None = Field(
        default=None,
        max_length=64,
        pattern=_QUANTITY,
        description=f"shmSize sizes the memory-backed {names.SHM_MOUNT} every engine pod gets (NCCL and torch "
        "need more than the runtime's 64 MiB); it counts against resources.memory, which it may not exceed. "
        "Unset: bounded by resources.memory only.",
    )
    cache: CacheSpec = Field(
        default_factory=CacheSpec,
        json_schema_extra=_defaulted(CacheSpec),
        description=f"cache is where the engine's library caches go, mounted at {names.CACHE_MOUNT}.",
    )

    @pydantic.model_validator(mode="after")
    def _operator_owned(self) -> PodSpec:
        reserved = sorted(volume.name for volume in self.volumes if _reserved_volume(volume.name))
        if reserved:
            raise ValueError(f"{_RESERVED_VOLUME}: {reserved}")
        for mount in self.volume_mounts:
            problem = mount_problem(mount.mount_path)
            if problem:
                raise ValueError(f"{problem}: {mount.mount_path!r}")
        known = {volume.name for volume in self.volumes}
        referenced = {m.name for m in self.volume_mounts} | ({self.cache.volume} if self.cache.volume else set())
        unknown = sorted(referenced - known)
        if unknown:
            raise ValueError(f"{_UNKNOWN_VOLUME}: {unknown}")
        _unique("volumes", [volume.name for volume in self.volumes])
        _unique("volumeMounts", [mount.mount_path for mount in self.volume_mounts])
        _unique("imagePullSecrets", [secret.name for secret in self.image_pull_secrets])
        if any(not re.fullmatch(_LABEL_KEY, k) or not re.fullmatch(_LABEL_VALUE, v) for k, v in self.labels.items()):
            raise ValueError(_LABEL_ENTRY)
        if any(not re.fullmatch(_LABEL_KEY, key) for key in self.annotations):
            raise ValueError(_ANNOTATION_KEY)
        return self


def _unique(field: str, keys: list[str]) -> None:
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"{field}: duplicate {repeated}")


class MegatronGenerationSpec(ApiModel):
    """Desired state of a generation fleet; owned by Git."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.resources.gpusPerNode == 0 || "
                    "(self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context) "
                    "% self.resources.gpusPerNode == 0 || self.resources.gpusPerNode % "
                    "(self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context) == 0",
                    "tensor * pipeline * context (GPUs per shard) must divide resources.gpusPerNode or be a "
                    "multiple of it, so shards fill whole nodes",
                    field_path=".parallelism.tensor",
                ),
                _cel(
                    "self.engine.backend != 'transformers' || (self.parallelism.tensor == 1 && "
                    "self.parallelism.pipeline == 1 && self.parallelism.context == 1 && "
                    "self.parallelism.expert == 1 && self.parallelism.expertTensor == 1)",
                    "the transformers backend runs one rank per shard: set every parallelism size to 1, "
                    "or use the megatron backend",
                    field_path=".parallelism",
                ),
                _cel(
                    "self.resources.gpusPerNode > 0 || self.engine.backend == 'transformers'",
                    "a CPU fleet (resources.gpusPerNode 0) needs engine.backend transformers",
                    field_path=".engine.backend",
                ),
                _cel(
                    "self.engine.backend != 'megatron' || self.parallelism.context == 1",
                    "megatron-core's inference engine has no context parallelism: set parallelism.context to 1",
                    field_path=".parallelism.context",
                ),
                _cel(
                    "self.resources.gpusPerNode > 0 || !has(self.engine.cudaGraphs) || !self.engine.cudaGraphs",
                    "CUDA graphs need GPUs: unset engine.cudaGraphs on a CPU fleet",
                    field_path=".engine.cudaGraphs",
                ),
                _cel(
                    "!has(self.pod.shmSize) || "
                    "quantity(self.pod.shmSize).compareTo(quantity(self.resources.memory)) <= 0",
                    SHM_OVER_MEMORY,
                    field_path=".pod.shmSize",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="model is what the engines serve.")
    weights: WeightsSpec = Field(
        default_factory=WeightsSpec,
        json_schema_extra=_defaulted(WeightsSpec),
        description="weights says where the first weights come from.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=10000,
        description="replicas is the number of shards (data-parallel model replicas); what kubectl scale changes.",
    )
    parallelism: ParallelismSpec = Field(
        default_factory=ParallelismSpec,
        json_schema_extra=_defaulted(ParallelismSpec),
        description="parallelism of one shard.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        json_schema_extra=_defaulted(ResourcesSpec),
        description="resources of every engine pod.",
    )
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        json_schema_extra=_defaulted(PlacementSpec),
        description="placement of shards on nodes.",
    )
    frontend: FrontendSpec = Field(
        default_factory=FrontendSpec,
        json_schema_extra=_defaulted(FrontendSpec),
        description="frontend is the OpenAI-compatible API.",
    )
    refit: RefitSpec = Field(
        default_factory=RefitSpec, json_schema_extra=_defaulted(RefitSpec), description="refit settings."
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec, json_schema_extra=_defaulted(EngineSpec), description="engine settings."
    )
    pod: PodSpec = Field(
        default_factory=PodSpec,
        json_schema_extra=_defaulted(PodSpec),
        description="pod holds what every engine pod carries beside the engine: volumes and mounts, /dev/shm, "
        "caches, service account, priority and runtime class, pull secrets, labels and annotations.",
    )


# -- status ----------------------------------------------------------------------------------------


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition)."""

    type: str = Field(max_length=316, description="type of the condition, in CamelCase.")
    status: ConditionStatus = Field(description="status is True, False or Unknown.")
    reason: str = Field(default="", max_length=1024, description="reason is a CamelCase word for the last transition.")
    message: str = Field(default="", max_length=32768, description="message is a human-readable explanation.")
    last_transition_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="lastTransitionTime is when status last changed.",
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="observedGeneration is the spec generation this was computed from."
    )


class Endpoint(ApiModel):
    """A reserved frontend address, published before any engine starts."""

    shard: int = Field(ge=0, description="shard is the shard index the frontend belongs to.")
    url: str = Field(
        description="url is the OpenAI base URL through the Service's ClusterIP and the shard's port, ending in /v1."
    )
    dns_url: str = Field(alias="dnsURL", description="dnsURL is the same base URL through the Service's DNS name.")
    service: str = Field(
        description="service is the name of the Service carrying the frontend: the fleet's frontends Service "
        "of the shard's group of 100 (<fleet>-f<group>, a port per shard), or the shard's own (<fleet>-s<shard>) "
        "in a fleet made by an operator before frontends Services."
    )


class ShardStatus(ApiModel):
    """Observed state of one shard."""

    index: int = Field(ge=0, description="index of the shard.")
    phase: ShardPhase = Field(description="phase of the shard.")
    pods: list[str] = Field(default_factory=list, description="pods of the shard, in rank order.")
    nodes: list[str] = Field(
        default_factory=list, description="nodes the pods run on (or are pinned to, before the scheduler binds them)."
    )
    clique: str | None = Field(default=None, description="clique is the NVLink domain the shard is placed in.")
    weight_version: int | None = Field(default=None, description="weightVersion the shard serves.")
    restarts: int = Field(default=0, ge=0, description="restarts is how often the shard was re-placed.")
    last_error: str | None = Field(default=None, description="lastError is the most recent failure, if any.")


class RankOffset(ApiModel):
    """Where a shard's ranks start in the trainer+fleet communicator."""

    shard: int = Field(ge=0, description="shard index.")
    offset: int = Field(ge=0, description="offset is the global rank of the shard's rank 0.")


class Membership(ApiModel):
    """The live shards taking part in refits and their ranks."""

    world_size: int = Field(ge=1, description="worldSize of the trainer+fleet communicator.")
    trainer_world_size: int = Field(ge=1, description="trainerWorldSize is the number of trainer ranks (first).")
    rank_offsets: list[RankOffset] = Field(default_factory=list, description="rankOffsets of the live shards.")


class PhaseTiming(ApiModel):
    """Duration of one refit phase."""

    name: str = Field(description="name of the phase (suspend, join, receive, apply, resume).")
    milliseconds: int = Field(ge=0, description="milliseconds the phase took.")


class FleetRefitStatus(ApiModel):
    """What the fleet knows about refits."""

    active: str | None = Field(default=None, description="active is the Refit in progress, if any.")
    session: str | None = Field(
        default=None,
        description="session is the RefitSession whose trainer world the fleet's shards hold: while it is "
        "set, scaling and template rolls wait and only Refits through that session run.",
    )
    current_version: int | None = Field(
        default=None,
        ge=0,
        description="currentVersion is the version of the last successful Refit; shards serving another "
        "version are Stale and not routed until a refit brings them to it.",
    )
    current_checkpoint: str | None = Field(
        default=None,
        max_length=2048,
        description="currentCheckpoint is the checkpoint source of the last successful Refit, if it had one: "
        "a shard behind currentVersion (restarted, added, left Stale) loads it at once; without it such a "
        "shard waits for the next refit.",
    )
    membership: Membership | None = Field(default=None, description="membership of the last or current refit.")
    last_duration_milliseconds: int | None = Field(
        default=None, ge=0, description="lastDurationMilliseconds of the last refit."
    )
    last_phases: list[PhaseTiming] = Field(default_factory=list, description="lastPhases of the last refit.")


class MegatronGenerationStatus(ApiModel):
    """Observed state of a fleet; written only by the operator."""

    observed_generation: int | None = Field(
        default=None, description="observedGeneration is the last generation reconciled."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions: EndpointsReserved, Placed, Ready, WeightsCurrent, EndpointsVerified, "
        "Degraded, InvalidSpec, NameConflict (an object under a derived name is not the fleet's), "
        "RefitSessionHeld.",
    )
    replicas: int = Field(
        default=0, ge=0, description="replicas is the number of shards that exist (scale subresource)."
    )
    ready_replicas: int = Field(default=0, ge=0, description="readyReplicas is the number of Ready shards.")
    selector: str = Field(default="", description="selector matches the fleet's pods (scale subresource).")
    weight_version: int | None = Field(default=None, description="weightVersion every Ready shard serves.")
    endpoints: list[Endpoint] = Field(
        default_factory=list, description="endpoints, one per frontend, reserved before pods."
    )
    shards: list[ShardStatus] = Field(default_factory=list, description="shards, one entry per shard index.")
    refit: FleetRefitStatus | None = Field(default=None, description="refit state of the fleet.")


# -- Refit ---------------------------------------------------------------------------------------------


class FleetRef(ApiModel):
    """The fleet a Refit targets, in the Refit's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_LABEL, description="name of the MegatronGeneration.")


class RendezvousSource(ApiModel):
    """The trainer's rendezvous for a collective transfer (trainer ranks come first)."""

    address: str = Field(
        min_length=1,
        max_length=253,
        pattern=_HOST,
        description="address (host name or IP) of the trainer's rank 0 store.",
    )
    port: int = Field(ge=1, le=65535, description="port of the trainer's rendezvous store.")
    trainer_world_size: int = Field(
        default=1, ge=1, le=65536, description="trainerWorldSize is the number of trainer ranks."
    )
    layout: ParallelismSpec | None = Field(
        default=None, description="layout is the trainer's parallelism, needed by the reshard transport."
    )


class CheckpointSource(ApiModel):
    """A checkpoint every shard loads by itself."""

    path: str = Field(min_length=1, max_length=2048, description="path (or URI) of the checkpoint.")


class SessionSource(ApiModel):
    """A RefitSession whose held trainer world carries the version (NeMo RL's own collective)."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_LABEL, description="name of the RefitSession.")


class RefitSourceSpec(ApiModel):
    """Exactly one of rendezvous, checkpoint and session."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "[has(self.rendezvous), has(self.checkpoint), has(self.session)].filter(x, x).size() == 1",
                    "set exactly one of rendezvous, checkpoint and session",
                ),
            ]
        }
    )

    rendezvous: RendezvousSource | None = Field(default=None, description="rendezvous for a collective transfer.")
    checkpoint: CheckpointSource | None = Field(default=None, description="checkpoint to load.")
    session: SessionSource | None = Field(
        default=None, description="session: receive over the world a RefitSession holds (one attempt, no retry)."
    )

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> RefitSourceSpec:
        if sum(source is not None for source in (self.rendezvous, self.checkpoint, self.session)) != 1:
            raise ValueError("set exactly one of rendezvous, checkpoint and session")
        return self


class RefitObjectSpec(ApiModel):
    """One weight version for one fleet; created by the trainer, immutable."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [_cel("self == oldSelf", "a Refit's spec is immutable")]}
    )

    fleet_ref: FleetRef = Field(description="fleetRef names the fleet to refit.")
    version: int = Field(ge=0, le=2**53, description="version is the weight version the fleet serves afterwards.")
    source: RefitSourceSpec = Field(description="source of the weights.")


class RefitObjectStatus(ApiModel):
    """Progress and result of a Refit; written only by the operator."""

    phase: RefitPhase = Field(default="Pending", description="phase of the refit.")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions of the refit (Complete, Failed).",
    )
    membership: Membership | None = Field(default=None, description="membership the refit ran with.")
    attempts: int = Field(default=0, ge=0, description="attempts made (a failed attempt is retried once).")
    phases: list[PhaseTiming] = Field(default_factory=list, description="phases and their durations.")
    duration_milliseconds: int | None = Field(
        default=None, ge=0, description="durationMilliseconds from suspend to resumed."
    )
    start_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}, description="startTime of the refit."
    )
    completion_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}, description="completionTime of the refit."
    )
    message: str = Field(default="", description="message explains the phase.")


# -- RefitSession ----------------------------------------------------------------------------------


class _TrainerWorld(ApiModel):
    """The trainer's ``init_collective(ip, port, world_size, train_world_size=...)``, used as given."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.worldSize > self.trainerWorldSize",
                    "worldSize must exceed trainerWorldSize (the fleet fields worldSize - trainerWorldSize ranks)",
                ),
            ]
        }
    )

    address: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.:]*[A-Za-z0-9])?$",
        description="address (host name or IP) of the trainer's rank 0 store: init_collective's ip.",
    )
    port: int = Field(ge=1, le=65535, description="port of the trainer's store, used as given.")
    world_size: int = Field(ge=2, le=65536, description="worldSize: trainer ranks plus the fleet's ranks.")
    trainer_world_size: int = Field(ge=1, le=65536, description="trainerWorldSize: the trainer ranks (first).")

    @pydantic.model_validator(mode="after")
    def _fleet_ranks(self) -> _TrainerWorld:
        if self.world_size <= self.trainer_world_size:
            raise ValueError(
                f"worldSize {self.world_size} must exceed trainerWorldSize {self.trainer_world_size} "
                "(the fleet fields worldSize - trainerWorldSize ranks)"
            )
        return self


class NemoCollectiveSpec(_TrainerWorld):
    """NeMo RL's vLLM-style collective: a store at ``address:port`` and packed bucket broadcasts."""

    bucket_bytes: int = Field(
        ge=1,
        le=1 << 40,
        description="bucketBytes is the trainer's exact packed-bucket target (the wire carries no sizes).",
    )
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="generation of the trainer's communicator; unset: read from its store."
    )


class MegatronNativeSpec(_TrainerWorld):
    """megatron-core's own refit (``prepare_swap_model_weights``/``swap_model_weights``), store at port + 1."""

    copy_backend: CopyBackend = Field(default="nccl", description="copyBackend of megatron-core's copy service.")


class ConfigMapKeyRef(ApiModel):
    """A key of a ConfigMap in the session's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=_DNS_LABEL, description="name of the ConfigMap.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="key in the ConfigMap.")


class RefitInfoRef(ApiModel):
    """The trainer's ``prepare_refit_info``: ``[[name, shape, dtype], ...]`` in its order, gzip'd JSON."""

    config_map_ref: ConfigMapKeyRef = Field(description="configMapRef holds the gzip'd JSON (binaryData).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the gzip'd bytes.")
    tensors: int = Field(ge=1, le=1 << 20, description="tensors is the number of entries.")


class RefitSessionSpec(ApiModel):
    """One trainer world the fleet joins at the trainer's ``init_collective`` and holds for its refits."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.nemoCollective) != has(self.megatronNative)",
                    "set exactly one of nemoCollective and megatronNative",
                ),
                _cel("!has(self.refitInfo) || has(self.nemoCollective)", "refitInfo belongs to nemoCollective"),
                _cel(
                    "self.fleetRef == oldSelf.fleetRef && self.joinTimeoutSeconds == oldSelf.joinTimeoutSeconds"
                    " && has(self.nemoCollective) == has(oldSelf.nemoCollective)"
                    " && (!has(self.nemoCollective) || self.nemoCollective == oldSelf.nemoCollective)"
                    " && has(self.megatronNative) == has(oldSelf.megatronNative)"
                    " && (!has(self.megatronNative) || self.megatronNative == oldSelf.megatronNative)",
                    "a RefitSession's spec is immutable except refitInfo, which is set once",
                ),
                _cel(
                    "!has(oldSelf.refitInfo) || (has(self.refitInfo) && self.refitInfo == oldSelf.refitInfo)",
                    "refitInfo is set once",
                ),
            ]
        }
    )

    fleet_ref: FleetRef = Field(description="fleetRef names the fleet whose shards join.")
    nemo_collective: NemoCollectiveSpec | None = Field(
        default=None, description="nemoCollective: NeMo RL's vLLM-style collective (policy.init_collective)."
    )
    megatron_native: MegatronNativeSpec | None = Field(
        default=None, description="megatronNative: megatron-core's swap_model_weights (engine.backend megatron)."
    )
    refit_info: RefitInfoRef | None = Field(
        default=None, description="refitInfo: the trainer's tensor list; set once, before the first Refit."
    )
    join_timeout_seconds: int = Field(
        default=240, ge=1, le=3600, description="joinTimeoutSeconds bounds the join (NeMo's store waits 300 s)."
    )

    @pydantic.model_validator(mode="after")
    def _one_protocol(self) -> RefitSessionSpec:
        if (self.nemo_collective is None) == (self.megatron_native is None):
            raise ValueError("set exactly one of nemoCollective and megatronNative")
        if self.refit_info is not None and self.nemo_collective is None:
            raise ValueError("refitInfo belongs to nemoCollective")
        return self

    @property
    def world(self) -> _TrainerWorld:
        """The trainer world, whichever protocol names it."""
        world = self.nemo_collective or self.megatron_native
        assert world is not None
        return world


class RefitSessionStatus(ApiModel):
    """The held world; written only by the operator."""

    phase: RefitSessionPhase = Field(default="Pending", description="phase of the session.")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions: Joined, RefitInfoAccepted, Broken.",
    )
    membership: Membership | None = Field(
        default=None, description="membership decided once at the join: shard i's ranks start at T + i x S."
    )
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="generation of the communicator the members found in the store."
    )
    last_version: int | None = Field(default=None, ge=0, description="lastVersion received through the session.")
    message: str = Field(default="", description="message explains the phase.")


# -- kinds -----------------------------------------------------------------------------------------

NAME_NOT_DNS_1035 = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', a letter first, no dots): "
    "it names the fleet's Services"
)
NAME_TOO_LONG = (
    f"metadata.name is too long: every name derived from it (Service <name>-s<shard>-ranks, pod "
    f"<name>-s<shard>-p<pod>, for the last shard and pod) must fit {NAME_MAX} characters"
)
_LAST_SHARD = "(self.spec.replicas > 0 ? self.spec.replicas - 1 : 0)"
_SHARD_GPUS = "self.spec.parallelism.tensor * self.spec.parallelism.pipeline * self.spec.parallelism.context"
_LAST_POD = (
    f"(self.spec.resources.gpusPerNode == 0 || {_SHARD_GPUS} <= self.spec.resources.gpusPerNode ? 0 : "
    f"({_SHARD_GPUS}) / self.spec.resources.gpusPerNode - 1)"
)
_FLEET_NAME_RULES = (
    _cel(f"self.metadata.name.matches('{DNS_1035_LABEL}')", NAME_NOT_DNS_1035),
    _cel(
        f"size(self.metadata.name) + size(string({_LAST_SHARD})) + {len('-s-ranks')} <= {NAME_MAX} && "
        f"size(self.metadata.name) + size(string({_LAST_SHARD})) + size(string({_LAST_POD})) + {len('-s-p')} "
        f"<= {NAME_MAX}",
        NAME_TOO_LONG,
    ),
)
"""Rules on a fleet's name, at the object's root (the only place CEL sees ``metadata.name``)."""


@dataclasses.dataclass(frozen=True)
class KindInfo:
    """How a kind is registered: names, printer columns and subresources (all namespaced)."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    categories: list[str]
    spec: type[ApiModel]
    status: type[ApiModel]
    printer_columns: list[dict[str, Any]]
    scale: bool
    description: str
    validations: tuple[JsonDict, ...] = ()
    """CEL rules on the whole object (its name), beside the spec's own."""


KINDS: tuple[KindInfo, ...] = (
    KindInfo(
        kind="MegatronGeneration",
        plural="megatrongenerations",
        singular="megatrongeneration",
        short_names=["mgen"],
        categories=["megafleet"],
        spec=MegatronGenerationSpec,
        status=MegatronGenerationStatus,
        scale=True,
        validations=_FLEET_NAME_RULES,
        description="MegatronGeneration is an LLM generation fleet for reinforcement learning: shards of "
        "GPU pods placed by NVLink domain, with OpenAI-compatible frontends whose addresses are "
        "reserved before any engine starts, refitted with new weights by Refit objects.",
        printer_columns=[
            {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired shards."},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready shards."},
            {
                "name": "Weights",
                "type": "integer",
                "jsonPath": ".status.weightVersion",
                "description": "Weight version served.",
            },
            {
                "name": "Status",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                "description": "The Ready condition.",
            },
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
    KindInfo(
        kind="Refit",
        plural="refits",
        singular="refit",
        short_names=["mrefit"],
        categories=["megafleet"],
        spec=RefitObjectSpec,
        status=RefitObjectStatus,
        scale=False,
        description="Refit replaces the weights of every live shard of one fleet with one weight version "
        "from the trainer. Created by the trainer, one per version; immutable; pruned to the fleet's "
        "refit.historyLimit.",
        printer_columns=[
            {"name": "Fleet", "type": "string", "jsonPath": ".spec.fleetRef.name"},
            {"name": "Version", "type": "integer", "jsonPath": ".spec.version"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Duration-ms", "type": "integer", "jsonPath": ".status.durationMilliseconds"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
    KindInfo(
        kind="RefitSession",
        plural="refitsessions",
        singular="refitsession",
        short_names=["mrsess"],
        categories=["megafleet"],
        spec=RefitSessionSpec,
        status=RefitSessionStatus,
        scale=False,
        description="RefitSession is a trainer's own weight-transfer world (NeMo RL's init_collective) that a "
        "fleet's shards join once and hold: Refits naming it receive over that world; while it is held "
        "the fleet's shape is frozen. Created and deleted by the trainer.",
        printer_columns=[
            {"name": "Fleet", "type": "string", "jsonPath": ".spec.fleetRef.name"},
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Version", "type": "integer", "jsonPath": ".status.lastVersion"},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    ),
)
