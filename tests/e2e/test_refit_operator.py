"""Refit end to end: a trainer process changes its weights and refits a fleet at its refit defaults
(keep, staging auto) through a Refit object, the operator drives the agents, and every frontend then
serves the trainer's weights."""

from __future__ import annotations

from pathlib import Path

from helpers import refit_e2e
from megafleet_dev import kube


def test_a_refit_object_brings_every_frontend_to_the_trainers_weights(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet())
    before = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
    assert before is not None and before["status"]["weightVersion"] == 0
    trainer = refit_e2e.TrainerModel()
    expected = trainer.greedy(12)
    assert refit_e2e.served(kube_admin, namespace, "tiny-s0-p0")[0] != expected  # the fleet starts elsewhere

    result = trainer.refit(kube_admin, namespace, "tiny", version=1)

    assert result["status"]["phase"] == "Succeeded", result["status"]
    assert result["status"]["membership"]["worldSize"] == 3  # 1 trainer rank + 2 one-rank shards
    # The fleet's defaults: keep (a pause at a step boundary, then the switch) and staging auto.
    assert {p["name"] for p in result["status"]["phases"]} >= {"pause", "join", "receive", "apply", "switch"}
    assert result["status"]["inFlight"]["requested"] == result["status"]["inFlight"]["effective"] == "keep"
    staging = result["status"]["staging"]
    assert staging["requested"] == "auto" and (staging["effective"] == "staged" or staging.get("reason")), staging
    fleet = kube_admin.wait(
        f"{refit_e2e.fleets(namespace)}/tiny",
        lambda o: refit_e2e.ready(o) and (o or {})["status"].get("weightVersion") == 1,
        timeout=refit_e2e.WAIT,
        what="the fleet at version 1",
    )
    assert fleet is not None and fleet["status"]["refit"]["currentVersion"] == 1
    current = kube.condition(fleet, "WeightsCurrent")
    assert current is not None and current["status"] == "True" and "version 1" in current["message"]
    for shard in fleet["status"]["shards"]:
        tokens, version = refit_e2e.served(kube_admin, namespace, shard["pods"][0])
        assert tokens == expected and version == "1"


def test_a_deferred_fleet_becomes_ready_only_through_its_first_refit(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(replicas=1, weights={"initial": "refit"}))
    loading = kube_admin.wait(
        f"{refit_e2e.fleets(namespace)}/tiny",
        lambda o: [s.get("phase") for s in (o or {}).get("status", {}).get("shards", [])] == ["Loading"],
        timeout=refit_e2e.WAIT,
        what="the shard loading without weights",
    )
    assert loading is not None and not refit_e2e.ready(loading)
    assert loading["status"]["endpoints"]  # published long before any weights exist

    result = refit_e2e.TrainerModel().refit(kube_admin, namespace, "tiny", version=5)

    assert result["status"]["phase"] == "Succeeded", result["status"]
    fleet = kube_admin.wait(
        f"{refit_e2e.fleets(namespace)}/tiny",
        refit_e2e.ready,
        timeout=refit_e2e.WAIT,
        what="Ready after the first refit",
    )
    assert fleet is not None and fleet["status"]["weightVersion"] == 5
