"""The RefitSession kind: a trainer's own weight-transfer world (NeMo RL's collective or megatron-core's
native swap) that a fleet's shards join once and hold; Refits naming it receive over that world.
Created and deleted by the trainer; its status is written only by the operator's RefitSession controller.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import Field

from megafleet.api.v1alpha1 import common
from megafleet_protocol import vocabulary

RefitSessionPhase = Literal["Pending", "Joining", "Joined", "Broken", "Closed", "Failed"]
CopyBackend = Literal["gloo", "nccl"]


class _TrainerWorld(common.ApiModel):
    """The trainer's ``init_collective(ip, port, world_size, train_world_size=...)``, used as given."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
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


class ConfigMapKeyRef(common.ApiModel):
    """A key of a ConfigMap in the session's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_LABEL, description="name of the ConfigMap.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="key in the ConfigMap.")


class RefitInfoRef(common.ApiModel):
    """The trainer's ``prepare_refit_info``: ``[[name, shape, dtype], ...]`` in its order, gzip'd JSON."""

    config_map_ref: ConfigMapKeyRef = Field(description="configMapRef holds the gzip'd JSON (binaryData).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the gzip'd bytes.")
    tensors: int = Field(ge=1, le=1 << 20, description="tensors is the number of entries.")


class ReshardStage(common.ApiModel):
    """One training pipeline stage's communicator: the store its first trainer rank hosts."""

    address: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.:]*[A-Za-z0-9])?$",
        description="address of the stage's store (NeMo's pp_ips[stage]).",
    )
    port: int = Field(ge=1, le=65535, description="port of the stage's store (NeMo's pp_ports[stage]).")


class NemoReshardSpec(common.ApiModel):
    """NeMo RL's M-to-N reshard: the bulk from every training pipeline stage, the rest over the collective."""

    stages: list[ReshardStage] = Field(
        min_length=1, max_length=1024, description="stages: every stage's store, in stage order (pp_ips, pp_ports)."
    )
    trainer_ranks_per_stage: int = Field(
        ge=1, le=65536, description="trainerRanksPerStage: each stage's trainer ranks (first in its communicator)."
    )
    sub_world_size: int = Field(
        ge=2, le=65536, description="subWorldSize: each stage communicator's ranks, trainer plus the fleet's."
    )
    refit_info: RefitInfoRef | None = Field(
        default=None,
        description="refitInfo: NeMo's prepare_nccl_reshard_refit_info (its wire-safe form, a gzip'd JSON "
        "object); tensors counts its bulk and misc tensors. Set once, before the first Refit.",
    )


class RefitSessionSpec(common.ApiModel):
    """One trainer world the fleet joins at the trainer's ``init_collective`` and holds for its refits."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "has(self.nemoCollective) != has(self.megatronNative)",
                    "set exactly one of nemoCollective and megatronNative",
                ),
                common.cel("!has(self.refitInfo) || has(self.nemoCollective)", "refitInfo belongs to nemoCollective"),
                common.cel(
                    "self.fleetRef == oldSelf.fleetRef && self.joinTimeoutSeconds == oldSelf.joinTimeoutSeconds"
                    " && has(self.nemoCollective) == has(oldSelf.nemoCollective)"
                    " && (!has(self.nemoCollective) || self.nemoCollective == oldSelf.nemoCollective)"
                    " && has(self.megatronNative) == has(oldSelf.megatronNative)"
                    " && (!has(self.megatronNative) || self.megatronNative == oldSelf.megatronNative)",
                    "a RefitSession's spec is immutable except refitInfo, which is set once",
                ),
                common.cel(
                    "!has(oldSelf.refitInfo) || (has(self.refitInfo) && self.refitInfo == oldSelf.refitInfo)",
                    "refitInfo is set once",
                ),
                # the trainer's refit membership (NeMo's set_refit_membership)
                common.cel(
                    "has(self.shards) == has(oldSelf.shards) && (!has(self.shards) || self.shards == oldSelf.shards)",
                    "shards is immutable",
                ),
                # NeMo's M-to-N reshard: its stages are added once to a joined nemoCollective session
                common.cel("!has(self.nemoReshard) || has(self.nemoCollective)", "nemoReshard needs nemoCollective"),
                common.cel(
                    "!has(self.nemoReshard) || !has(self.refitInfo)",
                    "refitInfo and nemoReshard exclude each other (the reshard's info is nemoReshard.refitInfo)",
                ),
                common.cel(
                    "!has(self.nemoReshard) || !has(self.nemoCollective) || (self.nemoReshard.subWorldSize == "
                    "self.nemoReshard.trainerRanksPerStage + self.nemoCollective.worldSize - "
                    "self.nemoCollective.trainerWorldSize && self.nemoReshard.trainerRanksPerStage * "
                    "size(self.nemoReshard.stages) == self.nemoCollective.trainerWorldSize)",
                    "nemoReshard: subWorldSize must be trainerRanksPerStage plus the fleet's ranks, and "
                    "trainerRanksPerStage x stages the trainer's ranks",
                ),
                common.cel(
                    "!has(oldSelf.nemoReshard) || (has(self.nemoReshard) && self.nemoReshard.stages == "
                    "oldSelf.nemoReshard.stages && self.nemoReshard.trainerRanksPerStage == "
                    "oldSelf.nemoReshard.trainerRanksPerStage && self.nemoReshard.subWorldSize == "
                    "oldSelf.nemoReshard.subWorldSize)",
                    "nemoReshard is set once (its refitInfo may be added once)",
                ),
                common.cel(
                    "!has(oldSelf.nemoReshard) || !has(oldSelf.nemoReshard.refitInfo) || (has(self.nemoReshard) && "
                    "has(self.nemoReshard.refitInfo) && self.nemoReshard.refitInfo == oldSelf.nemoReshard.refitInfo)",
                    "nemoReshard.refitInfo is set once",
                ),
            ]
        }
    )

    fleet_ref: common.FleetRef = Field(description="fleetRef names the fleet whose shards join.")
    nemo_collective: NemoCollectiveSpec | None = Field(
        default=None, description="nemoCollective: NeMo RL's vLLM-style collective (policy.init_collective)."
    )
    megatron_native: MegatronNativeSpec | None = Field(
        default=None, description="megatronNative: megatron-core's swap_model_weights (engine.backend megatron)."
    )
    refit_info: RefitInfoRef | None = Field(
        default=None, description="refitInfo: the trainer's tensor list; set once, before the first Refit."
    )
    nemo_reshard: NemoReshardSpec | None = Field(
        default=None,
        description="nemoReshard: NeMo's M-to-N reshard stages (init_nccl_reshard_comm_group), set once after "
        "the nemoCollective world joined; the members join them beside it (condition ReshardJoined).",
    )
    join_timeout_seconds: int = Field(
        default=240, ge=1, le=3600, description="joinTimeoutSeconds bounds the join (NeMo's store waits 300 s)."
    )
    shards: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description=(
            "shards: the fleet's shards in the trainer's world (NeMo's refit membership, the live ones "
            "after a rebuild), packed in ascending index after the trainer's ranks; default every shard."
        ),
    )

    @pydantic.model_validator(mode="after")
    def _one_protocol(self) -> RefitSessionSpec:
        if (self.nemo_collective is None) == (self.megatron_native is None):
            raise ValueError("set exactly one of nemoCollective and megatronNative")
        if self.refit_info is not None and self.nemo_collective is None:
            raise ValueError("refitInfo belongs to nemoCollective")
        if self.shards is not None and len(set(self.shards)) != len(self.shards):
            raise ValueError(f"shards repeats an index: {self.shards}")
        if self.nemo_reshard is not None:
            problem = _reshard_problem(self.nemo_reshard, self.nemo_collective, self.refit_info)
            if problem is not None:
                raise ValueError(problem)
        return self

    def member_shards(self, replicas: int) -> list[int]:
        """The shards in the trainer's world, ascending: ``shards``, or every one of ``replicas``."""
        return sorted(self.shards) if self.shards is not None else list(range(replicas))

    @property
    def world(self) -> _TrainerWorld:
        """The trainer world, whichever protocol names it."""
        world = self.nemo_collective or self.megatron_native
        assert world is not None
        return world


def _reshard_problem(
    reshard: NemoReshardSpec, collective: NemoCollectiveSpec | None, refit_info: RefitInfoRef | None
) -> str | None:
    """Why ``nemoReshard`` cannot stand beside the rest of the spec (the CEL rules' words), or None."""
    if collective is None:
        return "nemoReshard needs nemoCollective"
    if refit_info is not None:
        return "refitInfo and nemoReshard exclude each other (the reshard's info is nemoReshard.refitInfo)"
    fleet_ranks = collective.world_size - collective.trainer_world_size
    if reshard.sub_world_size != reshard.trainer_ranks_per_stage + fleet_ranks:
        return (
            f"nemoReshard: subWorldSize {reshard.sub_world_size} must be trainerRanksPerStage "
            f"{reshard.trainer_ranks_per_stage} plus the fleet's {fleet_ranks} ranks"
        )
    if reshard.trainer_ranks_per_stage * len(reshard.stages) != collective.trainer_world_size:
        return (
            f"nemoReshard: {len(reshard.stages)} stages x trainerRanksPerStage {reshard.trainer_ranks_per_stage} "
            f"must be the trainer's {collective.trainer_world_size} ranks"
        )
    return None


class RefitSessionStatus(common.ApiModel):
    """The held world; written only by the operator."""

    phase: RefitSessionPhase = Field(default="Pending", description="phase of the session.")
    conditions: list[common.Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions: Joined, RefitInfoAccepted, Broken, ReshardJoined.",
    )
    membership: common.Membership | None = Field(
        default=None, description="membership decided once at the join: shard i's ranks start at T + i x S."
    )
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="generation of the communicator the members found in the store."
    )
    last_version: int | None = Field(default=None, ge=0, description="lastVersion received through the session.")
    message: str = Field(default="", description="message explains the phase.")


KIND = common.KindInfo(
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
)
"""How the RefitSession kind is registered: names and printer columns."""
