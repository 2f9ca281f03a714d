"""A MegatronGeneration's status: reserved endpoints, shards, conditions and the fleet's refit state.

Written only by the operator: the reconcile's status step and the Refit and RefitSession controllers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megafleet.api.v1alpha1 import common, refit_report

ShardPhase = Literal["Pending", "Starting", "Loading", "Ready", "Stale", "Refitting", "Draining", "Failed"]


class Endpoint(common.ApiModel):
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


class ShardStatus(common.ApiModel):
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


class FleetRefitStatus(common.ApiModel):
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
    membership: common.Membership | None = Field(default=None, description="membership of the last or current refit.")
    last_duration_milliseconds: int | None = Field(
        default=None, ge=0, description="lastDurationMilliseconds of the last refit."
    )
    last_phases: list[common.PhaseTiming] = Field(default_factory=list, description="lastPhases of the last refit.")
    last_in_flight: refit_report.LastInFlight | None = Field(
        default=None, description="lastInFlight says how the last refit treated the sequences in flight."
    )
    last_stall_milliseconds: int | None = Field(
        default=None, ge=0, description="lastStallMilliseconds is the longest member's stall in the last refit."
    )


class MegatronGenerationStatus(common.ApiModel):
    """Observed state of a fleet; written only by the operator."""

    observed_generation: int | None = Field(
        default=None, description="observedGeneration is the last generation reconciled."
    )
    conditions: list[common.Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="conditions: EndpointsReserved, Placed, Ready, WeightsCurrent, EndpointsVerified, "
        "Degraded, InvalidSpec, NameConflict (an object under a derived name is not the fleet's), "
        "RefitSessionHeld, Reconciling (True while shards are placed, removed or rolled to the spec) and "
        "Stalled (True with InvalidSpec or NameConflict): kstatus's conventions, read by GitOps health checks.",
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
