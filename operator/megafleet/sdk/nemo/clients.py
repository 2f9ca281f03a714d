"""The adapter's connection, and what pickling keeps of it.

A :class:`Handle` is the adapter's whole configuration: what ``pickle`` keeps when NeMo RL hands the
adapter to its async trajectory collector (a Ray actor), from which the copy reconnects on first use.
:class:`Clients` is what :func:`make_clients` makes on first use: an event loop on a daemon thread
(:class:`Loop`; the adapter's synchronous methods run coroutines there, and ``generate_async`` works
from many event loops and threads at once), the fleet client and the generator. The trainer's
weights never travel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from megafleet import kube
from megafleet.sdk import fleet, generation, routing
from megafleet.sdk.nemo import async_flags
from megafleet_protocol import vocabulary

__all__ = ["Clients", "Handle", "Loop", "RefitWire", "make_clients"]

T = TypeVar("T")
RefitWire = Literal["megafleet", "nemo"]
"""How refits travel: ``nemo`` (NeMo RL's own trainer broadcast over a RefitSession) or
``megafleet`` (this process's ``WeightSender``); :mod:`megafleet.sdk.nemo.refit_wires`."""


@dataclasses.dataclass(frozen=True)
class Handle:
    """Everything a :class:`~megafleet.sdk.nemo.MegafleetGeneration` needs to reconnect: what pickling keeps."""

    fleet_name: str
    namespace: str | None
    config: dict[str, Any]
    kubeconfig: str | None
    addressing: routing.Addressing
    api_key: str | None
    backend: vocabulary.CollectiveBackend
    frontends: tuple[str, ...] | None
    model: str | None
    ready_timeout_s: float
    kv_cache_mode: vocabulary.KvCacheMode | None
    max_sequence_length: int | None
    refit_wire: RefitWire = "megafleet"
    trainer_bucket_bytes: int | None = None
    trainer_gpu_memory_bytes: int | None = None
    join_timeout_s: int = 240
    async_flags: async_flags.AsyncFlags | None = None
    """NeMo RL's async flags as the factory read them from its ``master_config`` (None: not given)."""


class Loop:
    """An event loop on a daemon thread; the adapter's synchronous methods run coroutines there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="megafleet-sdk", daemon=True)
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.submit(work).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@dataclasses.dataclass
class Clients:
    """What the adapter makes on first use."""

    loop: Loop
    fleet: fleet.Fleet | None
    generator: generation.Generator
    api: kube.Api | None
    """The API server for RefitSessions, ConfigMaps and Refits: the fleet client's; None with fixed frontends."""

    async def aclose(self) -> None:
        """Close the HTTP and API server clients (on :attr:`loop`)."""
        if self.fleet is not None:
            await self.fleet.aclose()  # its generator and API server client
        else:
            await self.generator.aclose()


async def make_clients(handle: Handle) -> tuple[fleet.Fleet | None, generation.Generator, kube.Api | None]:
    """The fleet client (or a generator over fixed frontends) and the API server's client, the
    fleet client's own :attr:`~megafleet.sdk.fleet.Fleet.api`, made on the adapter's loop (its HTTP
    clients belong to that loop)."""
    if handle.frontends is not None:
        fixed = [routing.Frontend(index, url, None) for index, url in enumerate(handle.frontends)]
        generator = generation.Generator(
            routing.Router(fixed),
            model=handle.model or handle.fleet_name,
            api_key=handle.api_key,
            max_sequence_length=handle.max_sequence_length,
        )
        return None, generator, None
    found = fleet.Fleet(
        handle.fleet_name,
        handle.namespace,
        kubeconfig=handle.kubeconfig,
        addressing=handle.addressing,
        api_key=handle.api_key,
    )
    return found, found.generator, found.api
