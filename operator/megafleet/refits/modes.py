"""The modes one Refit runs with: what happens to the sequences in flight, their KV cache, staging and
integrity, resolved against what the member engines can do before anything is sent to them.

Called by the Refit controller's start steps (:func:`.attempts.start`, :func:`.session_refits.start`)
once the members' agents answered ``GET /v1/state``: :func:`resolve` is pure (table tests), its
:class:`Modes` become every member's request fields (:func:`request_fields`) and the first record of
the Refit's status (:func:`started_status`). Nothing is downgraded silently: a member that cannot keep
in the KV mode asked for makes every member drain, and the Refit says so with the condition
``KeepUnavailable``; ``staging: required`` that a member cannot honour fails the Refit
``StagingUnavailable`` before any agent is asked to receive; ``staging: auto`` without a staging copy
is sent as ``off`` and the status says why. The commit (:func:`commit_mode`) is the Refit's or the
fleet's: ``trainer`` or ``operator`` only when the members stage (in place they cannot wait, so the
commit is ``local``, as it always was), and ``trainer`` only where our trainer sends (a rendezvous
source); elsewhere the operator decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megafleet import conditions
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet_protocol import agent_api, vocabulary

# The reasons of a Refit's condition KeepUnavailable (:data:`.refit_status.KEEP_UNAVAILABLE`).
BACKEND_CANNOT_KEEP = "BackendCannotKeep"
"""KeepUnavailable's reason: a member's engine cannot pause between two steps at all."""
KV_CACHE_MODE_NOT_KEPT = "KvCacheModeNotKept"
"""KeepUnavailable's reason: a member's engine keeps sequences, but not in the KV mode asked for."""
ENGINE_DRAINED = "EngineDrained"
"""KeepUnavailable's reason: a member's engine drained on its own and its report says why."""
DRAIN_WITHOUT_CONDITION = "the fleet's refit.inFlight is keep; set it to drain to drain without this condition"
"""Added to KeepUnavailable's message when keep came from the fleet (often its default), not the Refit."""
NATIVE_SWAP_WRITES_LIVE = "megatron-core's swap writes the live model (no staging copy)"
"""Why a Refit through a megatron-native session never stages."""
IN_PLACE_COMMITS_LOCAL = (
    "the members receive in place and cannot wait for a commit: each switches when its receive completes"
)
"""Why a Refit that asked for a trainer's or operator's commit commits local."""
NO_TRAINER_COMMIT = "only a trainer on the megafleet wire (a rendezvous source) commits; the operator does"
"""Why a Refit that asked for the trainer's commit on another source gets the operator's."""


@dataclasses.dataclass(frozen=True)
class MemberCapabilities:
    """What one member pod's agent says its engine can do across a refit (``GET /v1/state``)."""

    shard: int
    pod: str
    capabilities: agent_api.Capabilities


@dataclasses.dataclass(frozen=True)
class Modes:
    """The modes a Refit runs with, as asked (the Refit's override, else the fleet's) and as sent."""

    requested: vocabulary.InFlightMode
    in_flight: vocabulary.InFlightMode
    """What every member is asked to do (``suspendMode``): ``requested``, or drain when a member cannot keep."""
    kv_cache_mode: vocabulary.KvCacheMode
    """The KV mode sent: the Refit's override when the members keep, else the fleet's engine.kvCacheMode
    (an engine takes the mode it is sent as its own)."""
    staging_requested: vocabulary.StagingMode
    staging: vocabulary.StagingMode
    """What every member is asked to do: ``staging_requested``, or off when ``auto`` cannot stage."""
    integrity: vocabulary.Integrity
    """The fleet's ``refit.integrity``: on a wire, its buckets' digests; after a checkpoint load or
    megatron-core's swap, each rank's parameter digests, which the operator compares across the
    shards (:mod:`.agreement`)."""
    keep_unavailable: conditions.Verdict | None = None
    """Why the members drain although keep was asked for (the condition KeepUnavailable), or None."""
    staging_reason: str | None = None
    """Why ``staging`` is off although ``staging_requested`` is not."""
    staging_unavailable: str | None = None
    """Why ``staging: required`` cannot be honoured: the Refit fails StagingUnavailable before it starts."""
    commit_requested: vocabulary.CommitMode = "local"
    commit: vocabulary.CommitMode = "local"
    """Who lets the staged version go live, as every member is told (:func:`commit_mode`)."""
    commit_reason: str | None = None
    """Why ``commit`` differs from ``commit_requested``."""
    commit_grace_seconds: int = 30


def resolve(
    fleet: v1alpha1.MegatronGenerationSpec,
    refit: v1alpha1.RefitObjectSpec,
    members: Sequence[MemberCapabilities],
    *,
    native_swap: bool = False,
) -> Modes:
    """The modes of ``refit`` on ``fleet`` whose member pods report ``members``' capabilities;
    ``native_swap``: the Refit goes through a megatron-native session (megatron-core's own swap)."""
    requested = refit.in_flight or fleet.refit.in_flight
    asked_kv = refit.kv_cache_mode or fleet.engine.kv_cache_mode
    keep_unavailable = (
        _keep_unavailable(asked_kv, members, from_fleet=refit.in_flight is None) if requested == "keep" else None
    )
    in_flight: vocabulary.InFlightMode = "drain" if keep_unavailable is not None else requested
    staging_requested = refit.staging or fleet.refit.staging
    cannot_stage = _cannot_stage(members, native_swap=native_swap) if staging_requested != "off" else None
    staging: vocabulary.StagingMode = "off" if cannot_stage is not None else staging_requested
    commit_requested = refit.commit or fleet.refit.commit
    commit, commit_reason = commit_mode(
        commit_requested, staged=staging != "off", trainer=refit.source.rendezvous is not None
    )
    return Modes(
        requested=requested,
        in_flight=in_flight,
        kv_cache_mode=asked_kv if in_flight == "keep" else fleet.engine.kv_cache_mode,
        staging_requested=staging_requested,
        staging=staging,
        integrity=fleet.refit.integrity,
        keep_unavailable=keep_unavailable,
        staging_reason=cannot_stage if staging_requested == "auto" else None,
        staging_unavailable=cannot_stage if staging_requested == "required" else None,
        commit_requested=commit_requested,
        commit=commit,
        commit_reason=commit_reason,
        commit_grace_seconds=fleet.refit.commit_grace_seconds,
    )


def commit_mode(
    requested: vocabulary.CommitMode, *, staged: bool, trainer: bool
) -> tuple[vocabulary.CommitMode, str | None]:
    """The commit every member is told for ``requested``, and why it differs: ``local`` unless the
    members stage (``staged``), ``operator`` for a trainer's commit without our trainer (``trainer``:
    the source is a rendezvous)."""
    if requested == "local":
        return "local", None
    if not staged:
        return "local", IN_PLACE_COMMITS_LOCAL
    if requested == "trainer" and not trainer:
        return "operator", NO_TRAINER_COMMIT
    return requested, None


def _keep_unavailable(
    kv: vocabulary.KvCacheMode, members: Sequence[MemberCapabilities], *, from_fleet: bool
) -> conditions.Verdict | None:
    """Why ``members`` cannot keep under ``kv``, or None; ``from_fleet``: keep is the fleet's
    ``refit.inFlight`` (often its default), not the Refit's own, so the message says how to drain
    without the condition."""
    cannot = [member for member in members if kv not in member.capabilities.keep_modes]
    if not cannot:
        return None
    first = cannot[0]
    more = f" (and {len(cannot) - 1} more pods)" if len(cannot) > 1 else ""
    where = f"shard {first.shard} (pod {first.pod})"
    hint = f" ({DRAIN_WITHOUT_CONDITION})" if from_fleet else ""
    kept = first.capabilities.keep_modes
    if not kept:
        message = f"{where} cannot keep sequences across a refit{more}; every member drained{hint}"
        return conditions.Verdict(True, BACKEND_CANNOT_KEEP, message)
    message = f"{where} keeps with {' or '.join(kept)}, not {kv}{more}; every member drained{hint}"
    return conditions.Verdict(True, KV_CACHE_MODE_NOT_KEPT, message)


def _cannot_stage(members: Sequence[MemberCapabilities], *, native_swap: bool) -> str | None:
    if native_swap:
        return NATIVE_SWAP_WRITES_LIVE
    for member in members:
        if member.capabilities.staging_bytes is None:
            why = member.capabilities.staging_reason or "its engine allocated no staging copy (refit.staging off)"
            return f"shard {member.shard} (pod {member.pod}) cannot stage: {why}"
    return None


def request_fields(modes: Modes) -> dict[str, Any]:
    """The modes as the keyword arguments of every member's refit request. ``staging`` and
    ``integrity`` are left out at the agent's defaults, so an engine built before they existed
    (which refuses unknown fields) still takes the refits of a fleet that does not use them."""
    fields: dict[str, Any] = {"suspend_mode": modes.in_flight, "kv_cache_mode": modes.kv_cache_mode}
    if modes.staging != "off":
        fields["staging"] = modes.staging
    if modes.integrity != "none":
        fields["integrity"] = modes.integrity
    if modes.commit != "local":
        fields["commit"] = modes.commit
        fields["commit_grace_seconds"] = modes.commit_grace_seconds
    return fields


def started_status(modes: Modes) -> Object:
    """What the Refit's status records of its modes when its attempt starts: ``inFlight`` (what was
    asked and what the members were told), ``staging`` when it is already known to be in place (else
    None, which clears an earlier attempt's), and ``commit`` unless it is local (an attempt is retried
    only before its commit was decided, so there is no ``decidedTime`` to clear)."""
    in_flight = v1alpha1.InFlightStatus(
        requested=modes.requested,
        effective=modes.in_flight,
        kv_cache_mode=modes.kv_cache_mode,
        reason=modes.keep_unavailable.message if modes.keep_unavailable is not None else None,
    )
    status: Object = {"inFlight": _dump(in_flight), "staging": None}
    if modes.commit_requested != "local":
        commit = v1alpha1.CommitStatus(requested=modes.commit_requested, mode=modes.commit, reason=modes.commit_reason)
        status["commit"] = _dump(commit)
    if modes.staging == "off":
        staging = v1alpha1.StagingStatus(
            requested=modes.staging_requested, effective="inPlace", reason=modes.staging_reason
        )
        status["staging"] = _dump(staging)
    return status


def _dump(model: v1alpha1.ApiModel) -> Object:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)
