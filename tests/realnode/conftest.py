"""The ``realnode`` tier: a local control plane of its own with a real node (containerd, kubelet,
kube-proxy, CoreDNS in a network namespace) and the images built with buildah.

One cluster per test session, apart from the e2e tier's (whose fleets must never land on a real
node): its own state folder, KWOK pod network and real-node network. The fixtures here override
the root ``local_cluster``, ``kube_admin``, ``kubeconfig``, ``crds`` and ``operator`` for the tests
in this folder (every one that touches a cluster: a session fixture of the root conftest would be
cached with the e2e cluster); the operator runs on the host as a user runs it and reaches the pods
through the route to the node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers.operators import Operators
from megafleet_dev import cluster, kube, realnode

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACES = "t-*"
# Apart from the dev cluster's (127.64.0.0/12, 10.213.0.0/16) and the e2e tier's (127.128.0.0/12).
KWOK_POD_NETWORK = "127.144.0.0/12"
REAL_NODE_NETWORK = "10.214.0.0/16"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "realnode: runs pods in real containers on the real node (tests/realnode)")


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    local = cluster.LocalCluster(tmp_path_factory.mktemp("realnode-cluster"), pools=(), pod_network=KWOK_POD_NETWORK)
    local.start()
    try:
        yield local
    finally:
        realnode.stop(local)  # also deletes the node's containerd store (12 GB with the engine image)


@pytest.fixture(scope="session")
def kube_admin(local_cluster: cluster.LocalCluster) -> Iterator[kube.Kube]:
    with local_cluster.kube() as client:
        yield client


@pytest.fixture(scope="session")
def kubeconfig(local_cluster: cluster.LocalCluster) -> Path:
    return local_cluster.kubeconfig


@pytest.fixture(scope="session")
def crds(kube_admin: kube.Kube) -> None:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        kube_admin.install_crd(yaml.safe_load(path.read_text()))


@pytest.fixture(scope="session")
def real_node(local_cluster: cluster.LocalCluster) -> realnode.RealNode:
    return realnode.start(local_cluster, network=REAL_NODE_NETWORK)


@pytest.fixture(scope="session")
def operator(
    crds: None, real_node: realnode.RealNode, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """``megafleet operator`` on the host, watching the tests' namespaces; yields its log."""
    operators = Operators(kubeconfig, tmp_path_factory.mktemp("operator"), OPERATOR_NAMESPACES)
    operators.start()
    try:
        yield operators.logs[0]
    finally:
        operators.close()
