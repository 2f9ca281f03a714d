"""An attempt's reports as the agent's refit status carries them (:mod:`megafleet_protocol.agent_api`).

Called by the agent's refit routes (:mod:`megafleet_engine.agent_server`) when they answer with an
attempt's status: each function turns one report of the attempt's record
(:mod:`~megafleet_engine.refit_attempts.phases`) into its wire model; durations go from seconds to
milliseconds. Pure; imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megafleet_engine.refit_attempts import memberships, phases
from megafleet_protocol import agent_api, vocabulary
from megafleet_protocol.refit import verification as verification_module

__all__ = [
    "Held",
    "commit",
    "in_flight",
    "pause",
    "shown_world",
    "staging",
    "status",
    "verification",
    "world",
    "world_body",
]


def verification(outcome: verification_module.Verification | None) -> agent_api.VerificationReport | None:
    if outcome is None:
        return None
    mismatch = outcome.mismatch
    return agent_api.VerificationReport(
        integrity=outcome.integrity,
        method=outcome.method,
        buckets=outcome.buckets,
        mismatch=None
        if mismatch is None
        else agent_api.BucketMismatch(bucket=mismatch.bucket, first_tensor=mismatch.first_tensor),
        bucket_digests=list(outcome.bucket_digests),
        non_finite=outcome.non_finite,
    )


def in_flight(report: phases.InFlight | None) -> agent_api.InFlightReport | None:
    if report is None:
        return None
    return agent_api.InFlightReport(
        requested=report.requested,
        effective=report.effective,
        kv_cache_mode=report.kv_cache_mode,
        reason=report.reason,
        kept=report.kept,
        drained=report.drained,
        aborted=report.aborted,
        aborted_tokens=report.aborted_tokens,
        recomputed_tokens=report.recomputed_tokens,
    )


def staging(report: phases.Staging | None) -> agent_api.StagingReport | None:
    if report is None:
        return None
    return agent_api.StagingReport(
        requested=report.requested, effective=report.effective, reason=report.reason, bytes=report.bytes
    )


def pause(report: phases.Pause | None) -> agent_api.PauseReport | None:
    if report is None:
        return None
    return agent_api.PauseReport(
        stall_milliseconds=report.stall_seconds * 1000,
        gate_closed_milliseconds=report.gate_closed_seconds * 1000,
        switch_milliseconds=report.switch_seconds * 1000,
        recompute_milliseconds=report.recompute_seconds * 1000,
    )


def commit(report: phases.Commit | None) -> agent_api.CommitReport | None:
    if report is None:
        return None
    return agent_api.CommitReport(
        requested=report.requested,
        effective=report.effective,
        reason=report.reason,
        committed=report.committed,
        expired=report.expired,
    )


@dataclasses.dataclass(frozen=True)
class Held:
    """What the refit status says of the engine beside its attempt: the dirty flag, the engine's
    state and version, and the world it has joined (NeMo's or megatron-core's), if any."""

    dirty: bool
    state: vocabulary.EngineState
    weight_version: int | None
    world: agent_api.NemoWorldStatus | None


def status(snapshot: phases.Snapshot, held: Held) -> dict[str, Any]:
    """The agent's ``GET /v1/refit/status`` body for the attempt ``snapshot`` shows."""
    body = agent_api.RefitStatusResponse(
        phase=snapshot.phase,
        version=snapshot.version,
        source=snapshot.source,
        transport=snapshot.transport,
        rank=snapshot.rank,
        world_size=snapshot.world_size,
        phases=[
            agent_api.PhaseTiming(name=name, milliseconds=round(seconds * 1000)) for name, seconds in snapshot.phases
        ],
        duration_milliseconds=None if snapshot.duration_seconds is None else round(snapshot.duration_seconds * 1000),
        bytes_received=snapshot.bytes_received,
        buckets=snapshot.buckets,
        tensors_written=snapshot.tensors_written,
        error=snapshot.error,
        timed_out=snapshot.timed_out,
        reused=snapshot.reused,
        dirty=held.dirty,
        state=held.state,
        weight_version=held.weight_version,
        world=held.world,
        verification=verification(snapshot.verification),
        in_flight=in_flight(snapshot.in_flight),
        staging=staging(snapshot.staging),
        pause=pause(snapshot.pause),
        commit=commit(snapshot.commit),
    )
    return body.model_dump(mode="json", by_alias=True)


def world(joined: memberships.WorldSnapshot | None, protocol: str = "nemo") -> agent_api.NemoWorldStatus | None:
    """A joined world (NeMo's or, with ``protocol`` ``megatron``, megatron-core's) as its status."""
    if joined is None:
        return None
    return agent_api.NemoWorldStatus.model_validate(
        {
            "session": joined.session,
            "phase": joined.phase,
            "protocol": protocol,
            "rank": joined.rank,
            "generation": joined.generation,
            "error": joined.error,
            "storeReachable": joined.store_reachable,
            "reshard": None if joined.reshard is None else dataclasses.asdict(joined.reshard),
        }
    )


def shown_world(
    megatron: memberships.WorldSnapshot | None, nemo: memberships.WorldSnapshot | None
) -> tuple[memberships.WorldSnapshot | None, str]:
    """The membership the refit status shows, with its protocol: a megatron-native one while it is
    joining or joined (or when there is no NeMo one), else NeMo's."""
    if megatron is not None and (nemo is None or megatron.phase in ("joining", "joined")):
        return megatron, "megatron"
    return nemo, "nemo"


def world_body(joined: memberships.WorldSnapshot, protocol: str = "nemo") -> dict[str, Any]:
    model = world(joined, protocol)
    assert model is not None
    return model.model_dump(mode="json", by_alias=True)
