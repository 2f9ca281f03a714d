"""The operator SIGKILLed during a keep refit (docs/proposals/0003-in-flight-refits.md): eight long
greedy streams run on the two-shard tiny CPU fleet, a Refit with ``inFlight: keep`` starts, and the
operator is killed as soon as the Refit runs; a new operator takes over. Every stream finishes with
no error, its versions never go back and its spans are exact, the Refit ends Succeeded, and every
shard serves the new version."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import inflight_streams as inflight
from helpers import operators as operators_module
from helpers import refit_e2e
from megafleet_dev import kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

RESTART_WAIT = 240  # the drill's step timeout (tests/chaos/drill.py)


@pytest.mark.timeout(900)
def test_the_operator_killed_during_a_keep_refit_loses_no_stream_and_the_refit_completes(
    operators: operators_module.Operators,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
) -> None:
    namespace = kube_admin.create_namespace("c")
    try:
        first = operators.start()
        kube_admin.create(refit_e2e.fleets(namespace), inflight.long_fleet())
        fleet = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
        assert fleet is not None
        running = inflight.start_streams(inflight.frontends(kube_admin, namespace, fleet))

        path = inflight.create_refit(kube_admin, namespace, 1, inflight.NEW_SOURCE, inFlight="keep")
        kube_admin.wait(
            path,
            lambda r: (r or {}).get("status", {}).get("phase") in ("Running", *refit_e2e.REFIT_ENDED),
            timeout=refit_e2e.WAIT,
            what="the keep refit to start",
        )
        operators.kill(first)
        operators.start()

        # the new operator takes over once the killed one's peering record expires (as in the drill)
        result = kube_admin.wait(path, refit_e2e.refit_ended, timeout=RESTART_WAIT, what="the refit to end")
        loads = inflight.finish(running)

        assert result is not None and result["status"]["phase"] == "Succeeded", (result or {}).get("status")
        kv = result["status"]["inFlight"]["kvCacheMode"]
        assert inflight.check_kept(loads, kv) >= 1
        current = kube_admin.wait(
            f"{refit_e2e.fleets(namespace)}/tiny",
            lambda o: refit_e2e.ready(o) and (o or {})["status"].get("weightVersion") == 1,
            timeout=refit_e2e.WAIT,
            what="the fleet ready at version 1",
        )
        assert current is not None
        for shard in current["status"]["shards"]:
            assert refit_e2e.served(kube_admin, namespace, shard["pods"][0])[1] == "1"
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
