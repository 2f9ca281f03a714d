"""Checkpoint catch-up: a shard behind the fleet's current version loads the current checkpoint.

Called by :func:`megafleet.reconcile.reconcile` after fencing (:mod:`.fencing`), while no refit runs
and no RefitSession holds the fleet. The fleet's current version is ``status.refit.currentVersion``
(set by a successful Refit); a shard behind it loads the current checkpoint, if the last Refit came
from one, with growing delays between failed tries (``Runtime.catch_up``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from megafleet.reconcile import context
from megafleet_protocol import agent_api

STARTING_VERSION = 0
"""The weight version of an engine that loaded ``spec.model.source`` at start."""
_SETTLED = ("idle", "succeeded", "failed")
"""Refit phases an agent reports when no attempt runs."""


async def start(ctx: context.FleetContext, *, clock: Callable[[], float] = time.monotonic) -> None:
    """Start a checkpoint load on each whole shard behind the current version (restarted or added
    after a refit, or left Stale by a failed attempt). A failed catch-up is tried again after the
    delays of ``ctx.runtime.catch_up``, each failure reported once as a ``CatchUpFailed`` Warning.
    Before any Refit succeeded the current version is the checkpoint the engines started from
    (``spec.model.source`` at version 0), so a first refit that failed (a trainer or operator that
    died mid-refit) does not leave the fleet Stale. Without a current checkpoint a shard stays
    Stale, not routed, until the next refit."""
    current, path = current_source(ctx)
    starting = ctx.refit.get("currentVersion") is None
    fleet_key = (ctx.fleet.namespace, ctx.fleet.name)

    def applies(key: Hashable) -> bool:
        return not isinstance(key, tuple) or key[:2] != fleet_key or key[3:] == (current, path)

    ctx.runtime.catch_up.forget(applies)
    if current is None or path is None or ctx.refitting:
        return
    for shard, answers in sorted(ctx.reports.items()):
        if any(a is None or a.error is not None or a.state == "failed" for a in answers):
            continue  # not every pod of the shard can take it yet
        if starting and not any(a is not None and a.state == "stale" for a in answers):
            continue  # before any refit only a shard a failed refit left Stale reloads
        if all(a is not None and a.weight_version == current and a.state != "stale" for a in answers):
            continue
        await _catch_up_shard(ctx, shard, current, path, now=clock())


def current_source(ctx: context.FleetContext) -> tuple[int | None, str | None]:
    """The fleet's current version and the checkpoint it came from: the last successful Refit's,
    or before any, version 0 from ``spec.model.source`` (what engines that start from the checkpoint
    load, :mod:`megafleet_engine.cli`); ``None`` where no checkpoint holds it."""
    current = ctx.refit.get("currentVersion")
    if current is None and ctx.fleet.spec.weights.initial == "checkpoint":
        return STARTING_VERSION, ctx.fleet.spec.model.source
    return current, ctx.refit.get("currentCheckpoint")


async def _catch_up_shard(ctx: context.FleetContext, shard: int, current: int, path: str, *, now: float) -> None:
    ips = [pod.ip for pod in ctx.shards.pods[shard]]
    progress = [await ctx.agents.refit_status(ip, ctx.token) for ip in ips]
    if all(p is not None and p.version == current and p.phase not in _SETTLED for p in progress):
        return  # already catching up
    failed = [p for p in progress if p is not None and p.version == current and p.phase == "failed"]
    key = (ctx.fleet.namespace, ctx.fleet.name, shard, current, path)
    left, failures = ctx.runtime.catch_up.wait(key, failed=bool(failed), now=now)
    if failures is not None:
        ctx.notify(
            "Warning",
            "CatchUpFailed",
            f"shard {shard} could not load version {current} from {path} ({failures} in a row: "
            f"{failed[0].error}); next try in {left:.0f} s",
        )
    if left > 0:
        return
    body = agent_api.CheckpointRefitRequest(
        version=current,
        path=path,
        timeout_seconds=ctx.fleet.spec.refit.timeout_seconds,
        kv_cache_mode=ctx.fleet.spec.engine.kv_cache_mode,
    )
    refused = [error for ip in ips if (error := await ctx.agents.refit_start(ip, ctx.token, body))]
    if refused:
        ctx.notify("Warning", "CatchUpRefused", f"shard {shard} cannot load version {current}: {refused[0]}")
    else:
        ctx.notify("Normal", "ShardCatchingUp", f"shard {shard} loads version {current} from {path}")
