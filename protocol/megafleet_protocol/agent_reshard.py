"""The pod agent's routes of NeMo RL's M-to-N reshard: the bulk from every training pipeline stage,
the rest over NeMo's world. Gathered into :mod:`megafleet_protocol.agent_api` with the other bodies."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from megafleet_protocol import vocabulary
from megafleet_protocol.agent_bodies import Body, RefitBody, Response

REFIT_NEMO_RESHARD = "/v1/refit/nemo/reshard"
REFIT_NEMO_RESHARD_JOIN = "/v1/refit/nemo/reshard/join"


class NemoReshardStage(Body):
    """One training pipeline stage's communicator: the store its first trainer rank hosts."""

    address: str = Field(min_length=1, max_length=253, description="the stage's store address (pp_ips[s]).")
    port: int = Field(ge=1, le=65535, description="the stage's store port (pp_ports[s]).")


class NemoReshardJoinRequest(Body):
    """``POST /v1/refit/nemo/reshard/join`` (202): join every training pipeline stage's communicator
    (NeMo's ``init_nccl_reshard_comm_group``) for ``session``, whose NeMo world this pod joined first
    (409 ``nemo_not_joined`` otherwise), in stage order, on a thread, without suspending the engine."""

    session: str = Field(min_length=1, max_length=253, description="the RefitSession whose NeMo world this pod holds.")
    stages: list[NemoReshardStage] = Field(
        min_length=1, max_length=1024, description="every stage's store, in stage order (pp_ips, pp_ports)."
    )
    trainer_ranks_per_stage: int = Field(ge=1, le=1 << 16, description="the trainer ranks of each stage (first).")
    sub_world_size: int = Field(ge=2, le=1 << 20, description="each stage communicator's ranks: trainer + inference.")
    rank_offset: int = Field(
        ge=1,
        le=1 << 20,
        description="this shard's first rank in every stage communicator: trainerRanksPerStage plus the "
        "shard's prefix among the inference ranks.",
    )
    timeout_seconds: int = Field(default=240, ge=1, le=86400, description="how long joining every stage may take.")

    @pydantic.model_validator(mode="after")
    def _inference_rank(self) -> NemoReshardJoinRequest:
        if not self.trainer_ranks_per_stage <= self.rank_offset < self.sub_world_size:
            raise ValueError(
                f"rankOffset {self.rank_offset} is not an inference rank of a stage communicator: those are "
                f"{self.trainer_ranks_per_stage} .. {self.sub_world_size - 1}"
            )
        return self


class NemoReshardRefitRequest(RefitBody):
    """``POST /v1/refit/nemo/reshard`` (202): one refit of NeMo's M-to-N reshard over the communicators
    joined for ``session``: each rank receives its slices of the bulk tensors from the stages' trainer
    ranks, then the other tensors over NeMo's world (its packed broadcast); never joins (409
    ``nemo_not_joined``). A refit info that does not fit this engine is refused (400) before anything
    is suspended."""

    session: str = Field(min_length=1, max_length=253, description="the joined session it must be.")
    refit_info: dict[str, Any] = Field(
        description="NeMo's wire-safe reshard refit info (prepare_nccl_reshard_refit_info): layer_names, "
        "per_layer_params, misc_meta, train_world_size, gen_world_size, pp_size."
    )
    bucket_bytes: int = Field(ge=1, le=1 << 40, description="the trainer's packed-bucket target of the misc tensors.")
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="the trainer's communicator (NeMo >= 0.6, or vLLM's); unset: from its store."
    )


class NemoReshardStatus(Response):
    """This rank's (or, combined, the pod's) membership of the stage communicators of a NeMo world."""

    phase: Literal["joining", "joined", "failed", "left"]
    stages: int = Field(default=0, ge=0, description="the stage communicators joined (or being joined).")
    rank: int | None = Field(default=None, description="this rank in every stage communicator.")
    error: str | None = None
