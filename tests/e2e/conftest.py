"""Fixtures several end-to-end test modules share: Prometheus and KEDA for the autoscale tests (one
start per module), and a local Ray for the tests of NeMo RL's trainer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import autoscale_e2e, nemo_collector
from megafleet_dev import autoscale, cluster


@pytest.fixture(scope="module")
def autoscaler(local_cluster: cluster.LocalCluster, operator: Path) -> Iterator[autoscale.Autoscale]:
    """Prometheus (scraping every :data:`helpers.autoscale_e2e.SCRAPE_SECONDS`) and KEDA, started for
    the module and stopped after it (they scrape and poll: not left running under later modules)."""
    running = autoscale.start(local_cluster, scrape_interval_seconds=autoscale_e2e.SCRAPE_SECONDS)
    try:
        yield running
    finally:
        autoscale.stop(local_cluster, running)


@pytest.fixture
def local_ray() -> Iterator[None]:
    with nemo_collector.local_ray():
        yield
