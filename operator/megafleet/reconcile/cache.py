"""Watch-fed views of the fleets, pods, Services and nodes a reconcile reads, instead of GET and
LIST calls.

Filled by Kopf indexes (:mod:`megafleet.handlers` declares them and hands them over with
:meth:`Cache.attach`); read by :func:`megafleet.handlers._reconcile` (the fleet itself,
:meth:`Cache.fleet`), :func:`megafleet.fleet_state.pods.observe` (a fleet's pods, through its
:class:`~megafleet.fleet_state.pods.Index`), :mod:`.endpoints` (its Services) and :mod:`.shards`
(the GPU inventory). Without a cache (in-process tests, the Refit and RefitSession controllers)
those steps GET and LIST as before.

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
- A fleet is the newer of what the watch delivered and what the operator's own last write of it
  (a status or metadata patch, by any of its controllers) returned, by resource version: Kubernetes
  1.35 made resource versions of one resource comparable as integers (KEP-5504). So a reconcile
  never reads a status older than the operator's own last write, nor a spec older than the watch
  delivered. A fleet the index does not hold (not delivered yet, or deleted), or whose versions do
  not compare (an API server that does not give integers), is read with a GET, as before.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec

from megafleet import kueue, names
from megafleet.objects import Object

HOSTNAME_LABEL = kueue.HOSTNAME_LABEL
"""A pod's hostname node selector, kept in the slim pod (``megafleet.fleet_state.pods.pinned_node``)."""

Index = Mapping[Any, Iterable[Object]]
"""A Kopf index as handlers receive it: key to the values of every object indexed under it."""

PENDING_SECONDS = 60.0
"""How long an own write stays in the overlay without the watch confirming it (a bound on watch lag)."""

FLEETS = "megafleet_fleets"
FLEET_PODS = "megafleet_fleet_pods"
FLEET_SERVICES = "megafleet_fleet_services"
LIVE_PODS = "megafleet_live_pods"
NODES = "megafleet_nodes"
INDEXES = (FLEETS, FLEET_PODS, FLEET_SERVICES, LIVE_PODS, NODES)
"""The Kopf index ids :meth:`Cache.attach` needs (the handlers' function names)."""

FLEET_KIND = "MegatronGeneration"
_FLEET_KINDS = {"Pod": FLEET_PODS, "Service": FLEET_SERVICES}


def compare_versions(first: str | None, second: str | None) -> int | None:
    """-1, 0 or 1 as resource version ``first`` is older than, the same as or newer than ``second``
    (of the same resource); None when either is not a resource version that compares (a positive
    integer without leading zeros, KEP-5504)."""
    if not _comparable(first) or not _comparable(second):
        return None
    assert first is not None and second is not None
    a, b = (len(first), first), (len(second), second)
    return (a > b) - (a < b)


def _comparable(version: str | None) -> bool:
    return version is not None and version.isascii() and version.isdigit() and not version.startswith("0")


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
    pinned = (spec.get("nodeSelector") or {}).get(HOSTNAME_LABEL)
    group = (body["metadata"].get("labels") or {}).get(kueue.GROUP_LABEL)
    gates = spec.get("schedulingGates")
    return {
        "metadata": {
            "namespace": body["metadata"].get("namespace"),
            "name": body["metadata"]["name"],
            "uid": body["metadata"].get("uid"),
            # a Kueue group's pods Kueue admitted but has not pinned yet: inventory.assigned_gpus
            **({"labels": {kueue.GROUP_LABEL: group}} if group else {}),
        },
        "spec": {
            "nodeName": spec.get("nodeName"),
            "affinity": spec.get("affinity"),
            # the node Kueue's TAS pinned an admitted pod to (gang.placedBy: Kueue): pods.pinned_node
            **({"nodeSelector": {HOSTNAME_LABEL: pinned}} if pinned else {}),
            **({"schedulingGates": gates} if group and gates else {}),
            "containers": containers,
        },
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
    fleet_writes: dict[tuple[str, str], Object] = dataclasses.field(default_factory=dict)
    """Each fleet as the operator's last write of it returned, by (namespace, name), until the watch
    delivers that version or a newer one."""

    def attach(self, indexes: Mapping[str, Any]) -> None:
        """Keep the Kopf indexes (live objects: Kopf updates them in place) handed to a handler."""
        for name in INDEXES:
            if name in indexes:
                self.indexes[name] = indexes[name]

    @property
    def ready(self) -> bool:
        return all(name in self.indexes for name in INDEXES)

    def written(self, verb: str, kind: str, namespace: str | None, name: str, obj: Object | None) -> None:
        """A :data:`megafleet.kube.WriteObserver`: remember an own create or delete of a pod or
        Service, and an own write of a fleet (the object it returned)."""
        if kind == FLEET_KIND and namespace is not None and obj is not None:
            self.fleet_writes[(namespace, name)] = obj
            return
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

    def fleet(self, namespace: str, name: str) -> Object | None:
        """The fleet ``namespace/name``, the newer of the watch's and the operator's last write's
        (see the module docstring), as a copy the caller may change; None when it must be read
        from the API server instead."""
        key = (namespace, name)
        store = self._store(FLEETS, key) if FLEETS in self.indexes else []
        if len(store) != 1:
            self.fleet_writes.pop(key, None)  # not delivered yet, or deleted
            return None
        delivered, own = store[0], self.fleet_writes.get(key)
        if own is not None and own["metadata"].get("uid") != delivered["metadata"].get("uid"):
            del self.fleet_writes[key]  # of a fleet of the name that is gone
            own = None
        if own is None:
            return _copy(delivered)
        order = compare_versions(own["metadata"].get("resourceVersion"), delivered["metadata"].get("resourceVersion"))
        if order is None:
            return None
        if order <= 0:
            del self.fleet_writes[key]  # the watch delivered it, or something newer
            return _copy(delivered)
        return _copy(own)

    def forget_fleet(self, namespace: str, name: str) -> None:
        """The fleet is gone: what the operator last wrote of it no longer counts."""
        self.fleet_writes.pop((namespace, name), None)

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


def _copy(obj: Object) -> Object:
    """A deep copy of a JSON object (the index's and the overlay's stay as they were)."""
    copied: Object = msgspec.json.decode(msgspec.json.encode(obj))
    return copied


def _gone_or_going(current: Object, uid: str | None) -> bool:
    metadata = current["metadata"]
    return bool(metadata.get("deletionTimestamp")) or (uid is not None and metadata.get("uid") != uid)


def _deleting(obj: Object) -> Object:
    """``obj`` as the API server shows it once its deletion started."""
    return {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": "pending"}}
