"""Catch-up: a shard behind the fleet's current version copies it from a live peer or loads the checkpoint.

Called by :func:`megafleet.reconcile.reconcile` after fencing (:mod:`.fencing`), while no refit runs
and no RefitSession holds the fleet. The fleet's current version is ``status.refit.currentVersion``
(set by a successful Refit); a shard behind it (added by a scale-out, healed, or left Stale by a
failed attempt) catches up from a peer Ready at that version, else from the current checkpoint if the
last Refit came from one (:func:`megafleet.reconcile.peer_catch_up.choose` says which and why), with
growing delays between failed tries of each source (``Runtime.catch_up``). ``ShardCatchingUp`` and
``CaughtUp`` Events name the source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from megafleet.reconcile import context, peer_catch_up
from megafleet_protocol import agent_api

STARTING_VERSION = 0
"""The weight version of an engine that loaded ``spec.model.source`` at start."""
_SETTLED = ("idle", "succeeded", "failed")
"""Refit phases an agent reports when no attempt runs."""


async def start(ctx: context.FleetContext, *, clock: Callable[[], float] = time.monotonic) -> None:
    """Start a catch-up on each whole shard behind the current version (restarted or added after a
    refit, or left Stale by a failed attempt): from a peer when one is Ready at that version, else
    from the current checkpoint. A failed catch-up is tried again after the delays of
    ``ctx.runtime.catch_up`` (each source its own), each failure reported once as a ``CatchUpFailed``
    Warning; a failed peer copy falls back to the checkpoint at once. Before any Refit succeeded the
    current version is the checkpoint the engines started from (``spec.model.source`` at version 0),
    so a first refit that failed (a trainer or operator that died mid-refit) does not leave the fleet
    Stale. With neither a peer nor a checkpoint a shard stays Stale, not routed, until the next refit."""
    current, path = current_source(ctx)
    starting = ctx.refit.get("currentVersion") is None
    fleet_key = (ctx.fleet.namespace, ctx.fleet.name)

    def applies(key: Hashable) -> bool:
        if not isinstance(key, tuple) or key[:2] != fleet_key:
            return True
        return len(key) == 5 and key[3] == current and key[4] in (path, peer_catch_up.PEER)

    ctx.runtime.catch_up.forget(applies)
    if current is None or ctx.refitting:
        return
    _report_caught_up(ctx, current)
    peers = peer_catch_up.current_peers(ctx.reports, current) if ctx.fleet.spec.weights.catch_up == "peer" else []
    by_peer: dict[int, list[int]] = {}
    for shard, answers in sorted(ctx.reports.items()):
        if any(a is None or a.error is not None or a.state == "failed" for a in answers):
            continue  # not every pod of the shard can take it yet
        if starting and not any(a is not None and a.state == "stale" for a in answers):
            continue  # before any refit only a shard a failed refit left Stale reloads
        if all(a is not None and a.weight_version == current and a.state != "stale" for a in answers):
            continue
        choice, fallback = await _choose(ctx, shard, (current, path), peers, now=clock())
        if isinstance(choice, peer_catch_up.Peer):
            by_peer.setdefault(choice.shard, []).append(shard)
        elif isinstance(choice, peer_catch_up.Checkpoint):
            await _load_checkpoint(ctx, shard, current, choice.path, because=fallback)
    for peer, shards in sorted(by_peer.items()):
        started = await peer_catch_up.start(ctx, peer, shards, current)
        if started is None and path is not None:  # the peer cannot send: the checkpoint now
            for shard in shards:
                await _load_checkpoint(ctx, shard, current, path, because=f"peer shard {peer} cannot send")
        for shard in started or []:
            _record(ctx, shard, current, f"peer shard {peer}")
            ctx.notify("Normal", "ShardCatchingUp", f"shard {shard} copies version {current} from peer shard {peer}")


def current_source(ctx: context.FleetContext) -> tuple[int | None, str | None]:
    """The fleet's current version and the checkpoint it came from: the last successful Refit's,
    or before any, version 0 from ``spec.model.source`` (what engines that start from the checkpoint
    load, :mod:`megafleet_engine.cli`); ``None`` where no checkpoint holds it."""
    current = ctx.refit.get("currentVersion")
    if current is None and ctx.fleet.spec.weights.initial == "checkpoint":
        return STARTING_VERSION, ctx.fleet.spec.model.source
    return current, ctx.refit.get("currentCheckpoint")


async def _choose(
    ctx: context.FleetContext,
    shard: int,
    version: tuple[int, str | None],
    peers: list[int],
    *,
    now: float,
) -> tuple[peer_catch_up.Choice, str]:
    """This shard's source now (``None`` while it catches up or waits), and why a checkpoint is
    loaded rather than copied from a peer (empty when that needs no word)."""
    current, path = version
    progress = [await ctx.agents.refit_status(pod.ip, ctx.token) for pod in ctx.shards.pods[shard]]
    if all(p is not None and p.version == current and p.phase not in _SETTLED for p in progress):
        return None, ""  # already catching up
    failed = next((p for p in progress if p is not None and p.version == current and p.phase == "failed"), None)
    failed_source = None if failed is None else (peer_catch_up.PEER if failed.source == "peer" else path)
    waits: list[float] = []
    for source in (peer_catch_up.PEER, path):
        key = (ctx.fleet.namespace, ctx.fleet.name, shard, current, source)
        if source is None:
            waits.append(float("inf"))
        elif failed is None or source == failed_source:
            left, failures = ctx.runtime.catch_up.wait(key, failed=failed is not None, now=now)
            if failures is not None and failed is not None:
                _report_failure(ctx, shard, (current, source), failures, left, failed.error)
            waits.append(left)
        else:
            waits.append(ctx.runtime.catch_up.left(key, now=now))
    choice = peer_catch_up.choose(shard, peers, path, backend=ctx.fleet.spec.engine.backend, waits=(waits[0], waits[1]))
    chosen = peer_catch_up.PEER if isinstance(choice, peer_catch_up.Peer) else path
    if choice is not None and chosen != failed_source:
        ctx.runtime.catch_up.retrying((ctx.fleet.namespace, ctx.fleet.name, shard, current, chosen))
    if not isinstance(choice, peer_catch_up.Checkpoint) or not peers:
        return choice, ""
    if ctx.fleet.spec.engine.backend == "megatron":
        return choice, "the megatron backend's sharded weights are not copied from peers"
    return choice, "the copy from a peer failed"


def _report_failure(
    ctx: context.FleetContext, shard: int, version: tuple[int, str], failures: int, left: float, error: str | None
) -> None:
    current, source = version
    if source == peer_catch_up.PEER:
        message = f"shard {shard} could not copy version {current} from a peer ({failures} in a row: {error}); "
        message += f"next peer copy in {left:.0f} s"
    else:
        message = f"shard {shard} could not load version {current} from {source} ({failures} in a row: {error}); "
        message += f"next try in {left:.0f} s"
    ctx.notify("Warning", "CatchUpFailed", message)


async def _load_checkpoint(ctx: context.FleetContext, shard: int, current: int, path: str, *, because: str) -> None:
    ips = [pod.ip for pod in ctx.shards.pods[shard]]
    body = agent_api.CheckpointRefitRequest(
        version=current,
        path=path,
        timeout_seconds=ctx.fleet.spec.refit.timeout_seconds,
        kv_cache_mode=ctx.fleet.spec.engine.kv_cache_mode,
    )
    refused = [error for ip in ips if (error := await ctx.agents.refit_start(ip, ctx.token, body))]
    if refused:
        ctx.notify("Warning", "CatchUpRefused", f"shard {shard} cannot load version {current}: {refused[0]}")
        return
    _record(ctx, shard, current, f"checkpoint {path}")
    reason = f" ({because})" if because else ""
    ctx.notify("Normal", "ShardCatchingUp", f"shard {shard} loads version {current} from {path}{reason}")


def _record(ctx: context.FleetContext, shard: int, current: int, source: str) -> None:
    """Remember which source this shard catches up from, for the ``CaughtUp`` Event."""
    ctx.runtime.catching_up[(ctx.fleet.namespace, ctx.fleet.name, shard)] = (current, source)


def _report_caught_up(ctx: context.FleetContext, current: int) -> None:
    """A ``CaughtUp`` Event for each shard that caught up since (every pod Ready at ``current``),
    naming its source; forget catch-ups of another version."""
    fleet_key = (ctx.fleet.namespace, ctx.fleet.name)
    for key, (version, source) in list(ctx.runtime.catching_up.items()):
        if key[:2] != fleet_key:
            continue
        answers = ctx.reports.get(key[2])
        if version != current or not answers:
            del ctx.runtime.catching_up[key]
        elif all(a is not None and a.state == "ready" and a.weight_version == current for a in answers):
            del ctx.runtime.catching_up[key]
            verified = ", every bucket verified (mf64)" if source.startswith("peer") else ""
            message = f"shard {key[2]} serves version {current}, caught up from {source}{verified}"
            ctx.notify("Normal", "CaughtUp", message)
