"""Control-plane chaos (docs/development.md#chaos-drills-and-the-soak): the operator drill's steps
(``tests/chaos/drill.py``: create, scale up and down, a template roll, a refit and a catch-up) with
the API server restarted and etcd SIGKILLed and restarted (its data kept) at seeded random points
instead of operator kills. The operator, the engines and the client ride through the outages: every
step converges, nothing is orphaned or duplicated, and no client request fails or gets a
mixed-version answer.
``MEGAFLEET_CHAOS_CP_FAULTS`` sets the number of restarts (default 4, over the :data:`SHORT_STEPS`:
the API server during create and the refit, etcd during scale-up and the catch-up; ``make chaos``
runs 12, two in each of the six steps)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from chaos import drill as drill_module
from helpers import operators as operators_module
from megafleet_dev import cluster, kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

SHORT_STEPS = ("create", "scale-up", "refit", "catch-up")
"""The steps of a drill of at most four restarts (``make test``): one restart in each; more restarts
run every step of the operator drill."""
PROGRAMS = ("kube-apiserver", "etcd")
"""Restarted in turn, starting with the API server."""


def test_the_spread_visits_create_refit_and_scale_first() -> None:
    points = drill_module.spread(4, seed=16)
    assert points == drill_module.spread(4, seed=16)
    assert {step for step, delays in points.items() if delays} == {"create", "refit", "scale-up", "catch-up"}
    assert all(len(delays) == 2 for delays in drill_module.spread(12, seed=3).values())


class Restarts:
    """The drill's fault: restart the next control-plane program in turn; records (program, outage s)."""

    def __init__(self, local: cluster.LocalCluster) -> None:
        self.local = local
        self.outages: list[tuple[str, float]] = []

    def __call__(self) -> None:
        program = PROGRAMS[len(self.outages) % len(PROGRAMS)]
        self.outages.append((program, round(self.local.restart(program), 1)))


def supervised_restarts(local: cluster.LocalCluster) -> dict[str, int]:
    """How often kube-scheduler and kube-controller-manager exited and were started again by
    :mod:`megafleet_dev.supervise` (the scheduler exits when a watch gap corrupted its cache)."""
    counts = {}
    for name in ("kube-scheduler", "kube-controller-manager"):
        log = local.state_dir / "logs" / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        counts[name] = text.count("[supervise]")
    return counts


@pytest.mark.timeout(1500)
def test_api_server_and_etcd_restarts_converge_with_no_failed_or_mixed_request(
    operators: operators_module.Operators,
    local_cluster: cluster.LocalCluster,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    faults = int(os.environ.get("MEGAFLEET_CHAOS_CP_FAULTS", "4"))
    _, seed = drill_module.knobs()
    points = drill_module.spread(faults, seed)
    expected = {version: drill_module.greedy(source) for version, source in drill_module.SOURCES.items()}
    namespace = kube_admin.create_namespace("c")
    restarts = Restarts(local_cluster)
    started = time.monotonic()
    try:
        drill = drill_module.Drill(kube_admin, kubeconfig, pod_runner, operators, namespace, points, fault=restarts)
        try:
            drill.run(expected, steps=SHORT_STEPS if faults <= len(SHORT_STEPS) else drill_module.STEPS)
        finally:
            with capsys.disabled():  # the drill's report, shown whether it passed or not
                sys.stdout.write(
                    f"\ncontrol-plane drill: {faults} restarts {restarts.outages}, seed {seed}, "
                    f"{time.monotonic() - started:.0f} s; restarted by their supervisor: "
                    f"{supervised_restarts(local_cluster)}\n"
                )
                sys.stdout.write("\n".join(drill_module.table(drill.reports)) + "\n")
        assert drill.leftovers() == []
        assert sum(r.failed for r in drill.reports) == 0 and sum(r.mixed for r in drill.reports) == 0
        assert sum(r.served for r in drill.reports) > 0, "the client was served nothing"
        assert len(restarts.outages) == faults
        assert len(operators.processes) == 1, "the operator itself was never restarted"
        assert all(process.poll() is None for process in operators.processes), "the operator died"
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
