"""How a RefitSession ends: its members leave the trainer's world and the fleet's hold is released.

Called by the RefitSession controller's steps (a failed join, a lost member, a trainer gone, a
rejected refit info), by the Refit controller when a refit through the session fails
(:mod:`.attempts`), and by the session's delete handler in :mod:`megafleet.handlers` (its
finalizer's work, :func:`release`). Once the hold is released, healing and the held spec changes
run again.
"""

from __future__ import annotations

import logging

from megafleet import agent_client, conditions, kube
from megafleet.fleet_state import hold, pods, token
from megafleet.refits import context, session_status, session_view

log = logging.getLogger(__name__)


async def end(
    api: kube.Api,
    agents: agent_client.AgentClient,
    session: session_view.Session,
    *,
    phase: str,
    reason: str,
    message: str,
) -> None:
    """End the session in ``phase`` (Failed, Broken or Closed) for ``reason``: every member leaves
    the world, the hold is released, and the status says why (condition Joined=False, and Broken
    for a broken one)."""
    await release(api, agents, session)
    await session_view.write(api, session, session_status.ended(session, phase, reason, message, conditions.now()))
    log.warning("RefitSession %s/%s is %s (%s): %s", session.namespace, session.name, phase, reason, message)


async def release(api: kube.Api, agents: agent_client.AgentClient, session: session_view.Session) -> None:
    """Tell every pod of the member shards to leave the session's world (idempotent; best effort),
    then release the fleet's hold if this session has it. Also the finalizer's work on delete."""
    fleet_body = await api.get("MegatronGeneration", session.spec.fleet_ref.name, session.namespace)
    fleet = context.parse_fleet(fleet_body)
    if fleet is None or fleet_body is None:
        return
    if session.members:
        secret = await token.read(api, fleet)
        shards = await pods.observe(api, fleet)
        for shard, _offset in session.members:
            for pod in shards.pods.get(shard, []):
                if pod.ip:
                    await agents.leave(pod.ip, secret, session.key, protocol=session.protocol)
    await hold.release(api, fleet_body, session.name)
