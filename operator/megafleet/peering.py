"""Announce an operator replica in its ClusterKopfPeering before Kopf starts.

Called by :func:`megafleet.operator_main.run` when the operator runs with ``--peering``. Kopf resumes a
replica as soon as its first look at the peering object shows no higher priority; two replicas
started at the same moment could both pass that look before either had written its heartbeat, and
both act until the next event paused the lower one. Here each replica first writes the same
heartbeat Kopf writes (``status.<identity>: {priority, lifetime, lastseen}``, under the identity Kopf
then keeps using) and waits ``settle`` seconds. Anyone started within that window is already in the
object when Kopf first reads it, and a replica started later only acts ``settle`` seconds after it
announced itself, long after the watches of the others have seen it and paused them.
See ``docs/incidents.md#peering-replicas-both-acted``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import uuid
from typing import Any

import lightkube
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource
from lightkube.types import PatchType

__all__ = ["announce", "heartbeat", "new_identity"]

log = logging.getLogger(__name__)

ClusterKopfPeering = create_global_resource("kopf.dev", "v1", "ClusterKopfPeering", "clusterkopfpeerings")


def new_identity() -> str:
    """A replica's peering identity: readable (host, pid) and unique (a random suffix)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def heartbeat(priority: int, lifetime: int, now: datetime.datetime) -> dict[str, Any]:
    """One replica's entry in the peering object's status, in the fields Kopf reads (a ``Peer``)."""
    return {"priority": priority, "lifetime": lifetime, "lastseen": now.isoformat()}


async def announce(
    name: str,
    identity: str,
    *,
    priority: int,
    lifetime: int,
    settle_seconds: float,
    client: lightkube.AsyncClient | None = None,
) -> bool:
    """Write this replica's heartbeat into ClusterKopfPeering ``name``, then wait ``settle_seconds``.
    False (after the same wait) when the object does not exist: Kopf then reports it and stays paused."""
    own = client or lightkube.AsyncClient()
    entry = heartbeat(priority, lifetime, datetime.datetime.now(datetime.UTC))
    try:
        await own.patch(ClusterKopfPeering, name, {"status": {identity: entry}}, patch_type=PatchType.MERGE)
        announced = True
    except ApiError as error:
        if error.status.code != 404:
            raise
        log.warning("peering object %r not found: not announced", name)
        announced = False
    finally:
        if client is None:
            await own.close()
    log.info("announced as %s (priority %d) in peering %r; settling %.1f s", identity, priority, name, settle_seconds)
    await asyncio.sleep(settle_seconds)  # the settle window itself, see the module docstring
    return announced
