"""Shared test helper (it holds no tests): an in-memory stand-in for :class:`megafleet.kube.Api`.

For the fast tier only: it stores plain JSON objects by (kind, namespace, name) and counts writes
and reads as the real one does (``writes``, ``reads``, keyed ``"<verb> <kind>"``) and tells its
``observers`` of creates, deletes and patches, so a unit test can drive reconcile
steps and check what they wrote. It is no API server: no admission, no garbage collection,
deletion is immediate, and pods run only when the test says so (:meth:`Api.run_pods`). Every e2e
test still runs against the real control plane.
"""

from __future__ import annotations

import collections
import copy
import itertools
from typing import Any

from lightkube import operators

from megafleet.objects import Object


class Api:
    """Async access to an in-memory store, with a per-verb count of writes."""

    def __init__(self, *objects: Object) -> None:
        self.objects: dict[tuple[str, str | None, str], Object] = {}
        self.writes: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.observers: list[Any] = []
        self._addresses = itertools.count(10)
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

    async def close(self) -> None:
        pass

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Object | None:
        self.reads[f"get {kind}"] += 1
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def list(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        labels: dict[str, Any] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> list[Object]:
        self.reads[f"list {kind}"] += 1
        return [
            copy.deepcopy(obj)
            for (found_kind, found_namespace, _), obj in sorted(self.objects.items())
            if found_kind == kind
            and namespace in (None, found_namespace)
            and all(obj["metadata"].get("labels", {}).get(key) == value for key, value in (labels or {}).items())
            and all(_field_matches(obj, path, selector) for path, selector in (fields or {}).items())
        ]

    async def create(self, obj: Object) -> Object:
        self.writes[f"create {obj['kind']}"] += 1
        existing = await self.get(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
        created = existing if existing is not None else copy.deepcopy(self._store(copy.deepcopy(obj)))
        for observer in self.observers:
            observer("create", obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"], created)
        return created

    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, grace_seconds: int | None = None
    ) -> None:
        self.writes[f"delete {kind}" if grace_seconds is None else f"delete {kind} grace={grace_seconds}"] += 1
        self.objects.pop((kind, namespace, name), None)
        for observer in self.observers:
            observer("delete", kind, namespace, name, None)

    async def patch(self, kind: str, name: str, namespace: str | None, patch: Object) -> Object:
        self.writes[f"patch {kind}"] += 1
        obj = self.objects[(kind, namespace, name)]
        merge_patch(obj, copy.deepcopy(patch))
        return self._patched("patch", obj)

    async def patch_status(self, kind: str, name: str, namespace: str, status: Object) -> Object:
        self.writes[f"status {kind}"] += 1
        obj = self.objects[(kind, namespace, name)]
        obj["status"] = {**obj.get("status", {}), **copy.deepcopy(status)}
        return self._patched("status", obj)

    def _patched(self, verb: str, obj: Object) -> Object:
        """A patch's answer: the object with a new resource version, told to the observers."""
        metadata = obj["metadata"]
        metadata["resourceVersion"] = str(int(metadata.get("resourceVersion") or "0") + 1)
        for observer in self.observers:
            observer(verb, obj["kind"], metadata.get("namespace"), metadata["name"], copy.deepcopy(obj))
        return copy.deepcopy(obj)

    def run_pods(self, node: str) -> None:
        """What a scheduler and kubelet would do: bind every pod to ``node`` and run it with an IP."""
        for (kind, _, _), obj in self.objects.items():
            if kind == "Pod" and not obj.get("status", {}).get("podIP"):
                obj["spec"]["nodeName"] = node
                obj["status"] = {"phase": "Running", "podIP": f"127.0.0.{next(self._addresses)}"}


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


def _field_matches(obj: Object, path: str, selector: Any) -> bool:
    value: Any = obj
    for part in path.split("."):
        value = (value or {}).get(part)
    if isinstance(selector, operators.SequenceOperator) and selector.op == "notin":
        return value not in selector.value
    raise NotImplementedError(f"field selector {path}={selector!r}")
