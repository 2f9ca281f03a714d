"""Fixtures of the chaos drills: the drills' own operator processes, watching ``c-*`` namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import operators as operators_module
from megafleet_dev import runner


@pytest.fixture
def operators(
    crds: None, pod_runner: runner.Runner, kubeconfig: Path, tmp_path: Path
) -> Iterator[operators_module.Operators]:
    """Started, killed and restarted by the drill; every one is stopped at the end."""
    started = operators_module.Operators(kubeconfig, tmp_path, "c-*")
    try:
        yield started
    finally:
        started.close()
