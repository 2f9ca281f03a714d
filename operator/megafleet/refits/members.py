"""The member pods of a RefitSession, as their agents answer: whether they can join, and what they
report of the trainer's world once asked to.

Called by the RefitSession controller's steps (:mod:`.session_controller`): :func:`not_ready`
before the join (Pending), :func:`report` while joining and once joined.
"""

from __future__ import annotations

import dataclasses

from megafleet.fleet_state import pods
from megafleet.refits import context
from megafleet_protocol import agent_api


async def not_ready(ctx: context.SessionContext) -> str | None:
    """What a join waits for: a shard without all its pods running (``ctx.pods``), or an agent that
    does not answer or reports its engine failed; None when every shard can join. An engine still
    loading, or without weights, can join: a join needs no weights."""
    for shard in ctx.session.spec.member_shards(ctx.fleet.spec.replicas):  # shards outside the world may heal
        members = ctx.pods.get(shard)
        if members is None:
            return f"waiting for shard {shard}'s pods to run"
        for pod, state in zip(members, await ctx.agents.states([pod.ip for pod in members], ctx.token), strict=True):
            if state.error is not None:
                return f"waiting for the agent of {pod.name} (shard {shard}): {state.error}"
            if state.state == "failed":
                return f"waiting for shard {shard}: the engine of {pod.name} failed ({state.last_error})"
    return None


@dataclasses.dataclass(frozen=True)
class Report:
    """What the member pods' agents report about the session's world."""

    lost: str | None = None
    """The first member that is gone, failed or out of the world: 'shard i, pod p: why'."""
    joining: str | None = None
    """The first member pod still joining (or not answering this time)."""
    worlds: tuple[agent_api.NemoWorldStatus, ...] = ()


async def report(ctx: context.SessionContext) -> Report:
    """Ask every member pod for its membership of the session's world. A pod that does not run any
    more, or whose agent holds no membership of this session (a restarted engine), is lost; an
    agent that does not answer while its pod runs is only not known this time."""
    session, fleet = ctx.session, ctx.fleet
    shards = await pods.observe(ctx.api, fleet)
    worlds: list[agent_api.NemoWorldStatus] = []
    joining: str | None = None
    for shard, _offset in session.members:
        members = shards.pods.get(shard, [])
        if len(members) != fleet.layout.pods_per_shard:
            gone = ", ".join(pod.name for pod in members) or "every pod"
            return Report(lost=f"shard {shard}: pods are gone (left: {gone})")
        for pod in members:
            if not pod.running or pod.deleting:
                state = "is being deleted" if pod.deleting else f"is {pod.phase or 'not running'}"
                return Report(lost=f"shard {shard}, pod {pod.name} {state}")
            found = await ctx.agents.refit_status(pod.ip, ctx.token)
            if found is None:
                joining = joining or f"the agent of {pod.name} does not answer"
                continue
            world = found.world
            if world is None or world.session != session.key:
                return Report(lost=f"shard {shard}, pod {pod.name} holds no membership of this world (restarted?)")
            if world.phase in ("failed", "left"):
                why = world.error or ("it left the world" if world.phase == "left" else "its join failed")
                return Report(lost=f"shard {shard}, pod {pod.name}: {why}")
            if world.phase == "joining":
                joining = joining or f"pod {pod.name} is still joining"
            worlds.append(world)
    return Report(joining=joining, worlds=tuple(worlds))
