"""Shared fixtures: one real local control plane per test session, a namespace per test.

Tests under ``tests/e2e/`` are marked ``e2e`` automatically and run after the unit tests.
The control plane is started once (programs come from the per-user cache; ``make test`` builds
them first) and stopped at the end of the session, by PID.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from megafleet_dev import cluster, kube

# Apart from the dev cluster's 127.64.0.0/12, so a running 'megafleet dev up' never collides.
TEST_POD_NETWORK = "127.128.0.0/12"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    local = cluster.LocalCluster(tmp_path_factory.mktemp("cluster"), pod_network=TEST_POD_NETWORK)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def kube_admin(local_cluster: cluster.LocalCluster) -> Iterator[kube.Kube]:
    with local_cluster.kube() as client:
        yield client


@pytest.fixture
def namespace(kube_admin: kube.Kube) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (pods can be created at once)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube_admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    kube_admin.wait(
        f"/api/v1/namespaces/{name}/serviceaccounts/default",
        lambda sa: sa is not None,
        timeout=60,
        what=f"the default ServiceAccount in {name}",
    )
    yield name
    kube_admin.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


@pytest.fixture(scope="session")
def kubeconfig(local_cluster: cluster.LocalCluster) -> Path:
    return local_cluster.kubeconfig
