"""``megafleet operator``: run the Kopf operator in this process.

Called by :mod:`megafleet.cli`. Watches all namespaces (or the ones given) and reconciles
MegatronGeneration objects until interrupted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import kopf


def run(*, namespaces: Sequence[str] = (), standalone: bool = True, verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from megafleet import handlers  # noqa: F401  (registers the handlers)

    asyncio.run(
        kopf.operator(
            standalone=standalone,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
        )
    )
