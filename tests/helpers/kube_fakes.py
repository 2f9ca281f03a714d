"""Shared test helper (it holds no tests): an in-memory stand-in for :class:`megafleet.kube.Api`.

For the fast tier only: it stores plain JSON objects by (kind, namespace, name) and counts writes
as the real one does (``writes``, keyed ``"<verb> <kind>"``), so a unit test can drive reconcile
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

Object = dict[str, Any]


class Api:
    """Async access to an in-memory store, with a per-verb count of writes."""

    def __init__(self, *objects: Object) -> None:
        self.objects: dict[tuple[str, str | None, str], Object] = {}
        self.writes: collections.Counter[str] = collections.Counter()
        self._addresses = itertools.count(10)
        for obj in objects:
            self._store(copy.deepcopy(obj))

    def _store(self, obj: Object) -> Object:
        metadata = obj["metadata"]
        metadata.setdefault("uid", f"uid-{len(self.objects)}")
        metadata.setdefault("generation", 1)
        if obj["kind"] == "Service" and obj["spec"].get("clusterIP") is None:
            obj["spec"]["clusterIP"] = f"10.96.0.{next(self._addresses)}"
        self.objects[(obj["kind"], metadata.get("namespace"), metadata["name"])] = obj
        return obj

    async def close(self) -> None:
        pass

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Object | None:
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
        return existing if existing is not None else copy.deepcopy(self._store(copy.deepcopy(obj)))

    async def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        self.writes[f"delete {kind}"] += 1
        self.objects.pop((kind, namespace, name), None)

    async def patch(self, kind: str, name: str, namespace: str | None, patch: Object) -> Object:
        self.writes[f"patch {kind}"] += 1
        obj = self.objects[(kind, namespace, name)]
        obj.update(copy.deepcopy(patch))
        return copy.deepcopy(obj)

    async def patch_status(self, kind: str, name: str, namespace: str, status: Object) -> None:
        self.writes[f"status {kind}"] += 1
        obj = self.objects[(kind, namespace, name)]
        obj["status"] = {**obj.get("status", {}), **copy.deepcopy(status)}

    def run_pods(self, node: str) -> None:
        """What a scheduler and kubelet would do: bind every pod to ``node`` and run it with an IP."""
        for (kind, _, _), obj in self.objects.items():
            if kind == "Pod" and not obj.get("status", {}).get("podIP"):
                obj["spec"]["nodeName"] = node
                obj["status"] = {"phase": "Running", "podIP": f"127.0.0.{next(self._addresses)}"}


def _field_matches(obj: Object, path: str, selector: Any) -> bool:
    value: Any = obj
    for part in path.split("."):
        value = (value or {}).get(part)
    if isinstance(selector, operators.SequenceOperator) and selector.op == "notin":
        return value not in selector.value
    raise NotImplementedError(f"field selector {path}={selector!r}")
