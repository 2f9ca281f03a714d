"""Kopf's watch streams decoded by msgspec (:mod:`megafleet.kopf_json`): Kopf's own watch code, run
against a loopback HTTP server that streams watch events, yields exactly what the standard library
would have decoded, and the decoding goes through msgspec once the module is installed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import watching
from kopf._cogs.configs import configuration
from kopf._cogs.structs import references

from helpers.kopf_api import kopf_context
from megafleet import kopf_json

PODS = references.Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
EVENTS: list[dict[str, Any]] = [
    {
        "type": "ADDED",
        "object": {
            "metadata": {"name": "p-0", "namespace": "t", "resourceVersion": "8", "labels": {"a": "ü"}},
            "spec": {"containers": [{"name": "c", "env": [{"name": "X", "value": "$$(Y)"}]}], "priority": 0},
            "status": {"phase": "Pending", "ratio": 0.5, "ready": False, "nothing": None},
        },
    },
    {"type": "MODIFIED", "object": {"metadata": {"name": "p-0", "namespace": "t", "resourceVersion": "9"}}},
]


class StreamingApi:
    """A loopback API server that answers one watch request with :data:`EVENTS`, one per line."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"".join(json.dumps(event).encode() + b"\n" for event in EVENTS)
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        self.server.close()


def watched() -> list[Any]:
    """What Kopf's watch of pods in namespace ``t`` yields from the loopback server's stream."""

    async def case() -> list[Any]:
        settings = configuration.OperatorSettings()
        async with StreamingApi() as server, kopf_context(server):
            never = asyncio.get_running_loop().create_future()
            stream = watching.watch_objs(
                settings=settings,
                resource=PODS,
                namespace=references.NamespaceName("t"),
                since="7",
                operator_pause_waiter=never,
            )
            return [event async for event in stream]

    return asyncio.run(asyncio.wait_for(case(), timeout=30))


class CountingDecoder:
    def __init__(self) -> None:
        self.lines = 0

    def decode(self, text: str | bytes) -> object:
        self.lines += 1
        return json.loads(text)


def test_kopfs_watch_yields_what_the_standard_library_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf_api, "json", json)
    assert kopf_json.install()
    assert watched() == EVENTS


def test_kopfs_watch_decodes_through_msgspec_once_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf_api, "json", json)
    counting = CountingDecoder()
    monkeypatch.setattr(kopf_json, "_DECODER", counting)
    assert kopf_json.install() and kopf_json.install()  # once: the second call changes nothing
    watched()
    assert counting.lines == len(EVENTS)


def test_loads_builds_plain_mutable_objects() -> None:
    line = json.dumps(EVENTS[0])
    decoded = kopf_json.loads(line)
    assert decoded == EVENTS[0] and type(decoded) is dict
    decoded["type"] = None  # Kopf rewrites the type of listed objects in place
    assert kopf_json.loads(line.encode()) == EVENTS[0]


def test_install_leaves_a_kopf_that_does_not_decode_through_json_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    other = object()
    monkeypatch.setattr(kopf_api, "json", other)
    assert not kopf_json.install()
    assert vars(kopf_api)["json"] is other
