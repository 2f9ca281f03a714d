"""Shared fixtures: one real local control plane per test session, a namespace per test.

Tests under ``tests/e2e/`` are marked ``e2e`` automatically and run after the unit tests.
The control plane is started once (programs come from the per-user cache; ``make test`` builds
them first) and stopped at the end of the session, by PID.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers import operator_env
from helpers.operators import Operators
from megafleet_dev import cluster, kube, runner

ROOT = Path(__file__).resolve().parents[1]
OPERATOR_NAMESPACES = "t-*"  # the operator of the test session watches only these namespaces

# Apart from the dev cluster's 127.64.0.0/12, so a running 'megafleet dev up' never collides.
# MEGAFLEET_TEST_POD_NETWORK moves it, so two test sessions on one machine never share pod IPs.
TEST_POD_NETWORK = os.environ.get("MEGAFLEET_TEST_POD_NETWORK", "127.128.0.0/12")


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
    """A fresh namespace watched by the session's operator (when a test starts it)."""
    name = kube_admin.create_namespace("t")
    yield name
    kube_admin.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


@pytest.fixture(scope="session")
def crds(kube_admin: kube.Kube) -> None:
    """The generated CRDs, installed and Established."""
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        kube_admin.install_crd(yaml.safe_load(path.read_text()))


@pytest.fixture(scope="session")
def pod_runner(kube_admin: kube.Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[runner.Runner]:
    """Engine pods become local processes bound to their 127.x pod IPs."""
    local = runner.Runner(kube_admin, tmp_path_factory.mktemp("pods"))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def operator(
    crds: None, kubeconfig: Path, pod_runner: runner.Runner, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The operator as a user runs it: a separate ``megafleet operator`` process; yields its log."""
    operators = Operators(
        kubeconfig, tmp_path_factory.mktemp("operator"), OPERATOR_NAMESPACES, env=operator_env.ENVIRONMENT
    )
    operators.start()
    try:
        yield operators.logs[0]
    finally:
        operators.close()


@pytest.fixture(scope="session")
def kubeconfig(local_cluster: cluster.LocalCluster) -> Path:
    return local_cluster.kubeconfig
