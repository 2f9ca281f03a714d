"""The ``realnode`` tier: a local control plane of its own with a real node (containerd, kubelet,
kube-proxy, CoreDNS in a network namespace) and the images built with buildah.

One cluster per test session, apart from the e2e tier's (whose fleets must never land on a real
node): its own state folder, KWOK pod network and real-node network. The fixtures here override
the root ``local_cluster``, ``kube_admin``, ``kubeconfig``, ``crds`` and ``operator`` for the tests
in this folder (every one that touches a cluster: a session fixture of the root conftest would be
cached with the e2e cluster); the operator runs on the host as a user runs it and reaches the pods
through the route to the node. ``chart_namespace`` is the chart installed as a user installs it (its
in-cluster operator, its agent NetworkPolicy enforced by the node's policy engine), shared by the
tests of the chart's operator and of that policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers import chart_release, pod_networks
from helpers.operators import Operators
from megafleet_dev import cluster, kube, realnode

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACES = "t-*"
# Apart from the dev cluster's, the e2e tier's and other test sessions' (MEGAFLEET_TEST_POD_NETWORK).
NETWORKS = pod_networks.cluster_networks(pod_networks.session_network(), pod_networks.REALNODE_SLOT)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "realnode: runs pods in real containers on the real node (tests/realnode)")


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.LocalCluster]:
    local = cluster.LocalCluster(tmp_path_factory.mktemp("realnode-cluster"), pools=(), pod_network=NETWORKS.kwok)
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
    return realnode.start(local_cluster, network=NETWORKS.real_node)


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


@pytest.fixture(scope="session")
def chart_namespace(
    real_node: realnode.RealNode, kube_admin: kube.Kube, kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The chart installed into a fresh restricted namespace, watching it; yields the namespace."""
    namespace = kube_admin.create_namespace("chartop")
    kube_admin.patch(
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    values = tmp_path_factory.mktemp("chart") / "values.yaml"
    values.write_text(yaml.safe_dump(chart_release.values(namespace)))
    release, chart = chart_release.RELEASE, str(chart_release.CHART)
    installed = chart_release.helm(kubeconfig, "install", release, chart, "-n", namespace, "--values", str(values))
    assert installed.returncode == 0, installed.stderr
    try:
        yield namespace
    finally:
        chart_release.helm(kubeconfig, "uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s")
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
        kube_admin.delete(f"/apis/kopf.dev/v1/clusterkopfpeerings/{release}", missing_ok=True)
