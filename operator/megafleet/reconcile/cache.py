"""Watch-fed views of the pods, Services and nodes a reconcile reads, instead of LIST calls.

Filled by Kopf indexes (:mod:`megafleet.handlers` declares them and hands them over with
:meth:`Cache.attach`); read by :mod:`.pods` (a fleet's pods), :mod:`.endpoints` (its Services) and
:mod:`.shards` (the GPU inventory). Without a cache (in-process tests, the Refit drivers) those
steps LIST as before.

Freshness, what a reader can count on:

- Kopf updates an index before it runs any handler for the same watch event, and runs no handler
  before every index is filled from its first LIST: a reconcile triggered by an event of a fleet's
  pod sees that event, and every reconcile sees the cluster as of an event at least that recent.
- The operator's own writes are seen at once: a pod a placement planned counts its GPUs from the
  moment it is planned (:meth:`Cache.reserve`), so placements need not wait for each other's
  creates; an object it created is shown (and its GPUs counted) from the moment the create
  returns until the watch delivers it; an object it deleted is shown
  deleting (a pod) or gone (a Service) until the watch shows it so. A write the watch has not
  confirmed after :data:`PENDING_SECONDS` is dropped from the overlay (the watch lost it: the object
  was changed again by someone else, whose event then counts); one whose deletion the watch
  delivered is dropped at once (:meth:`Cache.forget`).
- The GPU inventory counts pods of every namespace only when the operator watches every namespace
  (``clusterwide``); an operator limited to some namespaces LISTs the cluster's pods at placement,
  as GPUs other namespaces' pods hold must still count.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from megafleet import names

Object = dict[str, Any]
Index = Mapping[Any, Iterable[Object]]
"""A Kopf index as handlers receive it: key to the values of every object indexed under it."""

PENDING_SECONDS = 60.0
"""How long an own write stays in the overlay without the watch confirming it (a bound on watch lag)."""

FLEET_PODS = "megafleet_fleet_pods"
FLEET_SERVICES = "megafleet_fleet_services"
LIVE_PODS = "megafleet_live_pods"
NODES = "megafleet_nodes"
INDEXES = (FLEET_PODS, FLEET_SERVICES, LIVE_PODS, NODES)
"""The Kopf index ids :meth:`Cache.attach` needs (the handlers' function names)."""

_FLEET_KINDS = {"Pod": FLEET_PODS, "Service": FLEET_SERVICES}


def fleet_key(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (namespace, fleet) a labelled pod or Service is indexed under; None without the label."""
    metadata = body.get("metadata") or {}
    fleet = (metadata.get("labels") or {}).get(names.LABEL_FLEET)
    return (metadata.get("namespace") or "default", fleet) if fleet else None


def slim_pod(body: Mapping[str, Any]) -> Object | None:
    """What the GPU inventory needs of a pod (node, pinned node, requests), None for an ended pod."""
    status, spec = body.get("status") or {}, body.get("spec") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None
    containers = [
        {"resources": {"requests": dict((c.get("resources") or {}).get("requests") or {})}}
        for c in spec.get("containers") or []
    ]
    return {
        "metadata": {
            "namespace": body["metadata"].get("namespace"),
            "name": body["metadata"]["name"],
            "uid": body["metadata"].get("uid"),
        },
        "spec": {"nodeName": spec.get("nodeName"), "affinity": spec.get("affinity"), "containers": containers},
    }


def slim_node(body: Mapping[str, Any]) -> Object:
    """What the GPU inventory needs of a node: name, labels, cordon, taints, allocatable."""
    metadata, spec = body["metadata"], body.get("spec") or {}
    return {
        "metadata": {"name": metadata["name"], "labels": dict(metadata.get("labels") or {})},
        "spec": {"unschedulable": spec.get("unschedulable", False), "taints": list(spec.get("taints") or [])},
        "status": {"allocatable": dict((body.get("status") or {}).get("allocatable") or {})},
    }


@dataclasses.dataclass
class _Pending:
    """One own write the watch has not confirmed yet."""

    kind: str
    namespace: str
    name: str
    created: Object | None
    """The object as created; None for a deletion."""
    uid: str | None
    """The created object's uid, or the uid the cache showed when it was deleted."""
    deadline: float


@dataclasses.dataclass
class Cache:
    """Reads of pods, Services and nodes from Kopf indexes, overlaid with the operator's own writes."""

    clusterwide: bool
    """The operator watches every namespace, so the live-pod index holds every GPU pod."""
    clock: Callable[[], float] = time.monotonic
    indexes: dict[str, Index] = dataclasses.field(default_factory=dict)
    pending: dict[tuple[str, str, str], _Pending] = dataclasses.field(default_factory=dict)
    reserved: dict[tuple[str, str], Object] = dataclasses.field(default_factory=dict)
    """Pods a placement planned whose creates have not returned yet, by (namespace, name): counted by
    the GPU inventory, so the next placement can plan while they are being created."""

    def attach(self, indexes: Mapping[str, Any]) -> None:
        """Keep the Kopf indexes (live objects: Kopf updates them in place) handed to a handler."""
        for name in INDEXES:
            if name in indexes:
                self.indexes[name] = indexes[name]

    @property
    def ready(self) -> bool:
        return all(name in self.indexes for name in INDEXES)

    def written(self, verb: str, kind: str, namespace: str | None, name: str, obj: Object | None) -> None:
        """A :data:`megafleet.kube.WriteObserver`: remember an own create or delete of a pod or Service."""
        if kind not in _FLEET_KINDS or namespace is None:
            return
        key = (kind, namespace, name)
        deadline = self.clock() + PENDING_SECONDS
        if verb == "create" and obj is not None:
            self.pending[key] = _Pending(kind, namespace, name, obj, obj["metadata"].get("uid"), deadline)
        elif verb == "delete":
            shown = self._seen(kind, namespace, name)
            uid = shown["metadata"].get("uid") if shown is not None else None
            self.pending[key] = _Pending(kind, namespace, name, None, uid, deadline)

    def forget(self, kind: str, body: Mapping[str, Any]) -> None:
        """The watch delivered the deletion of ``body`` (called by the handlers of DELETED events, which
        Kopf runs after it took the object out of every index): an own creation of it is no longer
        shown."""
        metadata = body.get("metadata") or {}
        key = (kind, metadata.get("namespace") or "default", metadata.get("name", ""))
        write = self.pending.get(key)
        if write is not None and write.created is not None and write.uid == metadata.get("uid"):
            del self.pending[key]

    def delivered(self, kind: str, body: Mapping[str, Any]) -> None:
        """The watch delivered an event of ``body`` that is not its deletion (called by the handlers of
        the operator's pods' and Services' events, which Kopf runs after it updated every index): an
        own creation of it, or an own deletion the event shows started, is in the index now and
        leaves the overlay. Without this a write left only when its fleet was read again, and every
        read scanned the unconfirmed writes of every fleet (thousands while a large apply settles)."""
        metadata = body.get("metadata") or {}
        key = (kind, metadata.get("namespace") or "default", metadata.get("name", ""))
        write = self.pending.get(key)
        if write is None:
            return
        confirmed = (
            write.uid == metadata.get("uid") if write.created is not None else _gone_or_going(dict(body), write.uid)
        )
        if confirmed:
            del self.pending[key]

    def fleet_objects(self, kind: str, namespace: str, fleet: str) -> list[Object]:
        """The pods or Services labelled for ``fleet`` in ``namespace``, as a LIST by that label would
        return them, with the operator's unconfirmed writes applied."""
        seen = {obj["metadata"]["name"]: obj for obj in self._store(_FLEET_KINDS[kind], (namespace, fleet))}
        self._expire()
        for (pending_kind, pending_namespace, name), write in list(self.pending.items()):
            if pending_kind != kind or pending_namespace != namespace:
                continue
            current = seen.get(name)
            if write.created is not None:
                if fleet_key(write.created) != (namespace, fleet):
                    continue
                if current is not None and current["metadata"].get("uid") == write.uid:
                    del self.pending[(kind, namespace, name)]  # the watch has it
                else:
                    seen[name] = write.created
            elif current is None or _gone_or_going(current, write.uid):
                del self.pending[(kind, namespace, name)]  # the watch shows it deleted, going or replaced
            elif kind == "Pod":
                seen[name] = _deleting(current)
            else:
                del seen[name]
        return list(seen.values())

    def nodes(self) -> list[Object]:
        return [node for store in self.indexes[NODES].values() for node in store]

    def nodes_by_name(self) -> Mapping[str, Object]:
        """The nodes by name, read from the index where asked (no copy of a thousand nodes per read)."""
        return _ByName(self.indexes[NODES])

    def reserve(self, pods: Iterable[Object]) -> None:
        """Count ``pods`` (planned, about to be created) in the GPU inventory until :meth:`release`."""
        for pod in pods:
            self.reserved[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod

    def release(self, pods: Iterable[Object]) -> None:
        """The creates of ``pods`` returned (each created one is in the overlay now) or failed."""
        for pod in pods:
            self.reserved.pop((pod["metadata"]["namespace"], pod["metadata"]["name"]), None)

    def with_reserved(self, live: list[Object]) -> list[Object]:
        """``live`` pods and the reserved ones not among them."""
        known = {(pod["metadata"].get("namespace"), pod["metadata"]["name"]) for pod in live}
        return live + [pod for key, pod in self.reserved.items() if key not in known]

    def live_pods(self) -> list[Object] | None:
        """Every pod not ended, for the GPU inventory, with the own creations the watch has not
        delivered yet; None when the index does not cover every namespace (the caller LISTs)."""
        if not self.clusterwide:
            return None
        found = {(pod["metadata"]["namespace"], pod["metadata"]["name"]): pod for pod in self._store(LIVE_PODS, None)}
        self._expire()
        for (kind, namespace, name), write in list(self.pending.items()):
            if kind == "Pod" and write.created is not None:
                current = found.get((namespace, name))
                if current is not None and current["metadata"].get("uid") == write.uid:
                    del self.pending[(kind, namespace, name)]  # the watch has it
                else:
                    found[(namespace, name)] = write.created
        return self.with_reserved(list(found.values()))

    def _store(self, index: str, key: Any) -> list[Object]:
        values = self.indexes[index]
        return list(values[key]) if key in values else []

    def _seen(self, kind: str, namespace: str, name: str) -> Object | None:
        index = self.indexes.get(_FLEET_KINDS[kind], {})
        for store in index.values():
            for obj in store:
                if obj["metadata"]["name"] == name and obj["metadata"].get("namespace") == namespace:
                    return obj
        return None

    def _expire(self) -> None:
        now = self.clock()
        for key in [key for key, write in self.pending.items() if write.deadline < now]:
            del self.pending[key]


class _ByName(Mapping[str, Object]):
    """A Kopf index keyed by object name, one object per key, read as a mapping of name to object."""

    def __init__(self, index: Index) -> None:
        self._index = index

    def __getitem__(self, name: str) -> Object:
        for obj in self._index[name]:
            return obj
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _gone_or_going(current: Object, uid: str | None) -> bool:
    metadata = current["metadata"]
    return bool(metadata.get("deletionTimestamp")) or (uid is not None and metadata.get("uid") != uid)


def _deleting(obj: Object) -> Object:
    """``obj`` as the API server shows it once its deletion started."""
    return {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": "pending"}}
