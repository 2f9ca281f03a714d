"""The operator chaos drill (``tests/chaos/drill.py``): SIGKILLs of the operator at seeded random
points of create, scale up and down, a template roll, a refit and a catch-up converge to the declared
state with nothing orphaned or duplicated and no failed or mixed-version client request.
``MEGAFLEET_CHAOS_KILLS`` sets the kill points (default 5; ``make chaos`` runs 20)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from chaos import drill as drill_module
from helpers import operators as operators_module
from megafleet_dev import kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]


def test_the_schedule_is_seeded_and_spread_over_the_steps() -> None:
    points = drill_module.schedule(20, seed=16)
    assert points == drill_module.schedule(20, seed=16)
    assert sum(len(delays) for delays in points.values()) == 20
    assert set(points) == set(drill_module.STEPS)
    assert all(0 <= d <= drill_module.KILL_WINDOW_SECONDS for delays in points.values() for d in delays)


@pytest.mark.timeout(1500)
def test_operator_sigkilled_at_random_points_converges_with_no_failed_or_mixed_request(
    operators: operators_module.Operators,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kills, seed = drill_module.knobs()
    points = drill_module.schedule(kills, seed)
    expected = {version: drill_module.greedy(source) for version, source in drill_module.SOURCES.items()}
    namespace = kube_admin.create_namespace("c")
    started = time.monotonic()
    try:
        drill = drill_module.Drill(kube_admin, kubeconfig, pod_runner, operators, namespace, points)
        try:
            drill.run(expected)
        finally:
            with capsys.disabled():  # the drill's report, shown whether it passed or not
                sys.stdout.write(
                    f"\nchaos drill: {kills} operator kills, seed {seed}, {time.monotonic() - started:.0f} s\n"
                )
                sys.stdout.write("\n".join(drill_module.table(drill.reports)) + "\n")
        assert drill.leftovers() == []
        assert sum(r.failed for r in drill.reports) == 0 and sum(r.mixed for r in drill.reports) == 0
        assert sum(r.served for r in drill.reports) > 0, "the client was served nothing"
        assert len(operators.processes) == kills + 1
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
