"""Shared test helper (it holds no tests): :class:`MemoryTransport`, an in-memory
:class:`megafleet.kube.Transport`, and :class:`Api`, the real :class:`megafleet.kube.Api` over one.

For the fast tier only. The transport stores plain JSON objects by (kind, namespace, name) and
answers as the API server does where the operator and the SDK look: a missing object is a 404 and a
create of an existing one a 409 (:class:`megafleet.kube.ApiError`), ``generateName`` gets a suffix,
writes set ``uid``, ``generation`` and a per-object ``resourceVersion``, Services get a ClusterIP,
patches are JSON merge patches (a ``status`` patch merges into the status only) and a watch sends the
objects now, then every change. The counting, the 404/409 handling and the write observers are the
real :class:`~megafleet.kube.Api`'s.

It is no API server: no admission or validation, no defaulting beyond the above, no garbage
collection or finalizers, deletion is immediate, ``generation`` never moves, a patch of the object
may change its status too (the server ignores that for kinds with a status subresource), selectors
are label equality and field equality or ``notin`` only, and pods run only when the test says so
(:meth:`MemoryTransport.run_pods`). Every e2e test still runs against the real control plane.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncGenerator
from typing import Any

from lightkube import operators

from megafleet import kube
from megafleet.objects import Object

Key = tuple[str, str | None, str]
"""(kind, namespace, name); namespace None for a cluster-scoped kind."""


class MemoryTransport:
    """The objects of an API server in memory (see the module docstring)."""

    def __init__(self, *objects: Object) -> None:
        self.objects: dict[Key, Object] = {}
        self.deleted: list[tuple[Key, int | None]] = []
        """Every delete asked for, of an object there or not, with its grace seconds (None: the pod's own)."""
        self._addresses = itertools.count(10)
        self._suffixes = itertools.count(1)
        self._watchers: list[asyncio.Queue[tuple[str, Object]]] = []
        for obj in objects:
            self._store(copy.deepcopy(obj))

    def _store(self, obj: Object) -> Object:
        metadata = obj["metadata"]
        metadata.setdefault("uid", f"uid-{len(self.objects)}")
        metadata.setdefault("generation", 1)
        metadata.setdefault("resourceVersion", "1")
        if obj["kind"] == "Service" and obj["spec"].get("clusterIP") is None:
            obj["spec"]["clusterIP"] = f"10.96.0.{next(self._addresses)}"
        self.objects[(obj["kind"], metadata.get("namespace"), metadata["name"])] = obj
        return obj

    def _found(self, kind: str, name: str, namespace: str | None) -> Object:
        found = self.objects.get((kind, namespace, name))
        if found is None:
            raise kube.ApiError(404, "NotFound", f'{kind} "{name}" not found')
        return found

    def _changed(self, event: str, obj: Object) -> None:
        for queue in self._watchers:
            queue.put_nowait((event, copy.deepcopy(obj)))

    async def close(self) -> None:
        pass

    async def get(self, kind: str, name: str, namespace: str | None) -> Object:
        return copy.deepcopy(self._found(kind, name, namespace))

    async def list(
        self,
        kind: str,
        namespace: str | None,
        *,
        labels: kube.Selector | None = None,
        fields: kube.Selector | None = None,
    ) -> list[Object]:
        return [
            copy.deepcopy(obj)
            for (found_kind, found_namespace, _), obj in sorted(self.objects.items())
            if found_kind == kind and namespace in (None, found_namespace) and _chosen(obj, labels, fields)
        ]

    async def create(self, obj: Object) -> Object:
        created = copy.deepcopy(obj)
        metadata = created["metadata"]
        if "name" not in metadata:
            metadata["name"] = f"{metadata['generateName']}{next(self._suffixes):05d}"
        if (obj["kind"], metadata.get("namespace"), metadata["name"]) in self.objects:
            raise kube.ApiError(409, "AlreadyExists", f'{obj["kind"]} "{metadata["name"]}" already exists')
        self._changed("ADDED", self._store(created))
        return copy.deepcopy(created)

    async def delete(self, kind: str, name: str, namespace: str | None, grace_seconds: int | None) -> None:
        self.deleted.append(((kind, namespace, name), grace_seconds))
        gone = self._found(kind, name, namespace)
        del self.objects[(kind, namespace, name)]
        self._changed("DELETED", gone)

    async def patch(
        self, kind: str, name: str, namespace: str | None, patch: Object, *, subresource: str | None = None
    ) -> Object:
        obj = self._found(kind, name, namespace)
        if subresource == "status":
            obj["status"] = obj.get("status") or {}
            merge_patch(obj["status"], copy.deepcopy(patch.get("status") or {}))
        else:
            merge_patch(obj, copy.deepcopy(patch))
        metadata = obj["metadata"]
        metadata["resourceVersion"] = str(int(metadata.get("resourceVersion") or "0") + 1)
        self._changed("MODIFIED", obj)
        return copy.deepcopy(obj)

    async def watch(
        self,
        kind: str,
        namespace: str | None,
        *,
        labels: kube.Selector | None = None,
        fields: kube.Selector | None = None,
    ) -> AsyncGenerator[kube.Event, None]:
        changes: asyncio.Queue[tuple[str, Object]] = asyncio.Queue()
        self._watchers.append(changes)
        try:
            for obj in await self.list(kind, namespace, labels=labels, fields=fields):
                yield "ADDED", obj
            while True:
                event, obj = await changes.get()
                found_namespace = obj["metadata"].get("namespace")
                if obj["kind"] == kind and namespace in (None, found_namespace) and _chosen(obj, labels, fields):
                    yield event, obj
        finally:
            self._watchers.remove(changes)

    def run_pods(self, node: str) -> None:
        """What a scheduler and kubelet would do: bind every pod to ``node`` and run it with an IP."""
        for (kind, _, _), obj in self.objects.items():
            if kind == "Pod" and not obj.get("status", {}).get("podIP"):
                obj["spec"]["nodeName"] = node
                obj["status"] = {"phase": "Running", "podIP": f"127.0.0.{next(self._addresses)}"}


class Api(kube.Api):
    """The real :class:`megafleet.kube.Api` over a :class:`MemoryTransport` holding ``objects``."""

    def __init__(self, *objects: Object) -> None:
        self.memory = MemoryTransport(*objects)
        super().__init__(self.memory)

    @property
    def objects(self) -> dict[Key, Object]:
        """The stored objects themselves (a test may change them as a controller would)."""
        return self.memory.objects

    def run_pods(self, node: str) -> None:
        self.memory.run_pods(node)


def merge_patch(target: Object, patch: Object) -> None:
    """Apply a JSON merge patch (RFC 7386, what :meth:`megafleet.kube.Api.patch` sends) in place:
    objects merge key by key, ``None`` removes a key, anything else (lists too) replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = value


class Indexes(dict[str, Any]):
    """Kopf indexes as :class:`megafleet.reconcile.cache.Cache` reads them, filled from an :class:`Api`'s
    objects only when :meth:`sync` is called (a watch that delivered nothing since then)."""

    def __init__(self, api: Api) -> None:
        super().__init__()
        self.api = api
        self.sync()

    def sync(self) -> None:
        from megafleet.reconcile import cache

        fleet_pods: dict[Any, list[Object]] = {}
        fleet_services: dict[Any, list[Object]] = {}
        live: list[Object] = []
        nodes: dict[Any, list[Object]] = {}
        fleets: dict[Any, list[Object]] = {}
        for (kind, _, _), obj in sorted(self.api.objects.items()):
            snapshot = copy.deepcopy(obj)
            key = cache.fleet_key(snapshot)
            if kind == cache.FLEET_KIND:
                fleets[(snapshot["metadata"].get("namespace"), snapshot["metadata"]["name"])] = [snapshot]
            elif kind == "Pod":
                if key is not None:
                    fleet_pods.setdefault(key, []).append(snapshot)
                slim = cache.slim_pod(snapshot)
                if slim is not None:
                    live.append(slim)
            elif kind == "Service" and key is not None:
                fleet_services.setdefault(key, []).append(snapshot)
            elif kind == "Node":
                nodes[snapshot["metadata"]["name"]] = [cache.slim_node(snapshot)]
        found = {
            cache.FLEETS: fleets,
            cache.FLEET_PODS: fleet_pods,
            cache.FLEET_SERVICES: fleet_services,
            cache.LIVE_PODS: {None: live} if live else {},
            cache.NODES: nodes,
        }
        for name, values in found.items():  # in place: a cache keeps the inner mappings, as Kopf's
            index = self.setdefault(name, {})
            index.clear()
            index.update(values)


def _chosen(obj: Object, labels: kube.Selector | None, fields: kube.Selector | None) -> bool:
    found = obj["metadata"].get("labels") or {}
    for key, value in (labels or {}).items():
        if not isinstance(value, str):
            raise NotImplementedError(f"label selector {key}={value!r}")
        if found.get(key) != value:
            return False
    return all(_field_matches(obj, path, selector) for path, selector in (fields or {}).items())


def _field_matches(obj: Object, path: str, selector: Any) -> bool:
    value: Any = obj
    for part in path.split("."):
        value = (value or {}).get(part)
    if isinstance(selector, str):
        return bool(value == selector)
    if isinstance(selector, operators.SequenceOperator) and selector.op == "notin":
        return value not in selector.value
    raise NotImplementedError(f"field selector {path}={selector!r}")
