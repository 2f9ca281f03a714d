"""A MegatronGeneration's shard shape and where shards go: ``spec.parallelism``, ``spec.resources``
and ``spec.placement`` (node selector, tolerations, gang-scheduler hints).

Parts of :class:`~megafleet.api.v1alpha1.megatron_generation.MegatronGenerationSpec`; a Refit's
rendezvous (:mod:`.refit`) reuses :class:`ParallelismSpec` for the trainer's layout.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import pydantic
from pydantic import Field

from megafleet.api.v1alpha1 import common

NvlinkPolicy = Literal["Required", "Preferred"]
GangScheduler = Literal["None", "Kueue"]
GangPlacer = Literal["Operator", "Kueue"]

_EXTENDED_RESOURCE = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""An extended resource name: ``<domain>/<name>``, the domain not under kubernetes.io (checked apart)."""


class ParallelismSpec(common.ApiModel):
    """Parallel sizes of one shard (one data-parallel replica of the model)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
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


_Quantity = Annotated[str, Field(max_length=64, pattern=common.QUANTITY)]
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


class ResourcesSpec(common.ApiModel):
    """Hardware of every engine pod."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "!self.gpuResource.contains('kubernetes.io/')",
                    "gpuResource must be an extended resource (<domain>/<name>), not one of Kubernetes' own",
                    field_path=".gpuResource",
                ),
                common.cel(
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
        pattern=common.QUANTITY,
        description="cpu is the CPU request of each engine pod, a non-negative quantity.",
    )
    memory: str = Field(
        default="64Gi",
        max_length=64,
        pattern=common.QUANTITY,
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


class Toleration(common.ApiModel):
    """A pod toleration, as in the core API (and refused where the core API refuses it)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "(has(self.key) && self.key != '') || self.operator == 'Exists'",
                    _EMPTY_KEY,
                    field_path=".operator",
                ),
                common.cel(
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
        pattern=f"^$|{common.LABEL_KEY}",
        description="key is the taint key; empty (with operator Exists) matches every taint.",
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="operator is Exists or Equal.")
    value: str | None = Field(
        default=None, max_length=63, pattern=common.LABEL_VALUE, description="value is the taint value for Equal."
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


GANG_SCHEDULERS_REFUSED = (
    "scheduler must be None or Kueue: KAI and Volcano are not supported (nothing in megafleet would "
    "hand them a shard); docs/kueue.md"
)
_QUEUE_NEEDED = "queue (the LocalQueue in the fleet's namespace) is required with scheduler Kueue"
_KUEUE_PLACES_NEEDS_KUEUE = "placedBy Kueue (Kueue's Topology Aware Scheduling) needs scheduler Kueue"


class GangSpec(common.ApiModel):
    """Whether each shard is one gang admitted whole by a queueing layer (docs/kueue.md)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel("self.scheduler in ['None', 'Kueue']", GANG_SCHEDULERS_REFUSED, field_path=".scheduler"),
                common.cel("self.scheduler != 'Kueue' || has(self.queue)", _QUEUE_NEEDED, field_path=".queue"),
                common.cel(
                    "!has(self.placedBy) || self.placedBy == 'Operator' || self.scheduler == 'Kueue'",
                    _KUEUE_PLACES_NEEDS_KUEUE,
                    field_path=".placedBy",
                ),
            ]
        }
    )

    scheduler: GangScheduler = Field(
        default="None",
        description="scheduler is None (the operator's placement alone) or Kueue: each shard's pods are one "
        "Kueue pod group in the LocalQueue named by queue, admitted whole against its ClusterQueue's quota "
        "(docs/kueue.md).",
    )
    queue: str | None = Field(
        default=None,
        max_length=63,
        pattern=common.LABEL_VALUE,
        description="queue is the Kueue LocalQueue (in the fleet's namespace) the shards wait in; required "
        "with scheduler Kueue.",
    )
    placed_by: GangPlacer = Field(
        default="Operator",
        description="placedBy says who chooses each shard's NVLink clique and nodes: Operator (the operator's "
        "planner; every pod is pinned to its node) or Kueue (Kueue's Topology Aware Scheduling: each shard's pod "
        "group asks for one clique, the placement.cliqueLabel level, and Kueue chooses the clique and the nodes "
        "when it admits the shard; the LocalQueue's flavor must be a TAS flavor). Kueue needs scheduler Kueue "
        "(docs/kueue.md).",
    )

    @pydantic.field_validator("scheduler", mode="before")
    @classmethod
    def _supported(cls, scheduler: object) -> object:
        if scheduler in ("KAI", "Volcano"):
            raise ValueError(GANG_SCHEDULERS_REFUSED)
        return scheduler

    @pydantic.model_validator(mode="after")
    def _queue_named(self) -> GangSpec:
        if self.scheduler == "Kueue" and not self.queue:
            raise ValueError(_QUEUE_NEEDED)
        if self.placed_by == "Kueue" and self.scheduler != "Kueue":
            raise ValueError(_KUEUE_PLACES_NEEDS_KUEUE)
        return self


_LabelValue = Annotated[str, Field(max_length=63, pattern=common.LABEL_VALUE)]


class PlacementSpec(common.ApiModel):
    """Where shards go, and who admits them (``gang``)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    f"!has(self.nodeSelector) || self.nodeSelector.all(key, key.matches(r'{common.LABEL_KEY}'))",
                    "nodeSelector keys must be label keys ([prefix/]name)",
                    field_path=".nodeSelector",
                ),
            ]
        }
    )

    clique_label: str = Field(
        default="nvidia.com/gpu.clique",
        max_length=316,
        pattern=common.LABEL_KEY,
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
        bad = sorted(key for key in selector if not re.fullmatch(common.LABEL_KEY, key) or len(key) > 316)
        if bad:
            raise ValueError(f"nodeSelector keys must be label keys ([prefix/]name), got {bad}")
        return selector

    tolerations: list[Toleration] = Field(
        default_factory=lambda: [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")],
        max_length=32,
        description="tolerations are added to every engine pod; the default tolerates GPU node taints.",
    )
    gang: GangSpec = Field(
        default_factory=GangSpec,
        json_schema_extra=common.defaulted(GangSpec),
        description="gang says whether a queueing layer (Kueue) admits each shard whole.",
    )
