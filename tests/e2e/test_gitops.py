"""GitOps end to end (docs/gitops.md), with Flux's real controllers: source-controller clones a git
repository served over loopback by git's own http backend (:mod:`megafleet_dev.gitserver`), and
kustomize-controller applies its ``fleets/`` folder (a MegatronGeneration and a Refit) with
server-side apply, prunes, and waits for every object to be Current by kstatus.

One fleet's life in git: created (the sync waits until the fleet is Ready and its Refit has run),
scaled by a commit, rolled by a spec change, and deleted by removing its file (prune). While the
operator reconciles, kustomize-controller finds no drift: every apply after the first of a revision
leaves the fleet and the Refit ``unchanged``, and no field manager but kustomize-controller owns
any field of the fleet's spec.

Its own tier (marker ``gitops``; ``pytest -m gitops tests/e2e/test_gitops.py``): Flux is built on
first use (docs/gitops.md gives the cold build time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import cluster, gitops, gitserver, kube

pytestmark = [pytest.mark.gitops, pytest.mark.timeout(1500)]

FLEET = "tiny"
SYNC = "fleets"
WAIT = 420
CHECKPOINT = "tiny://llama?seed=7"
KUSTOMIZATIONS = f"/apis/kustomize.toolkit.fluxcd.io/v1/namespaces/{gitops.NAMESPACE}/kustomizations"
GIT_REPOSITORIES = f"/apis/source.toolkit.fluxcd.io/v1/namespaces/{gitops.NAMESPACE}/gitrepositories"


@pytest.fixture(scope="module")
def flux(local_cluster: cluster.LocalCluster, operator: Path) -> Iterator[gitops.Flux]:
    running = gitops.start(local_cluster)
    try:
        yield running
    finally:
        gitops.stop(local_cluster, running)


@pytest.fixture
def git(tmp_path: Path) -> Iterator[gitserver.GitServer]:
    server = gitserver.GitServer(tmp_path / "git")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def fleet_manifest(namespace: str, *, replicas: int, max_batch: int) -> Object:
    manifest = base.tiny_fleet(replicas=replicas)
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"]["engine"]["maxBatchSize"] = max_batch
    return manifest


def refit_manifest(namespace: str) -> Object:
    manifest = base.refit_manifest(FLEET, 1, checkpoint=CHECKPOINT)
    manifest["metadata"]["namespace"] = namespace
    return manifest


README = "fleets/README.md"
"""Keeps ``fleets/`` in git once its manifests are removed (git tracks no empty folder, and a
Kustomization whose path is gone fails instead of pruning)."""


def files(namespace: str, *, replicas: int, max_batch: int = 8) -> dict[str, str | None]:
    return {
        README: "The fleets Flux applies.\n",
        "fleets/fleet.yaml": yaml.safe_dump(fleet_manifest(namespace, replicas=replicas, max_batch=max_batch)),
        "fleets/refit.yaml": yaml.safe_dump(refit_manifest(namespace)),
    }


def request_sync(client: kube.Kube) -> None:
    """What ``flux reconcile`` does: ask both controllers to look now rather than at their interval."""
    stamp = {"metadata": {"annotations": {"reconcile.fluxcd.io/requestedAt": str(time.time_ns())}}}
    client.patch(f"{GIT_REPOSITORIES}/{SYNC}", stamp)
    client.patch(f"{KUSTOMIZATIONS}/{SYNC}", stamp)


def synced(client: kube.Kube, commit: str) -> Object:
    """The Kustomization once it is Ready at ``commit``: applied, and every object healthy."""

    def done(obj: Object | None) -> bool:
        status = (obj or {}).get("status") or {}
        ready = (kube.condition(obj, "Ready") or {}).get("status") == "True"
        return ready and str(status.get("lastAppliedRevision", "")).endswith(commit)

    found = client.wait(f"{KUSTOMIZATIONS}/{SYNC}", done, timeout=WAIT, what=f"Flux synced {commit[:8]}")
    assert found is not None
    return found


def fleet_path(namespace: str) -> str:
    return f"{base.fleets(namespace)}/{FLEET}"


def assert_ready_at_sync(client: kube.Kube, namespace: str, replicas: int) -> Object:
    """The fleet as the sync left it: Ready with every shard, its generation observed, no change pending."""
    fleet = client.get(fleet_path(namespace))
    assert fleet is not None
    status = fleet["status"]
    assert base.ready(fleet), status.get("conditions")
    assert status["observedGeneration"] == fleet["metadata"]["generation"]
    assert status["readyReplicas"] == replicas == fleet["spec"]["replicas"]
    reconciling = kube.condition(fleet, "Reconciling") or {}
    assert reconciling.get("status") == "False", reconciling
    return fleet


def pod_hashes(client: kube.Kube, namespace: str) -> dict[str, str]:
    items = client.list(f"/api/v1/namespaces/{namespace}/pods", label_selector=f"megafleet.dev/fleet={FLEET}")
    return {
        pod["metadata"]["uid"]: pod["metadata"]["annotations"]["megafleet.dev/template-hash"]
        for pod in items["items"]
        if not pod["metadata"].get("deletionTimestamp")
    }


def assert_only_flux_owns_the_spec(fleet: Object) -> None:
    """Server-side apply's bookkeeping: kustomize-controller owns the spec; every other manager (the
    operator, Kopf) wrote only metadata or the status subresource."""
    entries: list[dict[str, Any]] = fleet["metadata"]["managedFields"]
    applied = [e for e in entries if e["manager"] == gitops.FIELD_MANAGER and e["operation"] == "Apply"]
    assert applied and "f:spec" in applied[0]["fieldsV1"], entries
    for entry in entries:
        if entry["manager"] == gitops.FIELD_MANAGER or entry.get("subresource") == "status":
            continue
        assert set(entry.get("fieldsV1", {})) <= {"f:metadata"}, entry


def test_a_fleet_lives_in_git(
    flux: gitops.Flux, git: gitserver.GitServer, kube_admin: kube.Kube, namespace: str
) -> None:
    repository = git.repository("fleets")
    first = repository.commit(files(namespace, replicas=1), "a tiny fleet and its first refit")
    kube_admin.create(GIT_REPOSITORIES, gitops.git_repository(SYNC, git.url(repository), interval="10s"))
    kube_admin.create(KUSTOMIZATIONS, gitops.kustomization(SYNC, SYNC, "./fleets", interval="10s", timeout="4m"))

    # Created: the sync ends only once the fleet is Ready (and the Refit it carries has run).
    synced(kube_admin, first)
    fleet = assert_ready_at_sync(kube_admin, namespace, 1)
    assert_only_flux_owns_the_spec(fleet)
    refit = kube_admin.wait(
        f"{base.refits(namespace)}/{FLEET}-v1", base.refit_ended, timeout=WAIT, what="the Refit from git ended"
    )
    assert refit is not None
    assert refit["status"]["phase"] == "Succeeded", refit["status"]

    # Scaled by a commit.
    scaled = repository.commit(files(namespace, replicas=2), "scale to two shards")
    request_sync(kube_admin)
    synced(kube_admin, scaled)
    assert_ready_at_sync(kube_admin, namespace, 2)
    before = pod_hashes(kube_admin, namespace)
    assert len(set(before.values())) == 1

    # A spec change rolls every shard; the sync waits for the roll (Reconciling, then Ready).
    rolled = repository.commit(files(namespace, replicas=2, max_batch=4), "a smaller batch")
    request_sync(kube_admin)
    synced(kube_admin, rolled)
    fleet = assert_ready_at_sync(kube_admin, namespace, 2)
    after = pod_hashes(kube_admin, namespace)
    assert len(after) == 2 and not set(after) & set(before)
    assert set(after.values()).isdisjoint(before.values()) and len(set(after.values())) == 1
    assert_only_flux_owns_the_spec(fleet)

    # Deleted by removing its files: Flux prunes the fleet, the operator's children go with it.
    removed = repository.commit(
        {name: None for name in files(namespace, replicas=2) if name != README}, "remove the fleet"
    )
    request_sync(kube_admin)
    synced(kube_admin, removed)
    assert kube_admin.wait(fleet_path(namespace), lambda obj: obj is None, timeout=WAIT, what="fleet pruned") is None
    kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/pods", lambda items: not items, timeout=WAIT, what="pods gone"
    )

    # No drift the whole time: after the first apply of each revision, Flux found nothing to change.
    revisions: dict[str, int] = {}
    for revision, output in gitops.applies(flux.kustomize_log):
        ours = {name: action for name, action in output.items() if f"/{namespace}/" in name}
        if not ours:
            continue
        revisions[revision] = revisions.get(revision, 0) + 1
        if revisions[revision] > 1:
            assert set(ours.values()) == {"unchanged"}, (revision, ours)
    assert sum(revisions.values()) > len(revisions), f"too few applies to show drift: {revisions}"
