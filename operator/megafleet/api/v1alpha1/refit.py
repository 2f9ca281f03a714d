"""The Refit kind: one weight version for one fleet, received from a rendezvous, loaded from a
checkpoint or sent through a held RefitSession. Created by the trainer and immutable; its status is
written only by the operator's Refit controller.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from megafleet.api.v1alpha1 import common, fleet_placement, refit_report
from megafleet_protocol import vocabulary

RefitPhase = Literal["Pending", "Running", "Succeeded", "Failed"]


class RendezvousSource(common.ApiModel):
    """The trainer's rendezvous for a collective transfer (trainer ranks come first)."""

    address: str = Field(
        min_length=1,
        max_length=253,
        pattern=common.HOST,
        description="address (host name or IP) of the trainer's rank 0 store.",
    )
    port: int = Field(ge=1, le=65535, description="port of the trainer's rendezvous store.")
    trainer_world_size: int = Field(
        default=1, ge=1, le=65536, description="trainerWorldSize is the number of trainer ranks."
    )
    layout: fleet_placement.ParallelismSpec | None = Field(
        default=None, description="layout is the trainer's parallelism, needed by the reshard transport."
    )


class CheckpointSource(common.ApiModel):
    """A checkpoint every shard loads by itself."""

    path: str = Field(min_length=1, max_length=2048, description="path (or URI) of the checkpoint.")


class SessionSource(common.ApiModel):
    """A RefitSession whose held trainer world carries the version (NeMo RL's own collective)."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_LABEL, description="name of the RefitSession.")


class RefitSourceSpec(common.ApiModel):
    """Exactly one of rendezvous, checkpoint and session."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
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


class RefitObjectSpec(common.ApiModel):
    """One weight version for one fleet; created by the trainer, immutable."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [common.cel("self == oldSelf", "a Refit's spec is immutable")]}
    )

    fleet_ref: common.FleetRef = Field(description="fleetRef names the fleet to refit.")
    version: int = Field(ge=0, le=2**53, description="version is the weight version the fleet serves afterwards.")
    source: RefitSourceSpec = Field(description="source of the weights.")
    in_flight: vocabulary.InFlightMode | None = Field(
        default=None,
        description="inFlight overrides the fleet's refit.inFlight for this refit (drain, abort or keep); "
        "unset: the fleet's (keep unless the fleet says otherwise).",
    )
    kv_cache_mode: vocabulary.KvCacheMode | None = Field(
        default=None,
        description="kvCacheMode overrides the fleet's engine.kvCacheMode for the sequences this refit keeps "
        "(persist, recompute, or offload on megatron); unset: the fleet's.",
    )
    staging: vocabulary.StagingMode | None = Field(
        default=None,
        description="staging overrides the fleet's refit.staging for this refit (off, auto or required; "
        "staging needs the copy the engines allocated at start); unset: the fleet's (auto unless the fleet "
        "says otherwise).",
    )
    commit: vocabulary.CommitMode | None = Field(
        default=None,
        description="commit overrides the fleet's refit.commit for this refit (local, trainer or operator); "
        "unset: the fleet's.",
    )


class RefitObjectStatus(common.ApiModel):
    """Progress and result of a Refit; written only by the operator."""

    phase: RefitPhase = Field(default="Pending", description="phase of the refit.")
    conditions: list[common.Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions of the refit: Complete, Failed (its reason says why: VersionNotNewer, "
        "SessionHeld, SessionNotJoined, RefitInfoMissing, InvalidSpec, BucketMismatch, NonFiniteWeights, "
        "StagingUnavailable, DigestDisagreement, CommitExpired, or Failed), KeepUnavailable (keep was asked for, "
        "and the members drained: BackendCannotKeep, KvCacheModeNotKept, EngineDrained), Degraded (a member "
        "failed to switch after the commit: its shard is fenced Stale; SwitchFailed).",
    )
    membership: common.Membership | None = Field(default=None, description="membership the refit ran with.")
    attempts: int = Field(default=0, ge=0, description="attempts made (a failed attempt is retried once).")
    phases: list[common.PhaseTiming] = Field(default_factory=list, description="phases and their durations.")
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
    in_flight: refit_report.InFlightStatus | None = Field(
        default=None, description="inFlight says what the refit did with the sequences in flight."
    )
    staging: refit_report.StagingStatus | None = Field(
        default=None, description="staging says where the members received the weights."
    )
    pause: refit_report.PauseStatus | None = Field(
        default=None, description="pause says how long the refit kept the members from generating."
    )
    verification: refit_report.VerificationStatus | None = Field(
        default=None, description="verification says what checked the weights' bytes before the switch."
    )
    commit: refit_report.CommitStatus | None = Field(
        default=None,
        description="commit says who lets the staged version go live and, once the operator decided, when "
        "(decidedTime, written before any member is told to switch); absent under commit local.",
    )


KIND = common.KindInfo(
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
)
"""How the Refit kind is registered: names and printer columns."""
