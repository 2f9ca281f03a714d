"""``megafleet operator``: run the Kopf operator in this process.

Called by :mod:`megafleet.cli`. Watches all namespaces (or the ones given, globs allowed) and
reconciles MegatronGeneration objects until interrupted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections.abc import Sequence
from typing import Any, cast

import kopf

from megafleet import kopf_json, kopf_readiness, metrics, settings, supervision
from megafleet import peering as megafleet_peering


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
    given priority each replica draws a random one, so two replicas never tie (a tie pauses both).
    A peering replica first announces itself and settles (:mod:`megafleet.peering`), so replicas
    started together never both act. Kopf runs under :func:`megafleet.supervision.supervise`, which
    restarts it when it lost its resources to an API server in mid-start, with Kopf's index
    readiness fixed by :mod:`megafleet.kopf_readiness` and its watch streams decoded by
    :mod:`megafleet.kopf_json`."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from megafleet import handlers  # registers the handlers on import

    kopf_readiness.install()
    kopf_json.install()
    _tune_garbage_collector()

    if metrics_port is not None:
        metrics.serve(metrics_port)
    if peering is not None and priority is None:
        priority = random.SystemRandom().randint(1, 2**31 - 1)
    identity = megafleet_peering.new_identity()
    asyncio.run(_run(namespaces, peering, priority, identity, handlers.SETTINGS.triggers))


GC_THRESHOLDS = (20_000, 20, 100)
"""The cyclic collector's thresholds for the operator (Python's are 700, 10, 10)."""


def _tune_garbage_collector() -> None:
    """Keep the cyclic garbage collector from costing a quarter of the operator's CPU.

    The operator allocates dicts at a high rate (every watch event, every API answer) and holds
    large caches (every pod and node of the cluster); at Python's default thresholds a 1,000-pod
    burst ran 28 full collections of ~290,000 objects, 5.0 of 18 CPU seconds
    (``bench/controlplane.py``). Almost everything it allocates is freed by reference counting, so
    collections are made rarer, and the objects of the imported modules (about half the heap) are
    frozen out of every collection."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _run(
    namespaces: Sequence[str],
    peering: str | None,
    priority: int | None,
    identity: str,
    triggers: settings.TriggerSettings,
) -> None:
    if peering is not None:
        await megafleet_peering.announce(
            peering,
            identity,
            priority=priority or 0,
            lifetime=triggers.peering_lifetime_seconds,
            settle_seconds=triggers.peering_settle_seconds,
        )

    async def run_kopf(stop: asyncio.Event) -> None:
        await kopf.operator(
            standalone=peering is None,
            peering_name=peering,
            priority=priority,
            identity=cast(Any, identity),  # Kopf's Identity is a NewType of str it does not export
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            memo=kopf.Memo(clusterwide=not namespaces),  # the GPU inventory's pod index covers every pod
            stop_flag=stop,
        )

    await supervision.supervise(run_kopf)
