"""The soak (``tests/chaos/soak.py``): client load, a Refit every 10 s and a scale change every 2
minutes on a 3-shard fleet, with 0 failed or mixed answers, versions never backwards, every Refit
Succeeded, and no memory, descriptor or thread growth of the operator or the engines after warm-up.
``MEGAFLEET_SOAK_MINUTES`` sets its length (default :data:`SHORT_MINUTES` for ``make test``; ``make
soak`` runs 30 and writes its figures to ``MEGAFLEET_SOAK_RESULTS``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from chaos import drill as drill_module
from chaos import soak as soak_module
from helpers import operators as operators_module
from helpers import refit_e2e as base
from megafleet_dev import kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

SHORT_MINUTES = 1.0


def test_growth_flags_memory_descriptors_and_threads_but_not_replaced_engines() -> None:
    def series(process: str, rss: list[int], fds: int = 10, begin: float = 0.0) -> list[soak_module.Sample]:
        return [soak_module.Sample(begin + i, process, value * 1024, fds, 5) for i, value in enumerate(rss)]

    flat = series("operator", [100] * 8)
    leaking = series("engine/1", [100, 100, 100, 100, 110, 120, 130, 140])
    late = series("engine/2", [500] * 4, begin=4.0)  # started by a scale-up: not measured
    growths = soak_module.growth(flat + leaking + late, 0.0, 8.0)
    assert [g.process for g in growths] == ["engine/1", "operator"]
    assert [g.problems() != [] for g in growths] == [True, False]
    assert soak_module.backwards(
        [drill_module.Outcome(1.0, "served", "a", 2), drill_module.Outcome(2.0, "served", "a", 1)]
    ) == ["a: 2 then 1"]


@pytest.mark.timeout(3600)
def test_soak_refits_and_scale_changes_under_load_serve_everything_and_grow_nothing(
    operators: operators_module.Operators,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    minutes = float(os.environ.get("MEGAFLEET_SOAK_MINUTES", SHORT_MINUTES))
    most_refits = int(minutes * 60 / soak_module.REFIT_SECONDS) + 2
    expected = soak_module.expected_tokens(most_refits)
    namespace = kube_admin.create_namespace("c")
    drill = drill_module.Drill(kube_admin, kubeconfig, pod_runner, operators, namespace, {})
    try:
        refit = {**base.DRAIN_IN_PLACE, "timeoutSeconds": 60}  # no mixed answer
        kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=3, refit=refit))
        kube_admin.wait(drill.fleet_path, lambda f: drill.settled(3, 0), timeout=drill_module.STEP_TIMEOUT_SECONDS)
        soak = soak_module.Soak(drill, minutes)
        with drill_module.Client(kubeconfig, namespace, expected) as client, soak_module.Sampler(drill) as sampler:
            started = time.monotonic()
            soak.run()
            ended = time.monotonic()
        counts = client.count(started, ended)
        growths = soak_module.growth(sampler.samples, started, ended)
        figures = {
            "minutes": minutes,
            "requests": dict(counts),
            "refits": len(soak.refits),
            "refit_seconds_max": max((s for _, _, s in soak.refits), default=0.0),
            "refits_not_succeeded": [(v, p) for v, p, _ in soak.refits if p != "Succeeded"],
            "scales": soak.scales,
            "backwards": soak_module.backwards(client.outcomes),
            "growth": [
                {"process": g.process, "rss_mib": g.rss_mib, "fds": g.fds, "threads": g.threads} for g in growths
            ],
        }
        with capsys.disabled():  # the soak's report, shown whether it passed or not
            sys.stdout.write(f"\nsoak: {json.dumps({k: v for k, v in figures.items() if k != 'growth'})}\n")
            sys.stdout.write("\n".join(soak_module.table(growths)) + "\n")
        results = os.environ.get("MEGAFLEET_SOAK_RESULTS")
        if results:
            Path(results).write_text(json.dumps(figures, indent=2) + "\n")
        assert counts["failed"] == 0 and counts["mixed"] == 0 and counts["served"] > 0, counts
        assert figures["backwards"] == []
        assert figures["refits_not_succeeded"] == [] and len(soak.refits) >= 3
        assert any(g.process == "operator" for g in growths) and len(growths) >= 3
        assert [p for g in growths for p in g.problems()] == []
        assert drill.settled(3, len(soak.refits))
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
