"""Drive one RefitSession: a trainer's own weight-transfer world that the fleet's shards join once
(at NeMo RL's ``init_collective``) and hold for the run's refits.

Called by the Kopf handlers for RefitSession objects (:mod:`megafleet.handlers`) on create, resume
and a 1 s timer, and on delete (the session's finalizer); the Refit driver
(:mod:`megafleet.refit_driver`, the layer above) reads sessions with :func:`load` and
:func:`read_refit_info` and ends one with :func:`end` when a refit through it fails. Always under
the fleet's lock, beside the fleet's reconcile. Level-based: the session's ``status.phase`` says
where it stands and each call advances it by one step:

* ``Pending``: checks (:func:`check`: ``WorldSizeMismatch``, ``BackendNotSupported`` end it
  ``Failed``), then waits until no other session or Refit holds the fleet and every shard runs with
  an answering agent (``loading`` counts: a join needs no weights), at most ``joinTimeoutSeconds``
  after creation (then ``Failed``, ``NotReady``). Then it takes the hold (the fleet's
  ``status.refit.session`` and condition ``RefitSessionHeld``), publishes the membership
  (:func:`megafleet.planner.rank_offsets`, decided once, never recomputed) and asks every member
  pod's agent to join (``POST /v1/refit/nemo/join`` or ``/v1/refit/megatron/join``).
* ``Joining``: every member pod reports ``world.phase`` ``joined`` → ``Joined``; a refusal, a
  failed join, a lost pod or the deadline → ``Failed``, ``JoinFailed`` naming the pod (never retried:
  the trainer's store has already counted or timed out its clients).
* ``Joined``: the refit info (a ConfigMap of gzip'd JSON) is checked once (``RefitInfoAccepted``, or
  ``Broken``, ``RefitInfoRejected``); a member gone, failed, restarted or out of the world →
  ``Broken``, ``MemberLost`` naming shard and pod; every member reporting the trainer's store
  unreachable for ``trainer_gone_seconds`` → ``Closed``, ``TrainerGone``. While a Refit through the
  session runs, the Refit driver owns the outcome.

Every end (:func:`end`) tells the members to leave and releases the hold, so healing and the held
spec changes run again. Agents know a session by its UID: a new session of the same name is
another world.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import gzip
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Literal

import pydantic

from megafleet import agent_client, conditions, desired, kube, planner
from megafleet.api import checks, v1alpha1
from megafleet.objects import Object
from megafleet.reconcile import context, endpoints, hold
from megafleet.reconcile import pods as pod_view
from megafleet.reconcile import status as reconcile_status
from megafleet_protocol import agent_api

log = logging.getLogger(__name__)


JOINED = "Joined"
"""Condition: every member joined the trainer's world (False, with the reason, once it ends)."""
REFIT_INFO_ACCEPTED = "RefitInfoAccepted"
"""Condition: ``spec.refitInfo`` was read and matches its sha256 and count."""
BROKEN = "Broken"
"""Condition: the held world was lost (reason MemberLost, RefitFailed or RefitInfoRejected)."""

WORLD_SIZE_MISMATCH = "WorldSizeMismatch"
BACKEND_NOT_SUPPORTED = "BackendNotSupported"
NOT_READY = "NotReady"
JOIN_FAILED = "JoinFailed"
MEMBER_LOST = "MemberLost"
REFIT_FAILED = "RefitFailed"
REFIT_INFO_REJECTED = "RefitInfoRejected"
TRAINER_GONE = "TrainerGone"

ENDED = hold.ENDED
"""Phases a session never leaves."""


@dataclasses.dataclass(frozen=True)
class Session:
    """A RefitSession as the drivers read it (parsed once where it is read)."""

    name: str
    namespace: str
    uid: str
    generation: int
    created: datetime.datetime
    spec: v1alpha1.RefitSessionSpec
    status: v1alpha1.RefitSessionStatus
    conditions: list[conditions.Condition]
    raw_status: Object = dataclasses.field(default_factory=dict, compare=False)
    """``status`` as read, so that a write that would change nothing is not made."""

    @classmethod
    def parse(cls, body: Object) -> Session:
        metadata = body["metadata"]
        raw_status = body.get("status") or {}
        created = metadata.get("creationTimestamp")
        return cls(
            name=metadata["name"],
            namespace=metadata["namespace"],
            uid=metadata.get("uid", ""),
            generation=int(metadata.get("generation", 1)),
            created=_timestamp(created) if created else _utcnow(),
            spec=v1alpha1.RefitSessionSpec.model_validate(body["spec"]),
            status=v1alpha1.RefitSessionStatus.model_validate(raw_status),
            conditions=list(raw_status.get("conditions") or []),
            raw_status=dict(raw_status),
        )

    @property
    def phase(self) -> str:
        return self.status.phase

    @property
    def key(self) -> str:
        """What the agents know the session by: its UID (a recreated session is another world)."""
        return self.uid

    @property
    def deadline(self) -> datetime.datetime:
        """Until when the members may take to join: creation + ``joinTimeoutSeconds``."""
        return self.created + datetime.timedelta(seconds=self.spec.join_timeout_seconds)

    @property
    def members(self) -> list[tuple[int, int]]:
        """(shard, rank offset) of every member, as published at the join (empty before)."""
        membership = self.status.membership
        return [] if membership is None else [(entry.shard, entry.offset) for entry in membership.rank_offsets]

    @property
    def protocol(self) -> Literal["nemo", "megatron"]:
        """Whose world it is: NeMo's collective (nemoCollective) or megatron-core's group (megatronNative)."""
        return "nemo" if self.spec.nemo_collective is not None else "megatron"

    @property
    def world_address(self) -> str:
        world = self.spec.world
        return f"{world.address}:{world.port}"


async def load(api: kube.Api, namespace: str, name: str) -> Session | None:
    body = await api.get("RefitSession", name, namespace)
    return None if body is None else Session.parse(body)


async def advance(
    runtime: context.Runtime,
    body: Object,
    *,
    now: Callable[[], datetime.datetime] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Move one RefitSession forward by one step (idempotent). ``now`` (wall time, for the join
    deadline) and ``clock`` (monotonic, for the trainer-gone wait) are replaced by tests."""
    session = Session.parse(body)
    if session.phase in ENDED:
        return
    at = (now or _utcnow)()
    fleet_body = await runtime.api.get("MegatronGeneration", session.spec.fleet_ref.name, session.namespace)
    if session.phase == "Pending":
        await _pending(runtime, session, fleet_body, at)
    elif session.phase == "Joining":
        await _joining(runtime, session, fleet_body, at)
    else:
        await _joined(runtime, session, fleet_body, clock())


def check(spec: v1alpha1.RefitSessionSpec, fleet: desired.ParsedFleet) -> tuple[str, str] | None:
    """Why the fleet can never field the trainer's inference world, as (reason, message), or None.

    Every shard has the same ``S`` = TP x PP x CP ranks, so the fleet fields ``spec.replicas x S``
    ranks, and they must be exactly ``worldSize - trainerWorldSize``; megatronNative needs the
    megatron backend (megatron-core's own receiving side)."""
    world = spec.world
    if spec.megatron_native is not None and fleet.spec.engine.backend != "megatron":
        return BACKEND_NOT_SUPPORTED, (
            f"megatronNative needs engine.backend megatron (megatron-core receives the swap); fleet {fleet.name} "
            f"runs {fleet.spec.engine.backend}: use nemoCollective"
        )
    shard_size = fleet.layout.pods_per_shard * fleet.layout.ranks_per_pod
    fleet_ranks, wanted = fleet.spec.replicas * shard_size, world.world_size - world.trainer_world_size
    if fleet_ranks != wanted:
        return WORLD_SIZE_MISMATCH, (
            f"the trainer's inference world is {wanted} ranks (worldSize {world.world_size} - trainerWorldSize "
            f"{world.trainer_world_size}); fleet {fleet.name} has {fleet.spec.replicas} shards x {shard_size} ranks "
            f"= {fleet_ranks}"
        )
    return None


# -- Pending -----------------------------------------------------------------------------------


async def _pending(
    runtime: context.Runtime, session: Session, fleet_body: Object | None, at: datetime.datetime
) -> None:
    fleet_name = session.spec.fleet_ref.name
    if fleet_body is None:
        await _set_status(runtime.api, session, {"phase": "Pending", "message": f"fleet {fleet_name} does not exist"})
        return
    fleet = _parse_fleet(fleet_body)
    if fleet is None:
        message = f"fleet {fleet_name} has an invalid spec"
        await _set_status(runtime.api, session, {"phase": "Pending", "message": message})
        return
    problem = check(session.spec, fleet)
    if problem is not None:
        await end(runtime.api, runtime.agents, session, phase="Failed", reason=problem[0], message=problem[1])
        return
    refit = (fleet_body.get("status") or {}).get("refit") or {}
    token = await endpoints.read_token(runtime.api, fleet)
    pods: dict[int, list[pod_view.Pod]] = {}
    if refit.get("session") not in (None, session.name):
        waiting: str | None = f"waiting for RefitSession {refit['session']}"
    elif refit.get("active") is not None:
        waiting = f"waiting for Refit {refit['active']}"
    else:
        pods = await pod_view.whole_running(runtime.api, fleet)
        waiting = await _not_ready(runtime.agents, fleet, pods, token)
    if waiting is None:
        await _take_and_join(runtime, session, fleet, fleet_body, pods, token, at)
    elif at >= session.deadline:
        message = f"{waiting} for joinTimeoutSeconds {session.spec.join_timeout_seconds}"
        await end(runtime.api, runtime.agents, session, phase="Failed", reason=NOT_READY, message=message)
    else:
        await _set_status(runtime.api, session, {"phase": "Pending", "message": waiting})


async def _not_ready(
    agents: agent_client.AgentClient, fleet: desired.ParsedFleet, pods: dict[int, list[pod_view.Pod]], token: str
) -> str | None:
    """What a join waits for: a shard without all its pods running, or an agent that does not
    answer or reports its engine failed; None when every shard can join."""
    for shard in range(fleet.spec.replicas):
        members = pods.get(shard)
        if members is None:
            return f"waiting for shard {shard}'s pods to run"
        for pod, state in zip(members, await agents.states([pod.ip for pod in members], token), strict=True):
            if state.error is not None:
                return f"waiting for the agent of {pod.name} (shard {shard}): {state.error}"
            if state.state == "failed":
                return f"waiting for shard {shard}: the engine of {pod.name} failed ({state.last_error})"
    return None


async def _take_and_join(
    runtime: context.Runtime,
    session: Session,
    fleet: desired.ParsedFleet,
    fleet_body: Object,
    pods: dict[int, list[pod_view.Pod]],
    token: str,
    at: datetime.datetime,
) -> None:
    """Hold the fleet, publish the membership, and ask every member pod to join."""
    api, world = runtime.api, session.spec.world
    shard_size = fleet.layout.pods_per_shard * fleet.layout.ranks_per_pod
    membership = planner.rank_offsets(world.trainer_world_size, range(fleet.spec.replicas), shard_size)
    published = reconcile_status.membership(membership)
    await _hold(api, fleet_body, session.name)
    first, last = world.trainer_world_size, membership.world_size - 1
    update = {
        "phase": "Joining",
        "membership": published,
        "message": f"{len(pods)} shards join {session.world_address} as ranks {first}..{last} of {world.world_size}",
    }
    await _set_status(api, session, update)
    session = _written(session, update)
    left = max(1, int((session.deadline - at).total_seconds()))
    for shard, offset in sorted(membership.offsets.items()):
        for pod in pods[shard]:
            error = await runtime.agents.join(pod.ip, token, _join_body(session, offset, left))
            if error is not None:
                message = f"shard {shard}, pod {pod.name} refused the join: {error}"
                await end(api, runtime.agents, session, phase="Failed", reason=JOIN_FAILED, message=message)
                return
    log.info("RefitSession %s/%s: %d shards asked to join", session.namespace, session.name, len(pods))


def _join_body(
    session: Session, offset: int, timeout_seconds: int
) -> agent_api.NemoJoinRequest | agent_api.MegatronJoinRequest:
    world = session.spec.world
    rendezvous = agent_api.RendezvousBody(
        address=world.address,
        port=world.port,
        world_size=world.world_size,
        rank_offset=offset,
        trainer_world_size=world.trainer_world_size,
    )
    if session.spec.nemo_collective is not None:
        return agent_api.NemoJoinRequest(
            session=session.key,
            rendezvous=rendezvous,
            generation=session.spec.nemo_collective.generation,
            timeout_seconds=timeout_seconds,
        )
    assert session.spec.megatron_native is not None  # the model validator guarantees one protocol
    return agent_api.MegatronJoinRequest(
        session=session.key,
        rendezvous=rendezvous,
        copy_backend=session.spec.megatron_native.copy_backend,
        timeout_seconds=timeout_seconds,
    )


# -- Joining and Joined -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Members:
    """What the member pods' agents report about the session's world."""

    lost: str | None = None
    """The first member that is gone, failed or out of the world: 'shard i, pod p: why'."""
    joining: str | None = None
    """The first member pod still joining (or not answering this time)."""
    worlds: tuple[agent_api.NemoWorldStatus, ...] = ()


async def _members(runtime: context.Runtime, session: Session, fleet: desired.ParsedFleet, token: str) -> _Members:
    """Ask every member pod for its membership of the session's world. A pod that does not run any
    more, or whose agent holds no membership of this session (a restarted engine), is lost; an
    agent that does not answer while its pod runs is only not known this time."""
    shards = await pod_view.observe(runtime.api, fleet)
    worlds: list[agent_api.NemoWorldStatus] = []
    joining: str | None = None
    for shard, _offset in session.members:
        members = shards.pods.get(shard, [])
        if len(members) != fleet.layout.pods_per_shard:
            gone = ", ".join(pod.name for pod in members) or "every pod"
            return _Members(lost=f"shard {shard}: pods are gone (left: {gone})")
        for pod in members:
            if not pod.running or pod.deleting:
                state = "is being deleted" if pod.deleting else f"is {pod.phase or 'not running'}"
                return _Members(lost=f"shard {shard}, pod {pod.name} {state}")
            report = await runtime.agents.refit_status(pod.ip, token)
            if report is None:
                joining = joining or f"the agent of {pod.name} does not answer"
                continue
            world = report.world
            if world is None or world.session != session.key:
                return _Members(lost=f"shard {shard}, pod {pod.name} holds no membership of this world (restarted?)")
            if world.phase in ("failed", "left"):
                why = world.error or ("it left the world" if world.phase == "left" else "its join failed")
                return _Members(lost=f"shard {shard}, pod {pod.name}: {why}")
            if world.phase == "joining":
                joining = joining or f"pod {pod.name} is still joining"
            worlds.append(world)
    return _Members(joining=joining, worlds=tuple(worlds))


async def _joining(
    runtime: context.Runtime, session: Session, fleet_body: Object | None, at: datetime.datetime
) -> None:
    fleet = _parse_fleet(fleet_body)
    if fleet is None:
        message = f"fleet {session.spec.fleet_ref.name} is gone or invalid"
        await end(runtime.api, runtime.agents, session, phase="Failed", reason=JOIN_FAILED, message=message)
        return
    token = await endpoints.read_token(runtime.api, fleet)
    found = await _members(runtime, session, fleet, token)
    if found.lost is not None:
        await end(runtime.api, runtime.agents, session, phase="Failed", reason=JOIN_FAILED, message=found.lost)
        return
    if found.joining is None:
        await _become_joined(runtime.api, session, found.worlds)
        return
    grace = datetime.timedelta(seconds=runtime.settings.session.join_grace_seconds)
    if at >= session.deadline + grace:
        message = f"not joined within joinTimeoutSeconds {session.spec.join_timeout_seconds}: {found.joining}"
        await end(runtime.api, runtime.agents, session, phase="Failed", reason=JOIN_FAILED, message=message)


async def _become_joined(api: kube.Api, session: Session, worlds: tuple[agent_api.NemoWorldStatus, ...]) -> None:
    world = session.spec.world
    ranks = world.world_size - world.trainer_world_size
    message = f"{ranks} fleet ranks joined the trainer's world at {session.world_address} ({world.world_size} ranks)"
    found = conditions.set_condition(
        session.conditions,
        JOINED,
        True,
        "AllMembersJoined",
        message,
        generation=session.generation,
        now=conditions.now(),
    )
    update: Object = {"phase": "Joined", "message": message, "conditions": found}
    generation = next((found.generation for found in worlds if found.generation is not None), None)
    if generation is not None:
        update["generation"] = generation
    await _set_status(api, session, update)
    log.info("RefitSession %s/%s joined: %s", session.namespace, session.name, message)


async def _joined(runtime: context.Runtime, session: Session, fleet_body: Object | None, now: float) -> None:
    fleet = _parse_fleet(fleet_body)
    api, agents = runtime.api, runtime.agents
    if fleet is None or fleet_body is None:
        message = f"fleet {session.spec.fleet_ref.name} is gone or invalid"
        await end(api, agents, session, phase="Broken", reason=MEMBER_LOST, message=message)
        return
    active = ((fleet_body.get("status") or {}).get("refit") or {}).get("active")
    if active is not None:
        return  # a Refit through this session runs: the Refit driver decides how it ends
    accepted = conditions.find(session.conditions, REFIT_INFO_ACCEPTED) or {}
    if session.spec.refit_info is not None and accepted.get("status") != "True":
        checked = await _accept_refit_info(api, agents, session)
        if checked is None:
            return
        session = checked
    token = await endpoints.read_token(api, fleet)
    found = await _members(runtime, session, fleet, token)
    key = (session.namespace, session.name)
    if found.lost is not None:
        runtime.store_lost.pop(key, None)
        await end(api, agents, session, phase="Broken", reason=MEMBER_LOST, message=found.lost)
        return
    unreachable = len(found.worlds) == len(session.members) * fleet.layout.pods_per_shard and all(
        world.store_reachable is False for world in found.worlds
    )
    if not unreachable:
        runtime.store_lost.pop(key, None)
        return
    since = runtime.store_lost.setdefault(key, now)
    waited = runtime.settings.session.trainer_gone_seconds
    if now - since >= waited:
        runtime.store_lost.pop(key, None)
        message = (
            f"every member has found the trainer's store at {session.world_address} unreachable for {waited:g} s: "
            "the trainer is gone"
        )
        await end(api, agents, session, phase="Closed", reason=TRAINER_GONE, message=message)


# -- refit info ---------------------------------------------------------------------------------


class RefitInfoError(ValueError):
    """``spec.refitInfo`` cannot be used; ``missing``: its ConfigMap (or key) does not exist (yet)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


async def read_refit_info(api: kube.Api, session: Session) -> list[agent_api.NemoTensor]:
    """The trainer's ``prepare_refit_info`` from the session's ConfigMap: gzip'd JSON
    ``[[name, shape, dtype], ...]`` under ``binaryData[key]``, checked against ``sha256`` and
    ``tensors``. Raises :class:`RefitInfoError`."""
    ref = session.spec.refit_info
    if ref is None:
        raise RefitInfoError(f"RefitSession {session.name} has no refitInfo yet", missing=True)
    source = f"ConfigMap {ref.config_map_ref.name} key {ref.config_map_ref.key}"
    found = await api.get("ConfigMap", ref.config_map_ref.name, session.namespace)
    encoded = ((found or {}).get("binaryData") or {}).get(ref.config_map_ref.key)
    if encoded is None:
        raise RefitInfoError(f"{source} does not exist", missing=True)
    return parse_refit_info(base64.b64decode(encoded), sha256=ref.sha256, tensors=ref.tensors, source=source)


def parse_refit_info(packed: bytes, *, sha256: str, tensors: int, source: str) -> list[agent_api.NemoTensor]:
    """The refit info in ``packed`` (gzip'd JSON), checked; :class:`RefitInfoError` names what is wrong."""
    digest = hashlib.sha256(packed).hexdigest()
    if digest != sha256:
        raise RefitInfoError(f"{source}: sha256 {digest} is not refitInfo.sha256 {sha256}")
    try:
        entries = json.loads(gzip.decompress(packed))
    except (OSError, EOFError, ValueError) as error:
        raise RefitInfoError(f"{source} is not gzip'd JSON: {error}") from None
    if not isinstance(entries, list) or len(entries) != tensors:
        count = len(entries) if isinstance(entries, list) else "no list of"
        raise RefitInfoError(f"{source} holds {count} tensors, refitInfo.tensors says {tensors}")
    try:
        return [agent_api.NemoTensor(name=name, shape=shape, dtype=dtype) for name, shape, dtype in entries]
    except (TypeError, ValueError, pydantic.ValidationError) as error:
        raise RefitInfoError(f"{source}: an entry is not [name, shape, dtype]: {error}") from None


async def _accept_refit_info(api: kube.Api, agents: agent_client.AgentClient, session: Session) -> Session | None:
    """Check ``spec.refitInfo`` once; the session as it goes on, or None once it ended (a missing
    ConfigMap only waits: the trainer may write it after the spec)."""
    try:
        info = await read_refit_info(api, session)
    except RefitInfoError as error:
        if error.missing:
            found = conditions.set_condition(
                session.conditions, REFIT_INFO_ACCEPTED, False, "Waiting", str(error),
                generation=session.generation, now=conditions.now(),
            )  # fmt: skip
            await _set_status(api, session, {"conditions": found})
            return _written(session, {"conditions": found})
        await end(api, agents, session, phase="Broken", reason=REFIT_INFO_REJECTED, message=str(error))
        return None
    message = f"{len(info)} tensors, sha256 {session.spec.refit_info.sha256[:12]}…" if session.spec.refit_info else ""
    found = conditions.set_condition(
        session.conditions, REFIT_INFO_ACCEPTED, True, "Checked", message,
        generation=session.generation, now=conditions.now(),
    )  # fmt: skip
    await _set_status(api, session, {"conditions": found})
    return _written(session, {"conditions": found})


# -- ending, the hold, the last version ------------------------------------------------------------


async def end(
    api: kube.Api, agents: agent_client.AgentClient, session: Session, *, phase: str, reason: str, message: str
) -> None:
    """End the session in ``phase`` (Failed, Broken or Closed) for ``reason``: every member leaves
    the world, the hold is released, and the status says why (condition Joined=False, and Broken
    for a broken one)."""
    await release(api, agents, session)
    now, generation = conditions.now(), session.generation
    found = conditions.set_condition(session.conditions, JOINED, False, reason, message, generation=generation, now=now)
    if phase == "Broken":
        found = conditions.set_condition(found, BROKEN, True, reason, message, generation=generation, now=now)
    await _set_status(api, session, {"phase": phase, "message": message, "conditions": found})
    log.warning("RefitSession %s/%s is %s (%s): %s", session.namespace, session.name, phase, reason, message)


async def release(api: kube.Api, agents: agent_client.AgentClient, session: Session) -> None:
    """Tell every pod of the member shards to leave the session's world (idempotent; best effort),
    then release the fleet's hold if this session has it. Also the finalizer's work on delete."""
    fleet_body = await api.get("MegatronGeneration", session.spec.fleet_ref.name, session.namespace)
    fleet = _parse_fleet(fleet_body)
    if fleet is None or fleet_body is None:
        return
    if session.members:
        token = await endpoints.read_token(api, fleet)
        shards = await pod_view.observe(api, fleet)
        for shard, _offset in session.members:
            for pod in shards.pods.get(shard, []):
                if pod.ip:
                    await agents.leave(pod.ip, token, session.key, protocol=session.protocol)
    refit = dict((fleet_body.get("status") or {}).get("refit") or {})
    if refit.get("session") != session.name:
        return
    refit["session"] = None
    found = hold.released(
        list((fleet_body.get("status") or {}).get("conditions") or []),
        generation=fleet.generation,
        now=conditions.now(),
    )
    await api.patch_status("MegatronGeneration", fleet.name, fleet.namespace, {"refit": refit, "conditions": found})


async def _hold(api: kube.Api, fleet_body: Object, session: str) -> None:
    """Take the fleet's hold for ``session``: ``status.refit.session`` and RefitSessionHeld."""
    status = fleet_body.get("status") or {}
    refit = {**(status.get("refit") or {}), "session": session}
    generation = int(fleet_body["metadata"].get("generation", 1))
    found = hold.held(list(status.get("conditions") or []), session, [], generation=generation, now=conditions.now())
    metadata = fleet_body["metadata"]
    await api.patch_status(
        "MegatronGeneration", metadata["name"], metadata["namespace"], {"refit": refit, "conditions": found}
    )


async def record_version(api: kube.Api, session: Session, version: int) -> None:
    """``status.lastVersion`` after a Refit through the session succeeded."""
    await _set_status(api, session, {"lastVersion": version, "message": f"version {version} received"})


def _parse_fleet(body: Object | None) -> desired.ParsedFleet | None:
    if body is None:
        return None
    spec, problems = checks.parse_spec(body.get("spec") or {})
    if spec is None or problems:
        return None
    metadata = body["metadata"]
    return desired.ParsedFleet(
        metadata["name"], metadata["namespace"], metadata.get("uid", ""), int(metadata.get("generation", 1)), spec
    )


def _written(session: Session, update: Object) -> Session:
    """``session`` as it is once ``update`` was merged into its status."""
    raw = {**session.raw_status, **update}
    return dataclasses.replace(
        session,
        status=v1alpha1.RefitSessionStatus.model_validate(raw),
        conditions=list(raw.get("conditions") or []),
        raw_status=raw,
    )


async def _set_status(api: kube.Api, session: Session, status: Object) -> None:
    """Merge-patch the session's status, unless that changes nothing (a waiting session is polled
    every second)."""
    if reconcile_status.unchanged(session.raw_status, status):
        return
    await api.patch_status("RefitSession", session.name, session.namespace, status)


def _timestamp(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
