"""The other rank processes of a pod, as its agent (on local rank 0) reaches them.

A pod with several local ranks (one per GPU) serves one agent to the operator, on local rank 0.
Every rank receives its own weights during a refit, so that agent forwards each refit call to the
pod's other ranks and answers with one status for the whole pod (:func:`combine`). Each of those
ranks runs the same agent app, with the same bearer token, at ``agent port + local rank`` on the
pod's loopback address (:func:`sibling_host`), so nothing outside the pod can reach it; its refit
transport still binds the pod IP, where the trainer reaches it.

Called by :mod:`megafleet_engine.agent_server`'s refit routes; :mod:`megafleet_engine.cli` builds the
:class:`Siblings` of local rank 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from megafleet_protocol import vocabulary

__all__ = ["SiblingError", "Siblings", "combine", "sibling_host", "sibling_port"]

FORWARD_TIMEOUT_SECONDS = 30.0
"""How long one forwarded call may take (a refit call returns at once; its work runs on a thread)."""
_ORDER: tuple[str, ...] = typing.get_args(vocabulary.AttemptPhase)  # the least advanced first


def sibling_host(pod_ip: str) -> str:
    """Where the other local ranks' agents listen: the pod's loopback, private to the pod. Where the
    "pod IP" is itself a loopback address (the local pod runner, tests: several pods share one
    loopback), that address, so two pods' ranks never collide."""
    return pod_ip if ipaddress.ip_address(pod_ip).is_loopback else "127.0.0.1"


def sibling_port(agent_port: int, local_rank: int) -> int:
    """The port local rank ``local_rank``'s agent listens on (local rank 0: the pod's agent port)."""
    return agent_port + local_rank


class SiblingError(RuntimeError):
    """A sibling rank's agent refused a forwarded call or could not be reached."""

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclasses.dataclass(frozen=True)
class Siblings:
    """The agents of the pod's local ranks 1..N-1: base URLs and the shared token file."""

    urls: tuple[str, ...]
    token_file: Path

    async def post(self, path: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """POST ``body`` to ``path`` on every sibling at once; their JSON answers, in rank order."""
        return await self._all("POST", path, body)

    async def get(self, path: str) -> list[dict[str, Any]]:
        """GET ``path`` from every sibling at once; their JSON answers, in rank order."""
        return await self._all("GET", path, None)

    async def _all(self, method: str, path: str, body: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        token = self.token_file.read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_SECONDS, headers=headers) as client:
            return list(await asyncio.gather(*(self._one(client, method, url + path, body) for url in self.urls)))

    @staticmethod
    async def _one(client: httpx.AsyncClient, method: str, url: str, body: Mapping[str, Any] | None) -> dict[str, Any]:
        try:
            response = await client.request(method, url, json=body)
        except httpx.HTTPError as error:
            raise SiblingError(f"the pod's rank at {url} did not answer: {error}", status_code=502) from None
        try:
            payload = response.json()
        except ValueError:
            payload = {}
        if response.status_code >= 400:
            message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
            raise SiblingError(
                f"the pod's rank at {url} answered {response.status_code}: {message or response.text[:200]}",
                status_code=response.status_code,
            )
        if not isinstance(payload, dict):
            raise SiblingError(f"the pod's rank at {url} answered no JSON object", status_code=502)
        return payload


_WORLD_ORDER = ("failed", "left", "joining", "joined")


def combine_world(ranks: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """One membership of NeMo's world for the pod from every rank's (``world`` of the refit status,
    or a join's answer): the least advanced phase of any rank (failed first, then left, joining,
    joined), with the errors of the ranks that failed; ``None`` when no rank joined anything. The
    stage communicators of NeMo's reshard (``reshard``) are combined the same way."""
    combined = _least_advanced(ranks, "NeMo's world")
    if combined is not None and any(world and world.get("reshard") for world in ranks):
        combined["reshard"] = _least_advanced(
            [world.get("reshard") if world else None for world in ranks], "the stage communicators"
        )
    return combined


def _least_advanced(ranks: Sequence[Mapping[str, Any] | None], what: str) -> dict[str, Any] | None:
    worlds = [world for world in ranks if world]
    if not worlds:
        return None
    combined = dict(worlds[0])
    if len(worlds) < len(ranks):  # a rank that never heard of the join holds no membership
        combined["phase"] = "failed"
        combined["error"] = f"a rank of this pod has not joined {what}"
        return combined
    combined["phase"] = min((str(world.get("phase")) for world in worlds), key=_WORLD_ORDER.index)
    errors = [f"rank {world.get('rank')}: {world.get('error')}" for world in worlds if world.get("error")]
    if errors:
        combined["error"] = "; ".join(errors)
    return combined


def combine(own: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One refit status for the pod from every rank's (camelCase bodies of ``/v1/refit/status``).

    The pod has failed when any rank failed (the first failure's error, naming its rank), and has
    succeeded only when every rank has; otherwise it is in the least advanced phase of any rank.
    Timings are the slowest rank's, counters are summed, ``dirty`` and ``timedOut`` are any rank's,
    ``verification`` the first rank's that caught a mismatch or a non-finite tensor (else local rank
    0's), with the buckets every rank verified and, when the ranks' ``bucketDigests`` differ (each rank
    digested its own parameters: megatron-native, a checkpoint), every rank's list one after another
    in rank order (ranks of NeMo's wire receive the same bytes and report one list).
    ``state`` and ``weightVersion`` stay local rank 0's: the pod serves what that rank serves."""
    ranks = [own, *others]
    combined = dict(own)
    failed = [status for status in ranks if status.get("phase") == "failed"]
    if failed:
        combined["phase"] = "failed"
        combined["error"] = "; ".join(f"rank {status.get('rank')}: {status.get('error')}" for status in failed)
    elif all(status.get("phase") == "succeeded" for status in ranks):
        combined["phase"] = "succeeded"
    else:
        running = [status for status in ranks if status.get("phase") != "succeeded"]
        combined["phase"] = min((str(status.get("phase")) for status in running), key=_ORDER.index)
    if not failed and len({status.get("version") for status in ranks}) > 1:  # a rank is on an older attempt
        combined["phase"] = min(combined["phase"], "suspending", key=_ORDER.index)
    slowest: dict[str, int] = {}
    for status in ranks:
        for phase in status.get("phases", []):
            slowest[phase["name"]] = max(slowest.get(phase["name"], 0), int(phase["milliseconds"]))
    combined["phases"] = [{"name": name, "milliseconds": ms} for name, ms in slowest.items()]
    durations = [status["durationMilliseconds"] for status in ranks if status.get("durationMilliseconds") is not None]
    combined["durationMilliseconds"] = max(durations) if len(durations) == len(ranks) else None
    for counter in ("bytesReceived", "buckets", "tensorsWritten"):
        combined[counter] = sum(int(status.get(counter, 0)) for status in ranks)
    combined["world"] = combine_world([status.get("world") for status in ranks])
    for flag in ("dirty", "timedOut"):
        combined[flag] = any(bool(status.get(flag)) for status in ranks)
    verified = [status["verification"] for status in ranks if status.get("verification")]
    if verified:  # a rank that caught something speaks for the pod; its buckets are summed like the counters
        caught = [one for one in verified if one.get("mismatch") or one.get("nonFinite")]
        combined["verification"] = {**(caught or verified)[0], "buckets": sum(int(one["buckets"]) for one in verified)}
        in_order = sorted((status for status in ranks if status.get("verification")), key=lambda s: s.get("rank") or 0)
        lists = [list(status["verification"].get("bucketDigests") or []) for status in in_order]
        if any(found != lists[0] for found in lists):
            combined["verification"]["bucketDigests"] = [one for found in lists for one in found]
    return combined
