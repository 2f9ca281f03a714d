"""The operator's traffic to one agent cut during a refit
(docs/development.md#chaos-drills-and-the-soak). The cut is the engine core of shard 1 stopped
(SIGSTOP) for :data:`CUT_SECONDS` and continued: its agent port still accepts connections but
nothing answers, as behind a dropped network link; the shard's frontend holds its clients' requests
meanwhile. The shard must show non-Ready with a reason naming the unreachable agent, the Refit must
end (Succeeded or Failed, never left Running), no engine may stay suspended, and a following
checkpoint Refit must bring every shard to one version, with no client request failed or mixed
throughout."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chaos import drill as drill_module
from helpers import operators as operators_module
from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

CUT_SECONDS = 20.0
"""How long the agent does not answer: several of the operator's 2 s agent timeouts and 5 s polls."""
CUT_POD = f"{drill_module.FLEET}-s1-p0"


def _cut_reported(fleet: Object) -> bool:
    """Shard 1 is not Ready and its status says its agent is unreachable."""
    shards = {s["index"]: s for s in fleet.get("status", {}).get("shards", [])}
    shard = shards.get(1, {})
    return shard.get("phase") != "Ready" and "unreachable" in str(shard.get("lastError", ""))


@pytest.mark.timeout(900)
def test_agent_cut_during_a_refit_ends_the_refit_cleanly_and_the_fleet_converges(
    operators: operators_module.Operators,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    expected = {version: drill_module.greedy(source) for version, source in drill_module.SOURCES.items()}
    namespace = kube_admin.create_namespace("c")
    no_faults: dict[str, list[float]] = {step: [] for step in (*drill_module.STEPS, "agent-cut", "converge")}
    seen: list[str] = []
    started = time.monotonic()
    try:
        drill = drill_module.Drill(kube_admin, kubeconfig, pod_runner, operators, namespace, no_faults)
        refit_v1 = f"{base.refits(namespace)}/{drill_module.FLEET}-v1"

        def create() -> None:
            refit = {**base.DRAIN_IN_PLACE, "timeoutSeconds": 30}  # no mixed answer; engines suspended
            kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=2, refit=refit))

        def cut_during_refit() -> Callable[[], None]:
            join = drill.refit_rendezvous(1, drill_module.SOURCES[1])
            kube_admin.wait(refit_v1, lambda r: drill_module.refit_attempts(r) >= 1, timeout=120, what="attempt 1")
            core = drill.engine_pid(CUT_POD)
            os.kill(core, signal.SIGSTOP)
            cut = time.monotonic()
            try:
                reported = kube_admin.wait(
                    drill.fleet_path, lambda f: f is not None and _cut_reported(f), timeout=CUT_SECONDS
                )
                assert reported is not None
                seen.append(str({s["index"]: s.get("lastError") for s in reported["status"]["shards"]}))
                time.sleep(max(0.0, cut + CUT_SECONDS - time.monotonic()))  # the rest of the outage
            finally:
                os.kill(core, signal.SIGCONT)
            return join

        drill.step("create", drill_module.simple_action(create), lambda: drill.settled(2, 0), None)
        with drill_module.Client(kubeconfig, namespace, expected) as client:
            drill.step(
                "agent-cut",
                cut_during_refit,
                lambda: drill_module.refit_phase(kube_admin.get(refit_v1)) in ("Succeeded", "Failed"),
                client,
            )
            ended = kube_admin.get(refit_v1) or {}
            outcome = f"{drill_module.refit_phase(ended)} ({ended.get('status', {}).get('message')})"
            drill.step(
                "converge",
                drill_module.simple_action(lambda: drill.refit_checkpoint(2, drill_module.SOURCES[2])),
                lambda: drill.settled(2, 2),
                client,
            )
        with capsys.disabled():
            sys.stdout.write(
                f"\nagent-cut drill: {CUT_SECONDS:.0f} s cut of {CUT_POD}, refit v1 {outcome}, "
                f"{time.monotonic() - started:.0f} s; reported: {seen}\n"
            )
            sys.stdout.write("\n".join(drill_module.table(drill.reports)) + "\n")
        # The Refit that met the cut may fail (that is clean); every other check holds.
        allowed = {f"Refit {drill_module.FLEET}-v1 Failed"}
        assert [p for p in drill.leftovers() if p not in allowed] == []
        assert set(operators_module.agent_states(kube_admin, namespace, drill_module.FLEET).values()) == {"ready"}
        assert sum(r.failed for r in drill.reports) == 0 and sum(r.mixed for r in drill.reports) == 0
        assert sum(r.served for r in drill.reports) > 0, "the client was served nothing"
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
