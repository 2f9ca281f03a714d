"""Drive one Refit: membership from live shards, every agent told to receive, progress collected.

Called by the Kopf handlers for Refit objects (:mod:`megafleet.handlers`) on create and by a 1 s
timer while the refit runs. Level-based like the fleet reconcile: the Refit's status says where it
stands (Pending -> Running -> Succeeded | Failed) and each call advances it. The fleet's
``status.refit.active`` is the lock: one refit per fleet at a time, and the fleet's reconcile does
not scale while it is set. On success the fleet's ``status.refit.currentVersion`` moves on; shards
not at it afterwards are Stale (see :mod:`megafleet.reconcile.versions`).

The refit protocol (docs/refit-protocol.md): the trainer ranks come first in the trainer+fleet world,
then each member shard's ranks at its offset (:func:`megafleet.planner.rank_offsets`); the trainer
reads ``status.membership`` to learn the world size before it opens its rendezvous store.

A Refit through a RefitSession (``source.session``, NeMo RL's own collective) uses the session's
membership and held world (:mod:`megafleet.session_driver`): exactly one attempt (a trainer's
broadcast cannot be replayed), and a failure breaks the session (its members leave, the hold is
released). While a session holds the fleet, rendezvous and checkpoint Refits are refused
(``SessionHeld``); a Refit through a session that is not ``Joined`` fails (``SessionNotJoined``).

Versions never go backwards: a Refit whose version is not above the fleet's current one
(:func:`current_version`) ends ``Failed`` with reason ``VersionNotNewer`` before anything is sent
to an agent. Pruning (:func:`prunable`) deletes only finished Refits, never the newest one.

Readiness after a refit comes from the Refit's own completion: the status patch that moves
``status.refit.currentVersion`` also marks each member shard whose agents reported the new version
``Ready`` at it, with ``readyReplicas`` and the Ready, Degraded and WeightsCurrent conditions
(:func:`settled_status`), so a client reading the fleet's status (any process's
:class:`megafleet.sdk.fleet.Fleet`, ``kubectl wait``) sees it at once, not at the reconcile's next pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import pydantic

from megafleet import agent_client, conditions, desired, kube, planner, session_driver
from megafleet import settings as operator_settings
from megafleet.api import checks, v1alpha1
from megafleet.objects import Object
from megafleet.reconcile import endpoints
from megafleet.reconcile import pods as pod_view
from megafleet.reconcile import status as reconcile_status
from megafleet_protocol import agent_api, ports

log = logging.getLogger(__name__)


VERSION_NOT_NEWER = "VersionNotNewer"
"""Reason of the Failed condition of a Refit whose version is not above the fleet's current one."""
SESSION_HELD = "SessionHeld"
"""Reason of the Failed condition of a rendezvous or checkpoint Refit of a fleet a RefitSession holds."""
SESSION_NOT_JOINED = "SessionNotJoined"
"""Reason of the Failed condition of a Refit through a RefitSession that is not Joined (or not this fleet's)."""
REFIT_INFO_MISSING = "RefitInfoMissing"
"""Reason of the Failed condition of a NeMo session Refit whose session has no usable refit info."""


async def advance(
    api: kube.Api, agents: agent_client.AgentClient, refit: Object, *, settings: operator_settings.RefitSettings
) -> None:
    """Move one Refit forward by one step (idempotent)."""
    metadata = refit["metadata"]
    namespace, name = metadata["namespace"], metadata["name"]
    status = dict(refit.get("status") or {})
    phase = status.get("phase", "Pending")
    if phase in ("Succeeded", "Failed"):
        return
    try:  # admission checks the same: only an object admitted by an older CRD fails here
        spec = v1alpha1.RefitObjectSpec.model_validate(refit["spec"])
    except pydantic.ValidationError as error:
        reasons = "; ".join(f"spec.{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors())
        await _finish(api, refit, None, "Failed", f"invalid spec: {reasons}", reason="InvalidSpec")
        return
    fleet_body = await api.get("MegatronGeneration", spec.fleet_ref.name, namespace)
    if fleet_body is None:
        await _finish(api, refit, None, "Failed", f"fleet {spec.fleet_ref.name} does not exist")
        return
    fleet_spec, problems = checks.parse_spec(fleet_body.get("spec") or {})
    if fleet_spec is None or problems:
        await _finish(api, refit, fleet_body, "Failed", f"fleet {spec.fleet_ref.name} has an invalid spec")
        return
    fleet = desired.ParsedFleet(spec.fleet_ref.name, namespace, fleet_body["metadata"]["uid"], 0, fleet_spec)
    current = current_version(fleet_body.get("status") or {})
    if phase == "Pending" and current is not None and spec.version <= current:
        message = (
            f"version {spec.version} is not above fleet {spec.fleet_ref.name}'s current version {current}: "
            "versions never go backwards (create a Refit with a higher version)"
        )
        await _finish(api, refit, None, "Failed", message, reason=VERSION_NOT_NEWER)
        return
    fleet_refit = (fleet_body.get("status") or {}).get("refit") or {}
    held = fleet_refit.get("session")
    if phase == "Pending" and spec.source.session is None and held is not None:
        message = (
            f"fleet {spec.fleet_ref.name} is held by RefitSession {held}: a {_source_name(spec)} refit would drop "
            "its members' place in the trainer's world (refit through the session, or delete it first)"
        )
        await _finish(api, refit, None, "Failed", message, reason=SESSION_HELD)
        return
    active = fleet_refit.get("active")
    if active not in (None, name):
        await _set_status(api, name, namespace, {"phase": "Pending", "message": f"waiting for refit {active}"})
        return
    token = await endpoints.read_token(api, fleet)
    pods = await pod_view.whole_running(api, fleet, held=spec.source.session is not None)
    attempts = 1 if spec.source.session is not None else settings.max_attempts  # a broadcast cannot be replayed
    if phase == "Pending" and spec.source.session is not None:
        await _start_session(api, agents, refit, spec, fleet, fleet_body, pods, token)
        return
    if phase == "Pending":
        await _start(api, agents, refit, spec, fleet, fleet_body, pods, token, max_attempts=attempts)
        return
    await _collect(api, agents, refit, spec, fleet_body, pods, token, max_attempts=attempts)


def _source_name(spec: v1alpha1.RefitObjectSpec) -> str:
    return "checkpoint" if spec.source.checkpoint is not None else "rendezvous"


def current_version(fleet_status: Object) -> int | None:
    """The version a new Refit must be above: ``status.refit.currentVersion`` (the last successful
    Refit's), else the version every Ready shard serves (the checkpoint's 0 before any refit), else
    ``None`` (no weights anywhere yet: any version may come first)."""
    found = (fleet_status.get("refit") or {}).get("currentVersion")
    if found is None:
        found = fleet_status.get("weightVersion")
    return None if found is None else int(found)


async def _start(
    api: kube.Api,
    agents: agent_client.AgentClient,
    refit: Object,
    spec: v1alpha1.RefitObjectSpec,
    fleet: desired.ParsedFleet,
    fleet_body: Object,
    pods: dict[int, list[pod_view.Pod]],
    token: str,
    *,
    max_attempts: int,
) -> None:
    name, namespace = refit["metadata"]["name"], refit["metadata"]["namespace"]
    reachable = {}
    for shard, members in sorted(pods.items()):
        states = await agents.states([pod.ip for pod in members], token)
        if all(state.error is None and state.state != "failed" for state in states):
            reachable[shard] = members
    if not reachable:
        await _set_status(api, name, namespace, {"phase": "Pending", "message": "no live shard to refit yet"})
        return
    layout = fleet.layout
    shard_size = layout.pods_per_shard * layout.ranks_per_pod
    trainer = spec.source.rendezvous.trainer_world_size if spec.source.rendezvous else 1
    membership = planner.rank_offsets(trainer, sorted(reachable), shard_size)
    published = reconcile_status.membership(membership)
    fleet_status = dict(fleet_body.get("status") or {})
    fleet_status["refit"] = {**(fleet_status.get("refit") or {}), "active": name, "membership": published}
    await api.patch_status("MegatronGeneration", fleet.name, namespace, {"refit": fleet_status["refit"]})
    attempt = int((refit.get("status") or {}).get("attempts", 0)) + 1
    await _set_status(
        api,
        name,
        namespace,
        {
            "phase": "Running",
            "membership": published,
            "attempts": attempt,
            "startTime": conditions.now(),
            "message": f"attempt {attempt}: {len(reachable)} shards receive version {spec.version}",
        },
    )
    refused: list[str] = []
    for shard, members in sorted(reachable.items()):
        for pod in members:
            # The shard's offset: each rank adds its own rank in the shard (MEGAFLEET_RANK).
            try:
                body = _request(spec, fleet, membership, membership.offsets[shard], attempt)
            except pydantic.ValidationError as invalid:  # e.g. attempt 2 past port 65535: the agent would refuse it
                refused.append(f"{pod.name} refused: {invalid.errors()[0]['msg']}")
                continue
            error = await agents.refit_start(pod.ip, token, body)
            if error is not None:
                refused.append(f"{pod.name} refused: {error}")
    if refused:  # a member that never started would leave the others waiting for it until their deadline
        started = {**refit, "status": {**(refit.get("status") or {}), "attempts": attempt}}
        await _fail_attempt(
            api, agents, started, fleet_body, reachable, sorted(reachable), token, refused[0], max_attempts=max_attempts
        )


async def _start_session(
    api: kube.Api,
    agents: agent_client.AgentClient,
    refit: Object,
    spec: v1alpha1.RefitObjectSpec,
    fleet: desired.ParsedFleet,
    fleet_body: Object,
    pods: dict[int, list[pod_view.Pod]],
    token: str,
) -> None:
    """Start the one attempt of a Refit through a RefitSession: the session's membership (never
    recomputed), its held world, every member pod told to receive (``POST /v1/refit/nemo`` or
    ``/v1/refit/megatron`` in the session form)."""
    assert spec.source.session is not None
    name, namespace = refit["metadata"]["name"], refit["metadata"]["namespace"]
    session = await session_driver.load(api, namespace, spec.source.session.name)
    refused = _not_joined(session, spec)
    if refused is not None or session is None:
        await _finish(api, refit, None, "Failed", refused or "", reason=SESSION_NOT_JOINED)
        return
    info: list[agent_api.NemoTensor] = []
    if session.spec.nemo_collective is not None:
        try:
            info = await session_driver.read_refit_info(api, session)
        except session_driver.RefitInfoError as error:
            message = f"RefitSession {session.name} has no usable refitInfo: {error}"
            await _finish(api, refit, None, "Failed", message, reason=REFIT_INFO_MISSING)
            return
    membership = session.status.membership
    assert membership is not None  # published before the session could join
    published = membership.model_dump(mode="json", by_alias=True)
    fleet_refit = {**((fleet_body.get("status") or {}).get("refit") or {}), "active": name, "membership": published}
    await api.patch_status("MegatronGeneration", fleet.name, namespace, {"refit": fleet_refit})
    await _set_status(
        api,
        name,
        namespace,
        {
            "phase": "Running",
            "membership": published,
            "attempts": 1,
            "startTime": conditions.now(),
            "message": f"{len(session.members)} shards receive version {spec.version} through RefitSession "
            f"{session.name}",
        },
    )
    body = _session_request(spec, fleet, session, info)
    started = {**refit, "status": {**(refit.get("status") or {}), "attempts": 1}}
    members = [shard for shard, _ in session.members]
    for shard in members:
        if shard not in pods:
            failure = f"shard {shard} of RefitSession {session.name} has no running pods"
            await _fail_attempt(api, agents, started, fleet_body, pods, members, token, failure, max_attempts=1)
            return
        for pod in pods[shard]:
            refusal = await agents.refit_start(pod.ip, token, body)
            if refusal is not None:
                failure = f"{pod.name} refused: {refusal}"
                await _fail_attempt(api, agents, started, fleet_body, pods, members, token, failure, max_attempts=1)
                return


def _not_joined(session: session_driver.Session | None, spec: v1alpha1.RefitObjectSpec) -> str | None:
    """Why a Refit cannot go through its session (it does not exist, serves another fleet, or its
    world is not joined), or None."""
    assert spec.source.session is not None
    named = spec.source.session.name
    if session is None:
        return f"RefitSession {named} does not exist"
    if session.spec.fleet_ref.name != spec.fleet_ref.name:
        return f"RefitSession {named} holds fleet {session.spec.fleet_ref.name}, not {spec.fleet_ref.name}"
    if session.phase != "Joined":
        detail = f": {session.status.message}" if session.status.message else ""
        return f"RefitSession {named} is {session.phase}, not Joined{detail}"
    return None


def _session_request(
    spec: v1alpha1.RefitObjectSpec,
    fleet: desired.ParsedFleet,
    session: session_driver.Session,
    info: list[agent_api.NemoTensor],
) -> agent_api.NemoRefitRequest | agent_api.MegatronRefitRequest:
    """The body every member pod gets: the same for all (each rank knows its place in the world)."""
    version, timeout, kv_cache_mode = spec.version, fleet.spec.refit.timeout_seconds, fleet.spec.engine.kv_cache_mode
    nemo = session.spec.nemo_collective
    if nemo is None:
        return agent_api.MegatronRefitRequest(
            version=version, timeout_seconds=timeout, kv_cache_mode=kv_cache_mode, session=session.key
        )
    return agent_api.NemoRefitRequest(
        version=version,
        timeout_seconds=timeout,
        kv_cache_mode=kv_cache_mode,
        session=session.key,
        refit_info=info,
        bucket_bytes=nemo.bucket_bytes,
        generation=session.status.generation or nemo.generation,
    )


def _request(
    spec: v1alpha1.RefitObjectSpec,
    fleet: desired.ParsedFleet,
    membership: planner.Membership,
    rank_offset: int,
    attempt: int,
) -> agent_api.RefitRequest:
    version, timeout, kv_cache_mode = spec.version, fleet.spec.refit.timeout_seconds, fleet.spec.engine.kv_cache_mode
    if spec.source.checkpoint is not None:
        return agent_api.CheckpointRefitRequest(
            version=version, timeout_seconds=timeout, kv_cache_mode=kv_cache_mode, path=spec.source.checkpoint.path
        )
    rendezvous = spec.source.rendezvous
    assert rendezvous is not None  # the model validator guarantees exactly one source
    return agent_api.PrepareRequest(
        version=version,
        timeout_seconds=timeout,
        kv_cache_mode=kv_cache_mode,
        transport=fleet.spec.refit.transport,
        bucket_size_mib=fleet.spec.refit.bucket_size_mi_b,
        rendezvous=agent_api.RendezvousBody(
            address=rendezvous.address,
            port=ports.attempt_port(rendezvous.port, attempt),  # where the trainer opens this attempt's store
            world_size=membership.world_size,
            rank_offset=rank_offset,
            trainer_world_size=membership.trainer_world_size,
        ),
    )


async def _collect(
    api: kube.Api,
    agents: agent_client.AgentClient,
    refit: Object,
    spec: v1alpha1.RefitObjectSpec,
    fleet_body: Object,
    pods: dict[int, list[pod_view.Pod]],
    token: str,
    *,
    max_attempts: int,
) -> None:
    status = refit.get("status") or {}
    members = [entry["shard"] for entry in (status.get("membership") or {}).get("rankOffsets", [])]
    reports: list[agent_api.RefitStatusResponse] = []
    serving: list[int] = []  # member shards whose every agent reports it ready at the new version
    failure: str | None = None
    for shard in members:
        if shard not in pods:
            failure = f"shard {shard} left the fleet during the refit"
            break
        for pod in pods[shard]:
            report = await agents.refit_status(pod.ip, token)
            if report is None:
                failure = f"the agent of {pod.name} is gone"
                break
            if report.version != spec.version:
                return  # not started there yet
            if report.phase == "failed":
                failure = f"{pod.name}: {report.error}"
                break
            reports.append(report)
        if failure is not None:
            break
        shard_reports = reports[-len(pods[shard]) :]
        if all(report.state == "ready" and report.weight_version == spec.version for report in shard_reports):
            serving.append(shard)
    if failure is not None:
        await _fail_attempt(api, agents, refit, fleet_body, pods, members, token, failure, max_attempts=max_attempts)
        return
    if not all(report.phase == "succeeded" for report in reports):
        return
    phases: dict[str, int] = {}
    for report in reports:
        for timing in report.phases:
            phases[timing.name] = max(phases.get(timing.name, 0), timing.milliseconds)
    duration = max(report.duration_milliseconds or 0 for report in reports)
    await _finish(
        api,
        refit,
        fleet_body,
        "Succeeded",
        f"{len(members)} shards serve version {spec.version}",
        phases=[{"name": k, "milliseconds": v} for k, v in phases.items()],
        duration=duration,
        version=spec.version,
        checkpoint=spec.source.checkpoint.path if spec.source.checkpoint is not None else None,
        serving=serving,
    )
    await _record_session_version(api, refit, spec)


async def _record_session_version(api: kube.Api, refit: Object, spec: v1alpha1.RefitObjectSpec) -> None:
    """After a Refit through a session succeeded: the session's ``status.lastVersion``."""
    if spec.source.session is None:
        return
    session = await session_driver.load(api, refit["metadata"]["namespace"], spec.source.session.name)
    if session is not None:
        await session_driver.record_version(api, session, spec.version)


async def _fail_attempt(
    api: kube.Api,
    agents: agent_client.AgentClient,
    refit: Object,
    fleet_body: Object,
    pods: dict[int, list[pod_view.Pod]],
    members: list[int],
    token: str,
    failure: str,
    *,
    max_attempts: int,
) -> None:
    """Stop every other member at once (not at its deadline), then retry once or give up."""
    for shard in members:
        for pod in pods.get(shard, []):
            await agents.refit_abort(pod.ip, token, f"another member failed: {failure}")
    attempts = int((refit.get("status") or {}).get("attempts", 1))
    if attempts >= max_attempts:
        await _finish(api, refit, fleet_body, "Failed", f"attempt {attempts} failed: {failure}")
        await _break_session(api, agents, refit, failure)
        return
    name, namespace = refit["metadata"]["name"], refit["metadata"]["namespace"]
    log.warning("refit %s/%s attempt %d failed (%s); retrying with the live shards", namespace, name, attempts, failure)
    await _set_status(api, name, namespace, {"phase": "Pending", "message": f"attempt {attempts} failed: {failure}"})


async def _break_session(api: kube.Api, agents: agent_client.AgentClient, refit: Object, failure: str) -> None:
    """A failed Refit through a session breaks it: the trainer may have sent part of the version,
    its stream is out of step with the fleet's (the members leave, the hold goes)."""
    spec = v1alpha1.RefitObjectSpec.model_validate(refit["spec"])
    if spec.source.session is None:
        return
    session = await session_driver.load(api, refit["metadata"]["namespace"], spec.source.session.name)
    if session is None or session.phase in session_driver.ENDED:
        return
    message = f"Refit {refit['metadata']['name']} (version {spec.version}) failed: {failure}"
    await session_driver.end(api, agents, session, phase="Broken", reason=session_driver.REFIT_FAILED, message=message)


async def _finish(
    api: kube.Api,
    refit: Object,
    fleet_body: Object | None,
    phase: str,
    message: str,
    *,
    phases: list[Object] | None = None,
    duration: int | None = None,
    version: int | None = None,
    checkpoint: str | None = None,
    serving: Sequence[int] = (),
    reason: str | None = None,
) -> None:
    name, namespace = refit["metadata"]["name"], refit["metadata"]["namespace"]
    now = conditions.now()
    found = conditions.set_condition(
        list((refit.get("status") or {}).get("conditions", [])),
        "Complete" if phase == "Succeeded" else "Failed",
        True,
        reason or phase,
        message,
        generation=int(refit["metadata"].get("generation", 1)),
        now=now,
    )
    update: Object = {"phase": phase, "message": message, "completionTime": now, "conditions": found}
    if phases is not None:
        update["phases"] = phases
    if duration is not None:
        update["durationMilliseconds"] = duration
    # The fleet first, then the Refit: a write lost in between (an API server restart, an operator
    # killed) leaves the Refit unfinished, so its poll runs again and finishes it. The other order
    # left the fleet locked by a Succeeded Refit that nothing polls any more (docs/incidents.md).
    released = fleet_body is not None and await _release_fleet(
        api,
        name,
        fleet_body,
        now,
        version=version,
        duration=duration,
        phases=phases,
        checkpoint=checkpoint,
        serving=serving,
    )
    await _set_status(api, name, namespace, update)
    if released and fleet_body is not None:
        await _prune(api, namespace, fleet_body)


async def _release_fleet(
    api: kube.Api,
    name: str,
    fleet_body: Object,
    now: str,
    *,
    version: int | None,
    duration: int | None,
    phases: list[Object] | None,
    checkpoint: str | None,
    serving: Sequence[int],
) -> bool:
    """Clear the fleet's ``status.refit.active`` (when Refit ``name`` holds it) and, on success, move
    its current version on; False when another Refit holds the fleet (nothing written)."""
    namespace = fleet_body["metadata"]["namespace"]
    fleet_refit = dict(((fleet_body.get("status") or {}).get("refit")) or {})
    if fleet_refit.get("active") not in (None, name):
        return False
    current = fleet_refit.get("currentVersion")
    if version is not None and isinstance(current, int) and current > version:
        version = None  # a retried finish after a later Refit ended: the version never goes back
    fleet_refit["active"] = None
    if version is not None:
        fleet_refit.update({"currentVersion": version, "lastDurationMilliseconds": duration, "lastPhases": phases})
        # What a shard that falls behind this version catches up from (None: the next refit).
        fleet_refit["currentCheckpoint"] = checkpoint
    fleet_update: Object = {"refit": fleet_refit}
    fleet_status = fleet_body.get("status") or {}
    if version is not None and serving and fleet_status.get("shards"):
        # In the same patch as currentVersion: no reader sees the new version without its shards.
        replicas = int((fleet_body.get("spec") or {}).get("replicas", 1))
        generation = int(fleet_body["metadata"].get("generation", 1))
        fleet_update.update(
            settled_status(fleet_status, serving, version, replicas=replicas, generation=generation, now=now)
        )
    await api.patch_status("MegatronGeneration", fleet_body["metadata"]["name"], namespace, fleet_update)
    return True


def settled_status(
    fleet_status: Object, serving: Iterable[int], version: int, *, replicas: int, generation: int, now: str
) -> Object:
    """The fleet status fields a successful refit settles at once: the member shards (see
    :func:`settled_shards`), ``readyReplicas``, ``weightVersion`` when every Ready shard serves
    ``version``, and the Ready, Degraded and WeightsCurrent conditions, computed as the reconcile
    computes them, so readiness does not wait for its next pass."""
    shards = settled_shards(fleet_status.get("shards") or [], serving, version)
    ready = sum(1 for entry in shards if entry.get("phase") == "Ready")
    found = list(fleet_status.get("conditions") or [])
    found = reconcile_status.ready_condition(found, ready, replicas, generation=generation, now=now)
    found = reconcile_status.degraded(found, ready, replicas, generation=generation, now=now)
    found = reconcile_status.weights_current(found, shards, {"currentVersion": version}, generation=generation, now=now)
    settled: Object = {"shards": shards, "readyReplicas": ready, "conditions": found}
    if {entry.get("weightVersion") for entry in shards if entry.get("phase") == "Ready"} == {version}:
        settled["weightVersion"] = version
    return settled


def settled_shards(shards: Iterable[Object], serving: Iterable[int], version: int) -> list[Object]:
    """``status.shards`` after a successful refit: each shard in ``serving`` (its agents reported
    the refit succeeded, engine ready at ``version``) is ``Ready`` at ``version``; others as they were
    (the reconcile's next pass observes them, and marks those behind ``Stale``)."""
    settled = set(serving)
    updated = []
    for entry in shards:
        if entry.get("index") in settled:
            entry = {**entry, "phase": "Ready", "weightVersion": version}
            entry.pop("lastError", None)
        updated.append(entry)
    return updated


async def _prune(api: kube.Api, namespace: str, fleet_body: Object) -> None:
    """Delete the fleet's finished Refits beyond ``refit.historyLimit`` (see :func:`prunable`)."""
    limit = int(((fleet_body.get("spec") or {}).get("refit") or {}).get("historyLimit", 10))
    fleet = fleet_body["metadata"]["name"]
    ours = [item for item in await api.list("Refit", namespace=namespace) if item["spec"]["fleetRef"]["name"] == fleet]
    for name in prunable(ours, limit):
        await api.delete("Refit", name, namespace)


def prunable(refits: Iterable[Object], limit: int) -> list[str]:
    """Names of the Refits (all of one fleet) to delete so that ``limit`` finished ones remain.

    Only finished Refits (Succeeded, Failed) are ever chosen, oldest first by creation (then
    version, then name). Never chosen: a Pending or Running Refit, the last created (whatever its
    phase: the one a trainer is most likely still watching, e.g. one just refused as
    ``VersionNotNewer``) and the one of the highest version (the fleet's current). Kept ones count
    towards ``limit`` when finished."""
    every = sorted(refits, key=_created)
    if not every:
        return []
    kept = {every[-1]["metadata"]["name"], max(every, key=_versioned)["metadata"]["name"]}
    finished = [item for item in every if (item.get("status") or {}).get("phase") in ("Succeeded", "Failed")]
    excess = len(finished) - max(limit, 0)
    chosen = [item["metadata"]["name"] for item in finished if item["metadata"]["name"] not in kept]
    return chosen[: max(excess, 0)]


def _created(item: Object) -> tuple[str, int, str]:
    return item["metadata"].get("creationTimestamp", ""), int(item["spec"]["version"]), item["metadata"]["name"]


def _versioned(item: Object) -> tuple[int, str, str]:
    return int(item["spec"]["version"]), item["metadata"].get("creationTimestamp", ""), item["metadata"]["name"]


async def _set_status(api: kube.Api, name: str, namespace: str, status: Object) -> None:
    await api.patch_status("Refit", name, namespace, status)
