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
from typing import Any, Literal

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

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

_QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


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
        description="source is the checkpoint location (a path inside the engine pod, or a URI the "
        "backend can read) holding the model config, tokenizer and, unless weights.initial is refit, "
        "the weights.",
    )
    tokenizer: str | None = Field(
        default=None,
        max_length=2048,
        description="tokenizer is the tokenizer location when it is not in source.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
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


class ResourcesSpec(ApiModel):
    """Hardware of every engine pod."""

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
        pattern=_LABEL_KEY,
        description="gpuResource is the extended resource name GPUs are requested by.",
    )
    cpu: str = Field(default="8", pattern=_QUANTITY, description="cpu is the CPU request of each engine pod.")
    memory: str = Field(
        default="64Gi", pattern=_QUANTITY, description="memory is the memory request of each engine pod."
    )


class Toleration(ApiModel):
    """A pod toleration, as in the core API."""

    key: str | None = Field(default=None, max_length=316, description="key is the taint key; empty matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="operator is Exists or Equal.")
    value: str | None = Field(default=None, max_length=63, description="value is the taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="effect is the taint effect to match; empty matches all."
    )


class GangSpec(ApiModel):
    """Hints for a gang scheduler; megafleet places shards whole either way."""

    scheduler: GangScheduler = Field(
        default="None", description="scheduler is None, Kueue, KAI or Volcano; megafleet adds its annotations."
    )
    queue: str | None = Field(default=None, max_length=253, description="queue is the scheduler's queue name.")


class PlacementSpec(ApiModel):
    """Where shards go."""

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
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector restricts the nodes shards may use."
    )
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
    key: str = Field(default="api-key", min_length=1, max_length=253, description="key is the key in the Secret.")


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


class EnvVar(ApiModel):
    """An environment variable for the engine container."""

    name: str = Field(
        min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="name of the variable."
    )
    value: str = Field(default="", max_length=32768, description="value of the variable.")


class EngineSpec(ApiModel):
    """The inference engine inside each pod."""

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
        default="megafleet/engine:0.1.0", min_length=1, max_length=1024, description="image is the engine image."
    )
    image_pull_policy: PullPolicy = Field(default="IfNotPresent", description="imagePullPolicy of the engine image.")
    args: list[str] = Field(default_factory=list, max_length=64, description="args are extra engine arguments.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="env is extra engine environment.")


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
    url: str = Field(description="url is the OpenAI base URL through the Service's ClusterIP, ending in /v1.")
    dns_url: str = Field(alias="dnsURL", description="dnsURL is the same base URL through the Service's DNS name.")
    service: str = Field(description="service is the name of the frontend's Service.")


class ShardStatus(ApiModel):
    """Observed state of one shard."""

    index: int = Field(ge=0, description="index of the shard.")
    phase: ShardPhase = Field(description="phase of the shard.")
    pods: list[str] = Field(default_factory=list, description="pods of the shard, in rank order.")
    nodes: list[str] = Field(default_factory=list, description="nodes the pods run on.")
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
        "Degraded, InvalidSpec, RefitSessionHeld.",
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
        min_length=1, max_length=253, description="address (host or IP) of the trainer's rank 0 store."
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
