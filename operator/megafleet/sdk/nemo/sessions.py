"""The Kubernetes objects of NeMo RL's own refit wire, and what their status says (proposal 0001).

* :func:`world_check`: NeMo's inference world ``W - T`` against the fleet's ranks, before anything exists.
* :func:`session` and :func:`refit`: the ``RefitSession`` made at ``init_collective`` (owned by the
  fleet) and each ``Refit`` that names it, with the in-flight modes of NeMo RL's async flags.
* :func:`outcome` / :func:`refit_outcome`: whether a session joined and a Refit succeeded, and the
  message the adapter raises when not (with the restart advice: NeMo RL cannot rebuild its world).
* :func:`reshard_stages` / :func:`stages_outcome`: NeMo's M-to-N reshard stages
  (``init_nccl_reshard_comm_group``) as the session's ``nemoReshard``, checked against its world, and
  whether the members joined them.

Called by :class:`~megafleet.sdk.nemo.refit_wire_nemo.NemoWire`. Pure: JSON objects in and out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.sdk.nemo import async_flags

__all__ = [
    "RESTART_ADVICE",
    "describe",
    "fleet_ranks",
    "outcome",
    "refit",
    "refit_outcome",
    "reshard_stages",
    "session",
    "stages_outcome",
    "world_check",
]

Outcome = Literal["waiting", "done", "failed"]

RESTART_ADVICE = "NeMo RL cannot rebuild its collective: restart the job from its last checkpoint"
"""What a user does once a session is lost: on resume, GRPO's ``init_collective`` makes a new one."""
_ENDED = ("Broken", "Closed", "Failed")


def fleet_ranks(fleet: Object) -> tuple[int, int]:
    """``(shards, ranks per shard)`` of the fleet: ``spec.replicas`` and TP x PP x CP."""
    spec = v1alpha1.MegatronGenerationSpec.model_validate(fleet.get("spec") or {})
    parallelism = spec.parallelism
    return spec.replicas, parallelism.tensor * parallelism.pipeline * parallelism.context


def world_check(
    fleet: Object, world_size: int, train_world_size: int, members: Sequence[int] | None = None
) -> str | None:
    """Why NeMo's world cannot be fielded by this fleet (``None`` when it can): the fleet (or the
    ``members`` of NeMo's refit membership) must bring exactly ``world_size - train_world_size`` ranks."""
    shards, per_shard = fleet_ranks(fleet)
    name = (fleet.get("metadata") or {}).get("name", "?")
    inference = world_size - train_world_size
    if members is not None:
        outside = [shard for shard in members if shard >= shards]
        if outside:
            return f"NeMo's refit membership names shards {outside}; fleet {name} has {shards}"
        if inference != len(members) * per_shard:
            return (
                f"NeMo's inference world is {inference} ranks (world_size {world_size} - train_world_size "
                f"{train_world_size}); its membership's {len(members)} shards x {per_shard} ranks = "
                f"{len(members) * per_shard}"
            )
        return None
    if inference == shards * per_shard:
        return None
    return (
        f"NeMo's inference world is {inference} ranks (world_size {world_size} - train_world_size "
        f"{train_world_size}); fleet {name} has {shards} shards x {per_shard} ranks = {shards * per_shard}: "
        f"make NeMo RL's inference cluster {shards * per_shard} GPUs (world_size "
        f"{train_world_size + shards * per_shard}) or the fleet's spec.replicas match"
    )


def session(
    name: str,
    namespace: str,
    fleet: Object,
    world: v1alpha1.NemoCollectiveSpec | v1alpha1.MegatronNativeSpec,
    join_timeout_seconds: int,
    shards: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A ``RefitSession`` for ``world``, owned by the fleet (deleted with it); ``shards``: NeMo's refit
    membership (``None``: every shard)."""
    metadata = fleet["metadata"]
    nemo = isinstance(world, v1alpha1.NemoCollectiveSpec)
    spec = v1alpha1.RefitSessionSpec(
        fleet_ref=v1alpha1.FleetRef(name=metadata["name"]),
        nemo_collective=world if nemo else None,
        megatron_native=None if nemo else world,
        join_timeout_seconds=join_timeout_seconds,
        shards=None if shards is None else list(shards),
    )
    return {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": "RefitSession",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "ownerReferences": [
                {
                    "apiVersion": v1alpha1.API_VERSION,
                    "kind": "MegatronGeneration",
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                }
            ],
        },
        "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
    }


def refit(
    name: str, namespace: str, fleet_name: str, version: int, session_name: str, modes: async_flags.RefitModes
) -> dict[str, Any]:
    """A ``Refit`` of ``fleet_name`` to ``version`` over the world ``session_name`` holds, asking the
    engines for ``modes`` (NeMo RL's async flags: in flight ``keep`` or ``drain``, ``kvCacheMode``)."""
    spec = v1alpha1.RefitObjectSpec(
        fleet_ref=v1alpha1.FleetRef(name=fleet_name),
        version=version,
        source=v1alpha1.RefitSourceSpec(session=v1alpha1.SessionSource(name=session_name)),
    )
    return {
        "apiVersion": v1alpha1.API_VERSION,
        "kind": "Refit",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {**spec.model_dump(mode="json", by_alias=True, exclude_none=True), **modes.spec_fields()},
    }


def _status(obj: Object | None) -> Mapping[str, Any]:
    return (obj or {}).get("status") or {}


def _condition(obj: Object | None, kind: str) -> Mapping[str, Any] | None:
    return next((c for c in _status(obj).get("conditions") or [] if c.get("type") == kind), None)


def describe(name: str, obj: Object | None) -> str:
    """``RefitSession <name> is <phase> (<reason>: <message>)``, from its status."""
    if obj is None:
        return f"RefitSession {name} was deleted"
    status = _status(obj)
    phase = status.get("phase") or "Pending"
    broken = _condition(obj, "Broken")
    reason = (broken or {}).get("reason") or ""
    message = status.get("message") or (broken or {}).get("message") or ""
    detail = ": ".join(part for part in (reason, message) if part)
    return f"RefitSession {name} is {phase}" + (f" ({detail})" if detail else "")


def outcome(name: str, obj: Object | None, *, info_sha256: str | None) -> tuple[Outcome, str]:
    """Whether the session is joined (and has accepted the refit info with ``info_sha256``, when
    given), still on its way, or will never be: ``(outcome, message)``."""
    phase = _status(obj).get("phase") or "Pending"
    if obj is None or phase in _ENDED:
        return "failed", f"{describe(name, obj)}; {RESTART_ADVICE}"
    if phase != "Joined":
        return "waiting", describe(name, obj)
    if info_sha256 is None:
        return "done", describe(name, obj)
    accepted = _condition(obj, "RefitInfoAccepted")
    if accepted is None or accepted.get("status") == "Unknown":
        return "waiting", f"RefitSession {name} is checking the refit info"
    if accepted.get("status") != "True":
        why = f"{accepted.get('reason')}: {accepted.get('message')}"
        return "failed", f"RefitSession {name} refused the refit info ({why})"
    return "done", describe(name, obj)


def refit_outcome(
    refit_name: str, refit_obj: Object | None, session_name: str, session_obj: Object | None
) -> tuple[Outcome, str]:
    """Whether a session Refit succeeded, runs, or failed; a failure names the session's state and
    the restart advice (a failed session refit breaks the session: the trainer's stream is out of step)."""
    phase = _status(refit_obj).get("phase")
    if phase == "Succeeded":
        return "done", f"Refit {refit_name} succeeded"
    session_phase = _status(session_obj).get("phase")
    if refit_obj is None or phase == "Failed" or session_obj is None or session_phase in _ENDED:
        what = "was deleted" if refit_obj is None else f"is {phase or 'Pending'}"
        message = _status(refit_obj).get("message") or ""
        refit_part = f"Refit {refit_name} {what}" + (f" ({message})" if message else "")
        return "failed", f"{refit_part}; {describe(session_name, session_obj)}; {RESTART_ADVICE}"
    return "waiting", f"Refit {refit_name} is {phase or 'Pending'}"


def reshard_stages(
    spec: Object, pp_ips: Sequence[str], pp_ports: Sequence[int], train_ranks_per_stage: int, sub_world_size: int
) -> v1alpha1.NemoReshardSpec:
    """NeMo's ``init_nccl_reshard_comm_group`` arguments as the session's ``nemoReshard``, checked
    against the session's ``spec`` (its world) as the API server will check them.

    Raises:
        ValueError: the stages do not fit the session's world (naming the numbers).
    """
    reshard = v1alpha1.NemoReshardSpec(
        stages=[v1alpha1.ReshardStage(address=ip, port=port) for ip, port in zip(pp_ips, pp_ports, strict=True)],
        trainer_ranks_per_stage=train_ranks_per_stage,
        sub_world_size=sub_world_size,
    )
    merged = {**spec, "nemoReshard": reshard.model_dump(mode="json", by_alias=True, exclude_none=True)}
    try:
        v1alpha1.RefitSessionSpec.model_validate(merged)
    except ValueError as error:
        raise ValueError(f"NeMo's reshard stages do not fit the RefitSession's world: {error}") from None
    return reshard


def stages_outcome(name: str, obj: Object | None) -> tuple[Outcome, str]:
    """Whether the session's members joined NeMo's reshard stages (condition ``ReshardJoined``)."""
    phase = _status(obj).get("phase") or "Pending"
    if obj is None or phase in _ENDED:
        return "failed", f"{describe(name, obj)}; {RESTART_ADVICE}"
    joined = _condition(obj, "ReshardJoined")
    if joined is None or joined.get("status") != "True":
        why = (joined or {}).get("message") or "not asked yet"
        return "waiting", f"RefitSession {name}'s members are joining the stage communicators ({why})"
    return "done", describe(name, obj)
