"""Which source catches a shard up to the fleet's current version, and the catch-up from a peer.

Called by :mod:`megafleet.reconcile.catch_up` (the catch-up step of a reconcile), which runs only
while no refit runs and no RefitSession holds the fleet. :func:`choose` (pure) picks, for one shard
behind the current version, a live peer of the same fleet or the current checkpoint:

1. a **peer** first, when a shard is Ready at the current version, the backend holds whole tensors
   (``transformers``) and no peer copy to this shard failed within its delay: a copy from a peer's
   memory moves the weights at network speed, needs no trainer and no checkpoint (after a refit from
   a trainer's rendezvous there is none), and reads nothing from shared storage that every shard
   loading at once would contend for;
2. else the **checkpoint**, when the last Refit came from one (or, before any, ``spec.model.source``)
   and no load of it failed within its delay: a peer copy that failed falls back to it at once;
3. else nothing: the shard stays Stale (fenced, not routed) until a source is due again or the next
   refit.

A fleet whose ``spec.weights.catchUp`` is ``checkpoint`` has no peers to choose. The megatron
backend holds its weights in megatron's sharded layout (slices under megatron names), which a
receiver's sinks do not take one to one; its shards catch up from the checkpoint only, and the
``ShardCatchingUp`` Event says so. :func:`start` sends the copies: every shard that chose a peer in
this reconcile is spread over the peers, each peer pod sending once (``POST /v1/peer/send``, rank
``r`` of its shard at ``PEER_PORT + r``) to the shards that chose it, which receive together (``POST
/v1/refit/peer``: pod ``j`` of a receiving shard from pod ``j`` of the peer, the shards of a fleet
sharing one parallel layout), each bucket checked against its ``mf64`` digest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megafleet.fleet_state import pods
from megafleet.reconcile import context
from megafleet_protocol import agent_api, ports, vocabulary

__all__ = ["PEER", "Checkpoint", "Choice", "Peer", "choose", "current_peers", "start"]

PEER = "peer"
"""The catch-up backoff's source part for peer copies (a checkpoint's is its path)."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """Copy the current version from shard ``shard``."""

    shard: int


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Load the current version from the checkpoint at ``path``."""

    path: str


Choice = Peer | Checkpoint | None
"""A shard's catch-up source; ``None``: none now (it stays Stale)."""


def choose(
    shard: int,
    peers: Sequence[int],
    checkpoint: str | None,
    *,
    backend: vocabulary.BackendName,
    waits: tuple[float, float] = (0.0, 0.0),
) -> Choice:
    """The source that catches shard ``shard`` up now: a peer of ``peers`` (the shards Ready at the
    current version, in index order; spread by the shard's index so that several catching up share
    the load), else ``checkpoint``, else nothing. ``waits``: the seconds left before a peer copy and a
    checkpoint load to this shard may be tried again after failing (0: due)."""
    peer_wait, checkpoint_wait = waits
    if backend != "megatron" and peers and peer_wait <= 0:
        return Peer(peers[shard % len(peers)])
    if checkpoint is not None and checkpoint_wait <= 0:
        return Checkpoint(checkpoint)
    return None


def current_peers(reports: pods.Reports, current: int) -> list[int]:
    """The shards every pod of which answers Ready at version ``current``, in index order."""
    return sorted(
        shard
        for shard, answers in reports.items()
        if answers
        and all(
            a is not None and a.error is None and a.state == "ready" and a.weight_version == current for a in answers
        )
    )


async def start(ctx: context.FleetContext, peer: int, shards: list[int], current: int) -> list[int] | None:
    """Copy version ``current`` from shard ``peer`` to ``shards`` (their catch-ups are due and chose
    it); returns the shards that started receiving, or ``None`` when the peer cannot send (its agent
    does not answer ``GET /v1/peer/status``: the caller loads the checkpoint instead). A peer still
    sending an earlier copy is left alone (the shards are tried at the next reconcile). The receivers
    are asked first, then the peer: a receiver that refuses stops the copy before the peer listens
    (the others are aborted), and a peer that refuses (it moved on meanwhile) aborts the receivers,
    whose catch-up then failed."""
    senders = ctx.shards.pods[peer]
    for pod in senders:
        sending = await ctx.agents.peer_status(pod.ip, ctx.token)
        if sending is None:
            return None
        if sending.phase == "sending":
            return []
    spec = ctx.fleet.spec
    collective = _collective(ctx.settings.catch_up.peer_collective)
    started: list[str] = []
    for index, shard in enumerate(shards, start=1):
        for sender, receiver in zip(senders, ctx.shards.pods[shard], strict=False):
            receive = agent_api.PeerRefitRequest(
                version=current,
                timeout_seconds=spec.refit.timeout_seconds,
                kv_cache_mode=spec.engine.kv_cache_mode,
                integrity="checksum",
                bucket_size_mib=spec.refit.bucket_size_mi_b,
                collective=collective,
                peer=agent_api.PeerBody(
                    address=sender.ip, port=ports.PEER_PORT, receivers=len(shards), index=index, shard=peer
                ),
            )
            error = await ctx.agents.refit_start(receiver.ip, ctx.token, receive)
            if error is not None:
                ctx.notify("Warning", "CatchUpRefused", f"shard {shard} cannot copy version {current}: {error}")
                await _abort(ctx, started, f"shard {shard} of the same copy refused it")
                return []
            started.append(receiver.ip)
    body = agent_api.PeerSendRequest(
        version=current,
        port=ports.PEER_PORT,
        receivers=len(shards),
        timeout_seconds=spec.refit.timeout_seconds,
        bucket_size_mib=spec.refit.bucket_size_mi_b,
        integrity="checksum",
        collective=collective,
    )
    for pod in senders:
        refused = await ctx.agents.peer_send(pod.ip, ctx.token, body)
        if refused is not None:
            await _abort(ctx, started, f"peer shard {peer} sends no copy: {refused}")
            return []
    return shards


async def _abort(ctx: context.FleetContext, ips: list[str], reason: str) -> None:
    for ip in ips:
        await ctx.agents.refit_abort(ip, ctx.token, reason)


def _collective(setting: str) -> vocabulary.CollectiveBackend | None:
    """``settings.catch_up.peer_collective``: ``gloo`` or ``nccl``; anything else (the default, empty)
    leaves it to the engines (NCCL between GPU engines, gloo between CPU ones)."""
    if setting == "gloo":
        return "gloo"
    if setting == "nccl":
        return "nccl"
    return None
