"""A RefitSession as the Refit and RefitSession controllers read and write it.

:class:`Session` is the object parsed once where it is read (:func:`load`); :func:`write`
merge-patches its status unless that changes nothing (a waiting session is polled every second),
and :func:`written` is the session as it is after a write. Called by every module of
:mod:`megafleet.refits` that reads a session.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Literal

from megafleet import conditions, kube
from megafleet.api import v1alpha1
from megafleet.fleet_state import patches
from megafleet.objects import Object


@dataclasses.dataclass(frozen=True)
class Session:
    """A RefitSession as the controllers read it (parsed once where it is read)."""

    name: str
    namespace: str
    uid: str
    generation: int
    created: datetime.datetime
    spec: v1alpha1.RefitSessionSpec
    status: v1alpha1.RefitSessionStatus
    conditions: list[conditions.Condition]
    raw_status: Object = dataclasses.field(default_factory=dict, compare=False)
    """``status`` as read, so that a write that would change nothing is not made."""

    @classmethod
    def parse(cls, body: Object) -> Session:
        metadata = body["metadata"]
        raw_status = body.get("status") or {}
        created = metadata.get("creationTimestamp")
        return cls(
            name=metadata["name"],
            namespace=metadata["namespace"],
            uid=metadata.get("uid", ""),
            generation=int(metadata.get("generation", 1)),
            created=_timestamp(created) if created else utcnow(),
            spec=v1alpha1.RefitSessionSpec.model_validate(body["spec"]),
            status=v1alpha1.RefitSessionStatus.model_validate(raw_status),
            conditions=list(raw_status.get("conditions") or []),
            raw_status=dict(raw_status),
        )

    @property
    def phase(self) -> str:
        return self.status.phase

    @property
    def key(self) -> str:
        """What the agents know the session by: its UID (a recreated session is another world)."""
        return self.uid

    @property
    def deadline(self) -> datetime.datetime:
        """Until when the members may take to join: creation + ``joinTimeoutSeconds``."""
        return self.created + datetime.timedelta(seconds=self.spec.join_timeout_seconds)

    @property
    def members(self) -> list[tuple[int, int]]:
        """(shard, rank offset) of every member, as published at the join (empty before)."""
        membership = self.status.membership
        return [] if membership is None else [(entry.shard, entry.offset) for entry in membership.rank_offsets]

    @property
    def protocol(self) -> Literal["nemo", "megatron"]:
        """Whose world it is: NeMo's collective (nemoCollective) or megatron-core's group (megatronNative)."""
        return "nemo" if self.spec.nemo_collective is not None else "megatron"

    @property
    def world_address(self) -> str:
        world = self.spec.world
        return f"{world.address}:{world.port}"


async def load(api: kube.Api, namespace: str, name: str) -> Session | None:
    body = await api.get("RefitSession", name, namespace)
    return None if body is None else Session.parse(body)


async def write(api: kube.Api, session: Session, status: Object) -> None:
    """Merge-patch the session's status, unless that changes nothing (a waiting session is polled
    every second)."""
    if patches.unchanged(session.raw_status, status):
        return
    await api.patch_status("RefitSession", session.name, session.namespace, status)


def written(session: Session, update: Object) -> Session:
    """``session`` as it is once ``update`` was merged into its status."""
    raw = {**session.raw_status, **update}
    return dataclasses.replace(
        session,
        status=v1alpha1.RefitSessionStatus.model_validate(raw),
        conditions=list(raw.get("conditions") or []),
        raw_status=raw,
    )


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _timestamp(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
