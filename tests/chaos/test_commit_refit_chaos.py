"""The operator SIGKILLed after it recorded a commit, before it told the members
(docs/proposals/0003-in-flight-refits.md, the failure table's last row): eight long greedy streams run
on the two-shard tiny CPU fleet with staging and ``commit: operator``; a keep Refit from a checkpoint
starts, the operator is killed as soon as the Refit runs, and the Refit's ``status.commit.decidedTime``
is written as the killed operator's write-ahead record would be (the kill cannot be timed between
that write and the first commit call; writing the record after the kill is the same state, whatever
the killed operator got to). A new operator takes over and, finding the decision on record, pushes the
commit to the members still staged instead of deciding again: the Refit ends Succeeded with the
recorded time, every stream finishes with no error and exact spans (those that ended while the members
waited staged are all the old version's), and every shard serves the new version."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import inflight_streams as inflight
from helpers import operators as operators_module
from helpers import refit_e2e
from megafleet_dev import kube, runner

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]

RESTART_WAIT = 240  # the drill's step timeout (tests/chaos/drill.py)
STREAM_TOKENS = 300  # they run through the kill; the staged members serve the old version until the push
DECIDED = "2026-01-01T00:00:00Z"  # the record's time: recognisably not the new operator's


@pytest.mark.timeout(900)
def test_an_operator_killed_between_its_commit_record_and_the_push_is_finished_by_the_next(
    operators: operators_module.Operators,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
) -> None:
    namespace = kube_admin.create_namespace("c")
    try:
        first = operators.start()
        manifest = inflight.long_fleet(staging="auto", commit="operator")
        kube_admin.create(refit_e2e.fleets(namespace), manifest)
        fleet = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
        assert fleet is not None
        running = inflight.start_streams(inflight.frontends(kube_admin, namespace, fleet), STREAM_TOKENS)

        path = inflight.create_refit(kube_admin, namespace, 1, inflight.NEW_SOURCE, inFlight="keep")
        started = kube_admin.wait(
            path,
            lambda r: (r or {}).get("status", {}).get("phase") in ("Running", *refit_e2e.REFIT_ENDED),
            timeout=refit_e2e.WAIT,
            what="the refit to start",
        )
        assert started is not None and started["status"]["phase"] == "Running", started
        operators.kill(first)
        commit = {**started["status"]["commit"], "decidedTime": DECIDED}
        kube_admin.patch(f"{path}/status", {"status": {"commit": commit}})
        operators.start()

        result = kube_admin.wait(path, refit_e2e.refit_ended, timeout=RESTART_WAIT, what="the refit to end")
        loads = inflight.finish(running)

        assert result is not None and result["status"]["phase"] == "Succeeded", (result or {}).get("status")
        assert result["status"]["commit"] == {"requested": "operator", "mode": "operator", "decidedTime": DECIDED}
        assert result["status"]["staging"]["effective"] == "staged"
        inflight.check_kept(loads, "persist")  # exact spans; the streams may end before the new operator
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
