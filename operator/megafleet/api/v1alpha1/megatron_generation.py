"""The MegatronGeneration kind: a generation fleet's spec, the rules on its name, and its registration.

The spec's own fields (model, weights, replicas, refit settings) are here; its larger parts are in
:mod:`.fleet_placement`, :mod:`.fleet_engine` and :mod:`.fleet_pod`, its status in :mod:`.fleet_status`.
:mod:`megafleet.api.checks` re-checks the rules declared here, with the planner's, for ``InvalidSpec``.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from megafleet.api.v1alpha1 import common, fleet_engine, fleet_placement, fleet_pod, fleet_status
from megafleet_protocol import vocabulary

DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name: a DNS-1035 label (a letter first, no dots), at most 63 characters."""

NAME_MAX = 63
"""Derived names (Services, pod host names) and the fleet label value are at most 63 characters."""


DEFAULT_IN_FLIGHT: vocabulary.InFlightMode = "keep"
"""A fleet's ``refit.inFlight`` when its spec leaves it out: sequences in flight go on across a refit."""

DEFAULT_STAGING: vocabulary.StagingMode = "auto"
"""A fleet's ``refit.staging`` when its spec leaves it out: stage when the memory allows, else in place."""


class ModelSpec(common.ApiModel):
    """What model the engines serve."""

    source: str = Field(
        min_length=1,
        max_length=2048,
        pattern=common.PRINTABLE,
        description="source is the checkpoint location (a path inside the engine pod, or a URI the "
        "backend can read) holding the model config, tokenizer and, unless weights.initial is refit, "
        "the weights.",
    )
    tokenizer: str | None = Field(
        default=None,
        max_length=2048,
        pattern=common.PRINTABLE,
        description="tokenizer is the tokenizer location when it is not in source.",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        pattern=common.PRINTABLE,
        description="servedName is the model name clients send in the OpenAI API; defaults to the fleet's name.",
    )
    dtype: vocabulary.Dtype = Field(default="bfloat16", description="dtype is the parameter data type of the engines.")
    max_sequence_length: int = Field(
        default=4096,
        ge=16,
        le=1048576,
        description="maxSequenceLength is the longest prompt plus completion, in tokens.",
    )


class WeightsSpec(common.ApiModel):
    """Where the first weights come from."""

    initial: vocabulary.WeightsInitial = Field(
        default="checkpoint",
        description="initial is checkpoint (load weights from model.source at start) or refit (start "
        "without weights and become Ready only when the first Refit has delivered them; NeMo RL's "
        "skip_weight_load).",
    )
    catch_up: Literal["peer", "checkpoint"] = Field(
        default="peer",
        description="catchUp is how a shard behind the fleet's current version (added by a scale-out, "
        "healed) gets it between refits: peer (copy it from a shard Ready at that version while that "
        "shard serves, the current checkpoint when the copy fails or the backend is megatron) or "
        "checkpoint (the current checkpoint only; without one the shard stays Stale until the next refit).",
    )


class RefitSpec(common.ApiModel):
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
    in_flight: vocabulary.InFlightMode = Field(
        default=DEFAULT_IN_FLIGHT,
        description="inFlight is what a refit does with the sequences in flight: keep (the default: the engine "
        "pauses between two decode steps, the new weights go in and every sequence goes on, its KV cache as "
        "engine.kvCacheMode or the Refit's kvCacheMode says), drain (they finish on the old weights first) "
        "or abort (they end). An engine that cannot keep in that KV mode (offload: neither backend keeps "
        "under it as the operator starts them; an engine image too old to keep) drains, and every Refit "
        "says so (condition KeepUnavailable); set inFlight to drain to drain without that condition. A "
        "Refit's own inFlight overrides it.",
    )
    staging: vocabulary.StagingMode = Field(
        default=DEFAULT_STAGING,
        description="staging is whether a refit receives into a staging copy of the weights while the "
        "engines serve, so that the pause covers only the switch: auto (the default: stage when the memory "
        "allows, else in place, and the Refit's status.staging says which ran and why), off (write in "
        "place) or required (a Refit fails StagingUnavailable without room). The engines allocate the copy "
        "at start (MEGAFLEET_REFIT_STAGING), so changing it rolls the fleet. A Refit's own staging "
        "overrides it within what the engines allocated.",
    )
    staging_headroom_mi_b: int = Field(
        default=1024,
        ge=0,
        le=65536,
        alias="stagingHeadroomMiB",
        description="stagingHeadroomMiB is the device memory, in MiB, that staging must leave free beside "
        "the staging copy and two receive buffers (staging auto stages only if it fits).",
    )
    integrity: vocabulary.Integrity = Field(
        default="none",
        description="integrity is none (the default) or checksum (every bucket carries a digest that the "
        "receivers verify before the switch; on NeMo RL's wire, which carries none, the members compare "
        "their digests; after a checkpoint load or megatron-core's swap, each rank digests its parameters "
        "and the shards compare them). checksum is not the default: its cost on the GPU is not measured yet "
        "(on the CPU it added 119 % to the transfer).",
    )
    commit: vocabulary.CommitMode = Field(
        default="local",
        description="commit is who lets a staged refit's new version go live: local (the default: each shard as "
        "soon as its own receive completed), trainer (the trainer's SDK on the megafleet wire, once every receiver "
        "staged; the operator decides for other sources) or operator (the operator, once every member "
        "staged; it records status.commit.decidedTime first). Under trainer and operator no shard switches "
        "before every member has staged and verified; a refit received in place cannot wait and commits "
        "local. A Refit's own commit overrides it.",
    )
    commit_grace_seconds: int = Field(
        default=30,
        ge=5,
        le=600,
        description="commitGraceSeconds is how long past timeoutSeconds a staged member waits for its commit "
        "before it discards the staged copy and fails the refit (the old version serves on).",
    )


class MegatronGenerationSpec(common.ApiModel):
    """Desired state of a generation fleet; owned by Git."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "self.resources.gpusPerNode == 0 || "
                    "(self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context) "
                    "% self.resources.gpusPerNode == 0 || self.resources.gpusPerNode % "
                    "(self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context) == 0",
                    "tensor * pipeline * context (GPUs per shard) must divide resources.gpusPerNode or be a "
                    "multiple of it, so shards fill whole nodes",
                    field_path=".parallelism.tensor",
                ),
                common.cel(
                    "self.engine.backend != 'transformers' || (self.parallelism.tensor == 1 && "
                    "self.parallelism.pipeline == 1 && self.parallelism.context == 1 && "
                    "self.parallelism.expert == 1 && self.parallelism.expertTensor == 1)",
                    "the transformers backend runs one rank per shard: set every parallelism size to 1, "
                    "or use the megatron backend",
                    field_path=".parallelism",
                ),
                common.cel(
                    "self.resources.gpusPerNode > 0 || self.engine.backend == 'transformers'",
                    "a CPU fleet (resources.gpusPerNode 0) needs engine.backend transformers",
                    field_path=".engine.backend",
                ),
                common.cel(
                    "self.engine.backend != 'megatron' || self.parallelism.context == 1",
                    "megatron-core's inference engine has no context parallelism: set parallelism.context to 1",
                    field_path=".parallelism.context",
                ),
                common.cel(
                    "self.resources.gpusPerNode > 0 || !has(self.engine.cudaGraphs) || !self.engine.cudaGraphs",
                    "CUDA graphs need GPUs: unset engine.cudaGraphs on a CPU fleet",
                    field_path=".engine.cudaGraphs",
                ),
                common.cel(
                    "!has(self.pod.shmSize) || "
                    "quantity(self.pod.shmSize).compareTo(quantity(self.resources.memory)) <= 0",
                    fleet_pod.SHM_OVER_MEMORY,
                    field_path=".pod.shmSize",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="model is what the engines serve.")
    weights: WeightsSpec = Field(
        default_factory=WeightsSpec,
        json_schema_extra=common.defaulted(WeightsSpec),
        description="weights says where the first weights come from.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=10000,
        description="replicas is the number of shards (data-parallel model replicas); what kubectl scale changes.",
    )
    parallelism: fleet_placement.ParallelismSpec = Field(
        default_factory=fleet_placement.ParallelismSpec,
        json_schema_extra=common.defaulted(fleet_placement.ParallelismSpec),
        description="parallelism of one shard.",
    )
    resources: fleet_placement.ResourcesSpec = Field(
        default_factory=fleet_placement.ResourcesSpec,
        json_schema_extra=common.defaulted(fleet_placement.ResourcesSpec),
        description="resources of every engine pod.",
    )
    placement: fleet_placement.PlacementSpec = Field(
        default_factory=fleet_placement.PlacementSpec,
        json_schema_extra=common.defaulted(fleet_placement.PlacementSpec),
        description="placement of shards on nodes.",
    )
    frontend: fleet_engine.FrontendSpec = Field(
        default_factory=fleet_engine.FrontendSpec,
        json_schema_extra=common.defaulted(fleet_engine.FrontendSpec),
        description="frontend is the OpenAI-compatible API.",
    )
    refit: RefitSpec = Field(
        default_factory=RefitSpec, json_schema_extra=common.defaulted(RefitSpec), description="refit settings."
    )
    engine: fleet_engine.EngineSpec = Field(
        default_factory=fleet_engine.EngineSpec,
        json_schema_extra=common.defaulted(fleet_engine.EngineSpec),
        description="engine settings.",
    )
    pod: fleet_pod.PodSpec = Field(
        default_factory=fleet_pod.PodSpec,
        json_schema_extra=common.defaulted(fleet_pod.PodSpec),
        description="pod holds what every engine pod carries beside the engine: volumes and mounts, /dev/shm, "
        "caches, service account, priority and runtime class, pull secrets, labels and annotations.",
    )


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
    common.cel(f"self.metadata.name.matches('{DNS_1035_LABEL}')", NAME_NOT_DNS_1035),
    common.cel(
        f"size(self.metadata.name) + size(string({_LAST_SHARD})) + {len('-s-ranks')} <= {NAME_MAX} && "
        f"size(self.metadata.name) + size(string({_LAST_SHARD})) + size(string({_LAST_POD})) + {len('-s-p')} "
        f"<= {NAME_MAX}",
        NAME_TOO_LONG,
    ),
)
"""Rules on a fleet's name, at the object's root (the only place CEL sees ``metadata.name``)."""


KIND = common.KindInfo(
    kind="MegatronGeneration",
    plural="megatrongenerations",
    singular="megatrongeneration",
    short_names=["mgen"],
    categories=["megafleet"],
    spec=MegatronGenerationSpec,
    status=fleet_status.MegatronGenerationStatus,
    scale=True,
    validations=_FLEET_NAME_RULES,
    status_default={"observedGeneration": 0},
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
)
"""How the MegatronGeneration kind is registered: names, printer columns, the scale subresource."""
