"""``megafleet operator``: run the Kopf operator in this process.

Called by :mod:`megafleet.cli`. Watches all namespaces (or the ones given, globs allowed) and
reconciles MegatronGeneration objects until interrupted.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import kopf

from megafleet import metrics


def run(
    *,
    namespaces: Sequence[str] = (),
    peering: str | None = None,
    priority: int | None = None,
    metrics_port: int | None = None,
    verbose: bool = False,
) -> None:
    """Run until interrupted. With ``peering`` (a ClusterKopfPeering name) replicas elect one active
    operator: the highest priority acts, the others pause until its heartbeat expires. Without a
    given priority each replica draws a random one, so two replicas never tie (a tie pauses both)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from megafleet import handlers  # noqa: F401  (registers the handlers)

    if metrics_port is not None:
        metrics.serve(metrics_port)
    if peering is not None and priority is None:
        priority = random.SystemRandom().randint(1, 2**31 - 1)
    asyncio.run(
        kopf.operator(
            standalone=peering is None,
            peering_name=peering,
            priority=priority,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            memo=kopf.Memo(clusterwide=not namespaces),  # the GPU inventory's pod index covers every pod
        )
    )
