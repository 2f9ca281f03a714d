"""Which frontends of a fleet may take requests, and which one takes the next: pure code, no I/O.

Used by :mod:`megafleet.sdk.fleet` (frontends from the fleet's status) and
:mod:`megafleet.sdk.generation` (one :class:`Router` per client). A frontend takes traffic only when
its shard is ``Ready`` and, once a Refit has succeeded, serves the fleet's current weight version:
``Stale`` shards (restarted, or added by scaling after a refit) and shards still starting or loading
get nothing (docs/architecture.md, "Shards that fall behind"). The members of a running refit keep
traffic: their engines hold requests during the refit's suspend and serve them with the new version,
and the operator marks them ``Ready`` at it in the very status patch that ends the refit, so no
client waits for the operator's next observation
(:func:`megafleet.refits.refit_status.settled_status`). Among the routable frontends the
:class:`Router` picks the shard :mod:`megafleet.sdk.affinity` places a prompt on (:meth:`Router.place`:
the samples of one prompt and the turns of one conversation together, distinct prompts spread, no
shard over the load bound), else the one with the fewest outstanding requests, rotating among ties,
so a batch submitted at once spreads evenly and a slow frontend gets less.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

from megafleet.api import v1alpha1
from megafleet.sdk import affinity, errors

__all__ = ["Addressing", "Frontend", "Router", "endpoint_urls", "pod_urls", "routable", "select"]

Addressing = Literal["service", "dns", "pod"]
"""How a frontend is reached: ``service`` (the reserved ClusterIP URL of ``status.endpoints``; the
default inside a cluster), ``dns`` (the Service's DNS name) or ``pod`` (pod 0's IP and the frontend
port; no kube-proxy hop, and the only choice on the local control plane, whose ClusterIPs are data)."""


@dataclasses.dataclass(frozen=True)
class Frontend:
    """One shard's OpenAI-compatible frontend."""

    shard: int
    url: str  # the OpenAI base URL, ending in /v1
    weight_version: int | None  # what the fleet's status says the shard serves


def routable(status: v1alpha1.MegatronGenerationStatus) -> dict[int, int | None]:
    """Shard index -> weight version of every shard that may take requests: phase ``Ready`` and, once
    a Refit succeeded, at the fleet's ``status.refit.currentVersion``; and while a refit runs
    (``status.refit.active``), each of its member shards that is ``Ready`` or ``Refitting``, with
    version ``None`` (unknown: its engine holds requests at the gate and serves them with the
    refit's version, or the old one if it had not suspended yet)."""
    refit = status.refit
    current = refit.current_version if refit is not None else None
    found = {
        shard.index: shard.weight_version
        for shard in status.shards
        if shard.phase == "Ready" and (current is None or shard.weight_version == current)
    }
    if refit is not None and refit.active is not None and refit.membership is not None:
        members = {offset.shard for offset in refit.membership.rank_offsets}
        for shard in status.shards:
            if shard.index in members and shard.phase in ("Ready", "Refitting"):
                found[shard.index] = None
    return found


def endpoint_urls(status: v1alpha1.MegatronGenerationStatus, addressing: Addressing) -> dict[int, str]:
    """Shard index -> base URL from the reserved endpoints (``service`` or ``dns`` addressing)."""
    if addressing == "pod":
        raise ValueError("pod addressing needs the pods' IPs: see pod_urls")
    return {
        endpoint.shard: endpoint.url if addressing == "service" else endpoint.dns_url for endpoint in status.endpoints
    }


def pod_urls(status: v1alpha1.MegatronGenerationStatus, pod_ips: Mapping[str, str], port: int) -> dict[int, str]:
    """Shard index -> base URL on pod 0 (the frontend rank's pod) for shards whose pod 0 has an IP."""
    urls = {}
    for shard in status.shards:
        ip = pod_ips.get(shard.pods[0]) if shard.pods else None
        if ip:
            host = f"[{ip}]" if ":" in ip else ip
            urls[shard.index] = f"http://{host}:{port}/v1"
    return urls


def select(urls: Mapping[int, str], versions: Mapping[int, int | None]) -> list[Frontend]:
    """The frontends of the shards in both ``urls`` and ``versions`` (see :func:`routable`), by shard."""
    return [Frontend(shard, urls[shard], versions[shard]) for shard in sorted(urls) if shard in versions]


class Router:
    """Least-outstanding-requests choice among frontends; not thread-safe (one event loop uses it).

    :meth:`place` says which shard each prompt of a batch should go to (:func:`.affinity.assign`
    over the sequences outstanding per shard, with :attr:`memory` of where recent prompts went).
    :meth:`acquire` picks a frontend (the ``prefer``red shard's when it is routable and not excluded)
    and counts the request and its sequences against it until :meth:`release`
    (:meth:`lease` does both around a ``with`` block).
    :meth:`update` replaces the frontends; requests in flight on a dropped frontend finish there.
    ``sent`` counts requests leased per URL since the router was made.
    """

    def __init__(self, frontends: Iterable[Frontend] = ()) -> None:
        self._frontends: list[Frontend] = []
        self._outstanding: dict[str, int] = {}
        self._sequences: dict[str, int] = {}
        self._turn = 0
        self.sent: dict[str, int] = {}
        self.memory = affinity.Memory()
        """Where recent prompts went: a later turn of a conversation follows its earlier turns."""
        self.update(frontends)

    @property
    def frontends(self) -> list[Frontend]:
        return list(self._frontends)

    def outstanding(self, url: str) -> int:
        return self._outstanding.get(url, 0)

    def update(self, frontends: Iterable[Frontend]) -> None:
        self._frontends = sorted(frontends, key=lambda frontend: frontend.shard)

    def load(self) -> dict[int, int]:
        """Sequences outstanding per shard (of the current frontends)."""
        return {frontend.shard: self._sequences.get(frontend.url, 0) for frontend in self._frontends}

    def place(self, prompts: Sequence[affinity.Key]) -> list[int | None]:
        """The shard each prompt should go to (:func:`.affinity.assign`); ``None`` for every prompt
        while no frontend is routable (:meth:`acquire` then raises)."""
        shards = [frontend.shard for frontend in self._frontends]
        if not shards:
            return [None] * len(prompts)
        return list(affinity.assign(prompts, shards, load=self.load(), memory=self.memory))

    def acquire(self, *, exclude: Iterable[str] = (), prefer: int | None = None, sequences: int = 1) -> Frontend:
        """The frontend of shard ``prefer`` when it is a candidate, else the one with the fewest
        outstanding requests (ties: the next in turn), counted as busy with one more request of
        ``sequences`` sequences until :meth:`release`.

        Raises:
            NoFrontend: no frontend is left once ``exclude`` (URLs already tried) is removed.
        """
        skipped = set(exclude)
        candidates = [frontend for frontend in self._frontends if frontend.url not in skipped]
        if not candidates:
            raise errors.NoFrontend(
                "no Ready frontend at the fleet's current weight version"
                + (f" besides {', '.join(sorted(skipped))}" if skipped else "")
            )
        preferred = [frontend for frontend in candidates if frontend.shard == prefer]
        if preferred:
            chosen = preferred[0]
        else:
            start = self._turn % len(candidates)
            rotated = candidates[start:] + candidates[:start]
            chosen = min(rotated, key=lambda frontend: self._outstanding.get(frontend.url, 0))
            self._turn += 1
        self._outstanding[chosen.url] = self._outstanding.get(chosen.url, 0) + 1
        self._sequences[chosen.url] = self._sequences.get(chosen.url, 0) + sequences
        self.sent[chosen.url] = self.sent.get(chosen.url, 0) + 1
        return chosen

    def release(self, frontend: Frontend, *, sequences: int = 1) -> None:
        """The request of ``sequences`` sequences :meth:`acquire` counted against ``frontend`` is over."""
        for counts, done in ((self._outstanding, 1), (self._sequences, sequences)):
            left = counts.get(frontend.url, 0) - done
            if left > 0:
                counts[frontend.url] = left
            else:
                counts.pop(frontend.url, None)

    @contextlib.contextmanager
    def lease(self, *, exclude: Iterable[str] = ()) -> Iterator[Frontend]:
        """:meth:`acquire` for the ``with`` block, then :meth:`release`."""
        frontend = self.acquire(exclude=exclude)
        try:
            yield frontend
        finally:
            self.release(frontend)
