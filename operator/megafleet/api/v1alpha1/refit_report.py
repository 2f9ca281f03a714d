"""What a Refit's status reports of its members beside the phase: the sequences in flight, where the
weights were received, the pause, and what verified the bytes; and the fleet's record of its last refit.

Parts of :class:`~megafleet.api.v1alpha1.refit.RefitObjectStatus` and of the fleet's
:class:`~megafleet.api.v1alpha1.fleet_status.FleetRefitStatus`; written only by the operator's Refit
controller, which sums the members' agent reports into them (:mod:`megafleet.refits.member_reports`).
Every duration is whole milliseconds (the API has no floats).
"""

from __future__ import annotations

from pydantic import Field

from megafleet.api.v1alpha1 import common
from megafleet_protocol import vocabulary


class InFlightStatus(common.ApiModel):
    """What a refit did with the sequences in flight; the counts are summed over the member shards."""

    requested: vocabulary.InFlightMode = Field(
        description="requested is the mode asked for: the Refit's inFlight, else the fleet's refit.inFlight."
    )
    effective: vocabulary.InFlightMode = Field(
        description="effective is the mode the members ran (drain where an engine could not keep)."
    )
    kv_cache_mode: vocabulary.KvCacheMode = Field(
        description="kvCacheMode is what happened to the KV cache of the kept sequences."
    )
    reason: str | None = Field(default=None, description="reason says why effective differs from requested.")
    kept: int = Field(default=0, ge=0, description="kept is the number of sequences that went on across the switch.")
    drained: int = Field(default=0, ge=0, description="drained is the number of sequences the refit waited for.")
    aborted: int = Field(default=0, ge=0, description="aborted is the number of sequences the refit ended.")
    aborted_tokens: int = Field(
        default=0, ge=0, description="abortedTokens is the number of tokens the aborted sequences had produced."
    )
    recomputed_tokens: int = Field(
        default=0, ge=0, description="recomputedTokens is the number of tokens whose KV was recomputed."
    )


class StagingStatus(common.ApiModel):
    """Where the members received the weights."""

    requested: vocabulary.StagingMode = Field(
        description="requested is the staging asked for: the Refit's staging, else the fleet's refit.staging."
    )
    effective: vocabulary.StagingEffective = Field(
        description="effective is staged (every member received into its staging copy while serving) or "
        "inPlace (at least one wrote the live weights)."
    )
    reason: str | None = Field(default=None, description="reason says why a member did not stage when asked to.")
    bytes: int = Field(default=0, ge=0, description="bytes is the largest staging copy of any member rank.")


class ShardPause(common.ApiModel):
    """How long one member shard did not generate."""

    shard: int = Field(ge=0, description="shard index.")
    stall_milliseconds: int = Field(
        ge=0, description="stallMilliseconds from its last step before the refit to its first after (its longest rank)."
    )


class PauseStatus(common.ApiModel):
    """How long the refit kept the member shards from generating."""

    stall_p50_milliseconds: int = Field(
        ge=0, description="stallP50Milliseconds is the median of the shards' stalls (nearest rank)."
    )
    stall_max_milliseconds: int = Field(ge=0, description="stallMaxMilliseconds is the longest shard's stall.")
    gate_closed_max_milliseconds: int = Field(
        ge=0, description="gateClosedMaxMilliseconds is the longest new requests waited at any member's gate."
    )
    recompute_max_milliseconds: int = Field(
        ge=0, description="recomputeMaxMilliseconds is the longest any member spent recomputing kept KV."
    )
    shards: list[ShardPause] = Field(default_factory=list, description="shards, each member's stall in shard order.")


class MismatchStatus(common.ApiModel):
    """The bucket whose bytes did not verify, and where."""

    shard: int = Field(ge=0, description="shard that received it.")
    pod: str = Field(description="pod that received it.")
    bucket: int = Field(ge=0, description="bucket index in the transfer.")
    first_tensor: str = Field(default="", description="firstTensor is the first tensor packed in the bucket.")


class VerificationStatus(common.ApiModel):
    """What checked the refit's bytes before the switch."""

    integrity: vocabulary.Integrity = Field(description="integrity the refit ran with (the fleet's refit.integrity).")
    method: vocabulary.VerificationMethod = Field(
        description="method is trainerDigest (the sender's per-bucket digest), agreement (the members' "
        "digests compared with each other) or none."
    )
    buckets: int = Field(default=0, ge=0, description="buckets is the most buckets any member verified.")
    mismatch: MismatchStatus | None = Field(default=None, description="mismatch is the bucket that failed, if any.")


class CommitStatus(common.ApiModel):
    """Who lets a staged refit's version go live, and when the operator decided it did."""

    requested: vocabulary.CommitMode = Field(
        description="requested is the commit asked for: the Refit's commit, else the fleet's refit.commit."
    )
    mode: vocabulary.CommitMode = Field(
        description="mode is the commit the members were told: local when they receive in place, operator "
        "for a trainer commit on a source without the megafleet wire's trainer."
    )
    reason: str | None = Field(default=None, description="reason says why mode differs from requested.")
    decided_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="decidedTime is when the operator decided to commit (write-ahead: set before any member "
        "is told to switch; after an operator restart the members still staged are told again).",
    )


class LastInFlight(common.ApiModel):
    """How the fleet's last successful refit treated its sequences in flight."""

    mode: vocabulary.InFlightMode = Field(description="mode is the in-flight mode the members ran.")
    kv_cache_mode: vocabulary.KvCacheMode = Field(description="kvCacheMode of the kept sequences.")
    staging: vocabulary.StagingEffective = Field(description="staging is staged or inPlace.")
