"""Version fencing: never a mix of weight versions behind the fleet's endpoints.

Called by :func:`megafleet.reconcile.reconcile` after the agents were asked, while no refit runs.
The fleet's current version is ``status.refit.currentVersion`` (set by a successful Refit). A shard
serving another version is fenced (suspended) until a refit, or a checkpoint catch-up
(:mod:`.catch_up`), brings it to the current version.
"""

from __future__ import annotations

from megafleet.reconcile import context


async def fence(ctx: context.FleetContext) -> None:
    """Suspend every pod of a shard that serves another version than the fleet's current one
    (restarted, or added by scaling after a refit) until a refit brings it up to date."""
    current = ctx.refit.get("currentVersion")
    if current is None or ctx.refitting:
        return
    for shard, answers in ctx.reports.items():
        serving = [a for a in answers if a is not None and a.state == "ready" and a.weight_version != current]
        for pod, answer in zip(ctx.shards.pods[shard], answers, strict=True):
            if answer in serving:
                timeout = ctx.settings.shards.fence_timeout_seconds
                await ctx.agents.suspend(pod.ip, ctx.token, mode="abort", timeout_seconds=timeout)
        if serving:
            ctx.notify(
                "Warning",
                "ShardStale",
                f"shard {shard} serves version {serving[0].weight_version}, "
                f"the fleet is at {current}: fenced until the next refit",
            )
