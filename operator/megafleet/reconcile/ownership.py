"""What a fleet may touch: only the objects whose controller reference is the fleet itself.

Called by the reconcile steps that create, read or list the fleet's objects by name or label
(:mod:`.endpoints`, :mod:`.pods`, :mod:`.shards`). Names and labels are guessable: a Service, Secret
or pod someone else made under a derived name, or with the fleet's label, is never adopted, read,
published or deleted. The reconcile stops at the first such name and reports it as the NameConflict
condition (:func:`megafleet.reconcile.reconcile`).
"""

from __future__ import annotations

from typing import Any

from megafleet import desired, kube

Object = dict[str, Any]


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


async def get(api: kube.Api, fleet: desired.ParsedFleet, kind: str, name: str) -> Object | None:
    """The fleet's object ``name``, None when there is none; raises :class:`NameConflict` when
    another object holds the name."""
    found = await api.get(kind, name, fleet.namespace)
    if found is not None and not owned(found, fleet):
        raise NameConflict(kind, name)
    return found


async def create(api: kube.Api, fleet: desired.ParsedFleet, obj: Object) -> Object:
    """Create ``obj`` (owned by the fleet); the one already there is returned only if the fleet owns
    it, else :class:`NameConflict`."""
    created = await api.create(obj)
    if not owned(created, fleet):
        raise NameConflict(obj["kind"], obj["metadata"]["name"])
    return created
