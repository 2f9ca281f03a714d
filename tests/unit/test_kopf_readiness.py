"""Kopf's index readiness (:mod:`megafleet.kopf_readiness`): a watcher of an indexed resource that is
cancelled before its first LIST finished, or while an object of that LIST is still being indexed,
must not keep the operator from ever running a handler.

Kopf's own watcher runs here against a loopback HTTP server that plays a stalling API server (it
answers what the case needs, then never answers again), so the cancellation lands exactly where a
namespace deletion lands in a real cluster. Without the fix, the readiness set stays off forever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.configs import configuration
from kopf._cogs.structs import references
from kopf._core.reactor import queueing

from helpers.kopf_api import kopf_context
from megafleet import kopf_readiness

PODS = references.Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
POD_LIST = {
    "apiVersion": "v1",
    "kind": "PodList",
    "metadata": {"resourceVersion": "7"},
    "items": [{"metadata": {"name": "p", "namespace": "t-gone", "uid": "u-1", "resourceVersion": "7"}}],
}


class StallingApi:
    """A loopback API server: answers the first LIST with ``listing`` (or never, when None) and then
    stalls every request; ``stalled`` is set once a request is left hanging."""

    def __init__(self, listing: dict[str, Any] | None) -> None:
        self.listing = listing
        self.stalled = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = (await reader.readuntil(b"\r\n\r\n")).decode()
        watch = "watch=true" in request.split("\r\n", 1)[0]
        if self.listing is not None and not watch:
            body = json.dumps(self.listing).encode()
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            await self.serve(reader, writer)  # the client may reuse the connection for the watch
            return
        self.stalled.set()
        await reader.read()  # until the client goes away
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()


def cancelled_watch(listing: dict[str, Any] | None, watcher: Callable[..., Any]) -> aiotoggles.ToggleSet:
    """Run ``watcher`` on an indexed resource of one namespace and cancel it, as Kopf does when that
    namespace is deleted: with no listing, once its first LIST hangs; with one, once the listed
    object is being indexed (and never finishes). Returns the operator-wide readiness set."""

    async def case() -> aiotoggles.ToggleSet:
        settings = configuration.OperatorSettings()
        settings.queueing.exit_timeout = 0.1  # how long a cancelled watcher waits for its workers
        indexing = asyncio.Event()

        async def index_forever(**_: Any) -> None:
            indexing.set()
            await asyncio.Event().wait()

        api = StallingApi(listing)
        async with api as server, kopf_context(server):
            readiness = aiotoggles.ToggleSet(all)
            own = await readiness.make_toggle(name="pods@t-gone")
            task = asyncio.create_task(
                watcher(
                    namespace="t-gone",
                    settings=settings,
                    resource=PODS,
                    processor=index_forever,
                    operator_indexed=readiness,
                    resource_indexed=own,
                )
            )
            await (api.stalled if listing is None else indexing).wait()
            assert readiness.is_off()  # the operator is held while the watcher is listing or indexing
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return readiness

    return asyncio.run(asyncio.wait_for(case(), timeout=30))


def test_a_watcher_cancelled_inside_its_first_list_leaves_the_operator_ready() -> None:
    fixed = kopf_readiness.release_on_exit(queueing.watcher)
    readiness = cancelled_watch(None, fixed)
    assert readiness.is_on() and len(readiness) == 0


def test_a_watcher_cancelled_while_a_listed_object_is_indexed_leaves_the_operator_ready() -> None:
    fixed = kopf_readiness.release_on_exit(queueing.watcher)
    readiness = cancelled_watch(POD_LIST, fixed)
    assert readiness.is_on() and len(readiness) == 0


def test_install_wraps_kopfs_watcher_once(monkeypatch: pytest.MonkeyPatch) -> None:
    original = queueing.watcher
    monkeypatch.setattr(queueing, "watcher", original)
    assert kopf_readiness.install() and kopf_readiness.install()
    assert queueing.watcher is not original
    assert queueing.watcher.__wrapped__ is original  # type: ignore[attr-defined]
