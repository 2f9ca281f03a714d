"""The only module of the operator that calls the Kubernetes API.

Called by :mod:`megafleet.reconcile`. Objects go in and come out as plain JSON dicts (the shapes the
pure builders in :mod:`megafleet.desired` produce); lightkube does the transport, the kubeconfig or
in-cluster login, and the typing at the boundary. Every write and read is counted, so tests and the
control-plane benchmark can check that an idle reconcile writes nothing and a cached one LISTs nothing;
write observers (:class:`megafleet.reconcile.cache.Cache`) learn of every create and delete.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import lightkube
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import ConfigMap, Node, Pod, Secret, Service, ServiceAccount
from lightkube.resources.scheduling_v1 import PriorityClass
from lightkube.types import PatchType

from megafleet import metrics, names
from megafleet.api import v1alpha1

Object = dict[str, Any]

MegatronGeneration = create_namespaced_resource(
    v1alpha1.GROUP, v1alpha1.VERSION, "MegatronGeneration", "megatrongenerations"
)
Refit = create_namespaced_resource(v1alpha1.GROUP, v1alpha1.VERSION, "Refit", "refits")
RefitSession = create_namespaced_resource(v1alpha1.GROUP, v1alpha1.VERSION, "RefitSession", "refitsessions")

KINDS: dict[str, Any] = {
    "Pod": Pod,
    "Service": Service,
    "ConfigMap": ConfigMap,
    "Secret": Secret,
    "ServiceAccount": ServiceAccount,
    "PriorityClass": PriorityClass,
    "Node": Node,
    "MegatronGeneration": MegatronGeneration,
    "Refit": Refit,
    "RefitSession": RefitSession,
}

WriteObserver = Callable[[str, str, str | None, str, Object | None], None]
"""Told of every successful create or delete: (verb, kind, namespace, name, the created object or None)."""


class Api:
    """Async access to the API server, with a per-verb count of writes and reads."""

    def __init__(self, client: lightkube.AsyncClient | None = None, *, concurrency: int = 32) -> None:
        """``concurrency``: requests in flight at once; more wait here, not in the HTTP client's
        connection pool (whose wait times out: reconciles create a fleet's objects together)."""
        self._client = client or lightkube.AsyncClient(field_manager=names.FIELD_MANAGER)
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
        await self._client.close()

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Object | None:
        self._count_read("get", kind)
        try:
            async with self._slots:
                found = await self._client.get(KINDS[kind], name, namespace=namespace)
        except ApiError as error:
            if error.status.code == 404:
                return None
            raise
        return _plain(found)

    async def list(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        labels: dict[str, Any] | None = None,
        fields: dict[str, Any] | None = None,
    ) -> list[Object]:
        self._count_read("list", kind)
        namespace_arg = namespace if namespace is not None else lightkube.ALL_NS
        if KINDS[kind] is Node:
            listing = self._client.list(Node, labels=labels, fields=fields)
        else:
            listing = self._client.list(KINDS[kind], namespace=namespace_arg, labels=labels, fields=fields)
        async with self._slots:
            return [_plain(item) async for item in listing]

    async def create(self, obj: Object) -> Object:
        """Create ``obj``; an object that already exists is returned as it is (idempotent)."""
        self._count("create", obj["kind"])
        try:
            async with self._slots:
                created = await self._client.create(codecs.from_dict(obj))
        except ApiError as error:
            if error.status.code == 409:
                existing = await self.get(obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
                if existing is not None:
                    self._tell(
                        "create", obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"], existing
                    )
                    return existing
            raise
        plain = _plain(created)
        self._tell("create", obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"], plain)
        return plain

    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, grace_seconds: int | None = None
    ) -> None:
        """Delete the object (a missing one is not an error); ``grace_seconds=0`` removes a pod at
        once, without waiting for its kubelet to confirm (a lost node's pods)."""
        self._count("delete", kind)
        try:
            async with self._slots:
                await self._client.delete(KINDS[kind], name, namespace=namespace, grace_period=grace_seconds)
        except ApiError as error:
            if error.status.code != 404:
                raise
        self._tell("delete", kind, namespace, name, None)

    async def patch(self, kind: str, name: str, namespace: str | None, patch: Object) -> Object:
        self._count("patch", kind)
        async with self._slots:
            patched = await self._client.patch(
                KINDS[kind], name, patch, namespace=namespace, patch_type=PatchType.MERGE
            )
        return _plain(patched)

    async def patch_status(self, kind: str, name: str, namespace: str, status: Object) -> None:
        """Merge-patch the status subresource (lists such as conditions are replaced whole)."""
        self._count("status", kind)
        async with self._slots:
            await self._client.patch(
                KINDS[kind].Status, name, {"status": status}, namespace=namespace, patch_type=PatchType.MERGE
            )


def _plain(obj: Any) -> Object:
    if isinstance(obj, dict):
        return obj
    result: Object = obj.to_dict()
    return result
