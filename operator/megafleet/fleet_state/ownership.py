"""What a fleet may touch: only the objects whose controller reference is the fleet itself.

Called wherever a fleet's objects are created, read or listed by name or label: the pod view
(:mod:`.pods`), the agent token (:mod:`.token`) and the reconcile steps
(:mod:`megafleet.reconcile.endpoints`, :mod:`megafleet.reconcile.shards`). Names and labels are
guessable: a Service, Secret or pod someone else made under a derived name, or with the fleet's
label, is never adopted, read, published or deleted. The reconcile stops at the first such name and
reports it as the NameConflict condition (:func:`megafleet.reconcile.reconcile`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megafleet import desired, kube
from megafleet.objects import Object


class NameConflict(Exception):
    """An object under a name the fleet derives exists and the fleet does not own it."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(
            f"{kind} {name!r} exists and is not owned by this fleet; the fleet creates and publishes "
            "nothing until it is deleted or renamed"
        )


def owned(obj: Object, fleet: desired.ParsedFleet) -> bool:
    """Whether the fleet is ``obj``'s controller (by uid: a fleet of the same name made before does not count)."""
    references = obj["metadata"].get("ownerReferences") or []
    return any(ref.get("uid") == fleet.uid and ref.get("controller") for ref in references)


def only_owned(objects: list[Object], fleet: desired.ParsedFleet) -> list[Object]:
    """The fleet's own objects among ``objects`` (listed by the fleet's label, which anyone can set)."""
    return [obj for obj in objects if owned(obj, fleet)]


RECENT_SECONDS = 30.0
"""How long an own object this operator read or wrote stands for its current state (:class:`Recent`)."""


class Recent:
    """The fleet-owned objects (the agent Secret, the endpoints ConfigMap) this operator read, created
    or patched in the last :data:`RECENT_SECONDS`, so the reconciles of a fleet that come in a burst
    (its creation: a reconcile per wave of pod events) read each once, not once per reconcile.

    What a reader can count on: an object is as this operator last saw or wrote it, at most
    :data:`RECENT_SECONDS` ago; a hand edit or deletion is seen by the first reconcile after that
    (which repairs it, as before). A fleet deleted and made again under its name has a new uid, so
    what is remembered of the old one never counts as the new one's (:func:`owned`)."""

    BOUND = 4096
    """Entries kept before the expired ones are dropped."""

    def __init__(self, seconds: float = RECENT_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self._seen: dict[tuple[str, str, str], tuple[float, Object]] = {}

    def get(self, kind: str, namespace: str, name: str) -> Object | None:
        entry = self._seen.get((kind, namespace, name))
        if entry is None or self.clock() - entry[0] > self.seconds:
            return None
        return entry[1]

    def put(self, kind: str, obj: Object) -> None:
        """Remember ``obj`` as a ``kind`` (the API's answers to a typed call may leave the kind out)."""
        metadata = obj["metadata"]
        now = self.clock()
        if len(self._seen) >= self.BOUND:
            self._seen = {key: entry for key, entry in self._seen.items() if now - entry[0] <= self.seconds}
        self._seen[(kind, metadata.get("namespace") or "", metadata["name"])] = (now, obj)


async def get(
    api: kube.Api, fleet: desired.ParsedFleet, kind: str, name: str, recent: Recent | None = None
) -> Object | None:
    """The fleet's object ``name``, None when there is none; raises :class:`NameConflict` when
    another object holds the name. With ``recent``, an object of the fleet's seen there is not read
    again."""
    known = recent.get(kind, fleet.namespace, name) if recent is not None else None
    if known is not None and owned(known, fleet):
        return known
    found = await api.get(kind, name, fleet.namespace)
    if found is not None and not owned(found, fleet):
        raise NameConflict(kind, name)
    if found is not None and recent is not None:
        recent.put(kind, found)
    return found


async def create(api: kube.Api, fleet: desired.ParsedFleet, obj: Object, recent: Recent | None = None) -> Object:
    """Create ``obj`` (owned by the fleet); the one already there is returned only if the fleet owns
    it, else :class:`NameConflict`. With ``recent``, the fleet's object is remembered there."""
    created = await api.create(obj)
    if not owned(created, fleet):
        raise NameConflict(obj["kind"], obj["metadata"]["name"])
    if recent is not None:
        recent.put(obj["kind"], created)
    return created
