"""The one Kubernetes client of the operator and the SDK: :class:`Api`, over a :class:`Transport`.

Called by :mod:`megafleet.reconcile`, :mod:`megafleet.fleet_state` and the Refit controllers
(:mod:`megafleet.refits`), and by the SDK (:mod:`megafleet.sdk.fleet`, :mod:`megafleet.sdk.nemo`).
Objects go in and come out as plain JSON dicts (the shapes the pure builders in
:mod:`megafleet.desired` produce). The operator's requests go over
:mod:`megafleet.kube_rest` (aiohttp, with the login lightkube reads from the environment); a
lightkube client given to :class:`Api` (the SDK's), or a login only lightkube handles (an exec
plugin), goes through lightkube instead; tests give it an in-memory transport
(``tests/helpers/kube_fakes.py``). Every write and read is counted, so tests and the control-plane
benchmark can check that an idle reconcile writes nothing and a cached one LISTs nothing; write
observers (:class:`megafleet.reconcile.cache.Cache`) learn of every create and delete.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, Protocol

import lightkube
from lightkube import codecs
from lightkube.core import exceptions as lightkube_errors
from lightkube.resources.core_v1 import Node
from lightkube.types import PatchType

from megafleet import kube_rest, metrics, names
from megafleet.objects import Object

ApiError = kube_rest.ApiError
Selector = kube_rest.Selector
USER_AGENT = "megafleet-operator"

KINDS = kube_rest.KINDS

Event = tuple[str, Object]
"""One event of a watch: its type (``ADDED``, ``MODIFIED``, ``DELETED``) and the object as it is then."""

WriteObserver = Callable[[str, str, str | None, str, Object | None], None]
"""Told of every successful write: (verb, kind, namespace, name, the object as the API server
returned it, None for a delete). Verbs: ``create``, ``delete``, ``patch``, ``status``."""


class Transport(Protocol):
    """The requests :class:`Api` sends, to one API server or a stand-in for it.

    Three implement it: :class:`megafleet.kube_rest.RestTransport` (the operator's), the lightkube
    one here (a lightkube client: the SDK's, or a login only lightkube handles) and the tests'
    in-memory one (``tests/helpers/kube_fakes.py``). ``kind`` is a key of :data:`KINDS`. An error
    status is raised as :class:`ApiError` with the API server's code: 404 for a missing object, 409
    for a create whose object exists.
    """

    async def close(self) -> None:
        """Release the connections."""

    async def get(self, kind: str, name: str, namespace: str | None) -> Object:
        """The object."""

    async def list(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> list[Object]:
        """Every object of ``kind`` in ``namespace`` (None: every namespace) that the selectors choose."""

    async def create(self, obj: Object) -> Object:
        """Create ``obj`` (``metadata.name``, or ``metadata.generateName``); the object as created."""

    async def delete(self, kind: str, name: str, namespace: str | None, grace_seconds: int | None) -> None:
        """Delete the object (``grace_seconds``: the pod's grace period; None: its own)."""

    async def patch(
        self, kind: str, name: str, namespace: str | None, patch: Object, *, subresource: str | None = None
    ) -> Object:
        """A JSON merge patch (lists are replaced whole) of the object or its ``subresource``."""

    def watch(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> AsyncGenerator[Event, None]:
        """The objects the selectors choose as they are now (``ADDED``), then every change, without end:
        a stream the server ends is started again from the last object's resource version."""


class _Lightkube:
    """The transport through a lightkube client (the SDK's, or a login only lightkube handles):
    the same operations as :class:`megafleet.kube_rest.RestTransport`, its errors as :class:`ApiError`."""

    def __init__(self, client: lightkube.AsyncClient) -> None:
        self._client = client

    async def close(self) -> None:
        await self._client.close()

    async def get(self, kind: str, name: str, namespace: str | None) -> Object:
        with _translated():
            return _plain(await self._client.get(KINDS[kind], name, namespace=namespace))

    async def list(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> list[Object]:
        resource = KINDS[kind]
        with _translated():
            if resource is Node:
                listing = self._client.list(Node, labels=labels, fields=fields)
            else:
                scope = namespace if namespace is not None else lightkube.ALL_NS
                listing = self._client.list(resource, namespace=scope, labels=labels, fields=fields)
            return [_plain(item) async for item in listing]

    async def create(self, obj: Object) -> Object:
        with _translated():
            return _plain(await self._client.create(codecs.from_dict(obj)))

    async def delete(self, kind: str, name: str, namespace: str | None, grace_seconds: int | None) -> None:
        with _translated():
            await self._client.delete(KINDS[kind], name, namespace=namespace, grace_period=grace_seconds)

    async def patch(
        self, kind: str, name: str, namespace: str | None, patch: Object, *, subresource: str | None = None
    ) -> Object:
        resource = KINDS[kind].Status if subresource == "status" else KINDS[kind]
        with _translated():
            patched = await self._client.patch(resource, name, patch, namespace=namespace, patch_type=PatchType.MERGE)
        return _plain(patched)

    async def watch(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> AsyncGenerator[Event, None]:
        resource = KINDS[kind]
        if resource is Node:
            stream = self._client.watch(Node, labels=labels, fields=fields)
        else:
            scope = namespace if namespace is not None else lightkube.ALL_NS
            stream = self._client.watch(resource, namespace=scope, labels=labels, fields=fields)
        try:
            with _translated():
                async for event, obj in stream:
                    yield event, _plain(obj)
        finally:
            close = getattr(stream, "aclose", None)  # an async generator, typed as an iterable
            if close is not None:
                await close()


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except lightkube_errors.ApiError as error:
        status = error.status
        raise ApiError(int(status.code or 0), status.reason or "", status.message or "") from error


class Api:
    """Async access to the API server, with a per-verb count of writes and reads."""

    def __init__(self, client: lightkube.AsyncClient | Transport | None = None, *, concurrency: int = 32) -> None:
        """``client``: a lightkube client or a :class:`Transport` to go through (else the operator's
        own transport, with the environment's login). ``concurrency``: requests in flight at once;
        more wait here, not in the HTTP client's connection pool (whose wait times out: reconciles
        create a fleet's objects together)."""
        if client is None:
            client = kube_rest.from_environment(
                field_manager=names.FIELD_MANAGER, user_agent=USER_AGENT, connections=concurrency
            )
        if client is None:  # a login only lightkube handles
            client = lightkube.AsyncClient(field_manager=names.FIELD_MANAGER)
        self._transport: Transport = _Lightkube(client) if isinstance(client, lightkube.AsyncClient) else client
        self._slots = asyncio.Semaphore(concurrency)
        self.writes: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.observers: list[WriteObserver] = []

    def _count(self, verb: str, kind: str) -> None:
        self.writes[f"{verb} {kind}"] += 1
        metrics.API_WRITES.labels(verb=verb, kind=kind).inc()

    def _count_read(self, verb: str, kind: str) -> None:
        self.reads[f"{verb} {kind}"] += 1
        metrics.API_READS.labels(verb=verb, kind=kind).inc()

    def _tell(self, verb: str, kind: str, namespace: str | None, name: str, obj: Object | None) -> None:
        for observer in self.observers:
            observer(verb, kind, namespace, name, obj)

    async def close(self) -> None:
        await self._transport.close()

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Object | None:
        self._count_read("get", kind)
        try:
            async with self._slots:
                return await self._transport.get(kind, name, namespace)
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    async def list(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        labels: Selector | None = None,
        fields: Selector | None = None,
    ) -> list[Object]:
        """Every object of ``kind`` in ``namespace`` (None: every namespace), filtered by the
        ``labels`` and ``fields`` selectors (lightkube's notation: a value, or an operator of
        ``lightkube.operators``)."""
        self._count_read("list", kind)
        async with self._slots:
            return await self._transport.list(kind, namespace, labels=labels, fields=fields)

    async def create(self, obj: Object) -> Object:
        """Create ``obj``; an object that already exists is returned as it is (idempotent). An object
        named by ``metadata.generateName`` gets its name from the API server."""
        kind, metadata = obj["kind"], obj["metadata"]
        self._count("create", kind)
        try:
            async with self._slots:
                created = await self._transport.create(obj)
        except ApiError as error:
            if error.code == 409 and "name" in metadata:
                existing = await self.get(kind, metadata["name"], metadata.get("namespace"))
                if existing is not None:
                    self._tell("create", kind, metadata.get("namespace"), metadata["name"], existing)
                    return existing
            raise
        self._tell("create", kind, metadata.get("namespace"), created["metadata"]["name"], created)
        return created

    async def watch(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        labels: Selector | None = None,
        fields: Selector | None = None,
    ) -> AsyncGenerator[Event, None]:
        """The objects of ``kind`` that the selectors choose, as they are now (``ADDED`` events), then
        every change, until the caller stops iterating (and closes it). A watch holds none of the
        ``concurrency`` slots: it lasts."""
        self._count_read("watch", kind)
        async with contextlib.aclosing(self._transport.watch(kind, namespace, labels=labels, fields=fields)) as events:
            async for event in events:
                yield event

    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, grace_seconds: int | None = None
    ) -> None:
        """Delete the object (a missing one is not an error); ``grace_seconds=0`` removes a pod at
        once, without waiting for its kubelet to confirm (a lost node's pods)."""
        self._count("delete", kind)
        try:
            async with self._slots:
                await self._transport.delete(kind, name, namespace, grace_seconds)
        except ApiError as error:
            if error.code != 404:
                raise
        self._tell("delete", kind, namespace, name, None)

    async def patch(self, kind: str, name: str, namespace: str | None, patch: Object) -> Object:
        """Merge-patch the object (lists are replaced whole); the object as patched."""
        self._count("patch", kind)
        async with self._slots:
            patched = await self._transport.patch(kind, name, namespace, patch)
        self._tell("patch", kind, namespace, name, patched)
        return patched

    async def patch_status(self, kind: str, name: str, namespace: str, status: Object) -> Object:
        """Merge-patch the status subresource (lists such as conditions are replaced whole); the
        object as patched."""
        self._count("status", kind)
        async with self._slots:
            patched = await self._transport.patch(kind, name, namespace, {"status": status}, subresource="status")
        self._tell("status", kind, namespace, name, patched)
        return patched


def _plain(obj: Any) -> Object:
    if isinstance(obj, dict):
        return obj
    result: Object = obj.to_dict()
    return result
