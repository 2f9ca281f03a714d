"""The operator's REST transport's pure parts: where each kind lives in the API, and the proxy the
environment names for the API server (found once, not per request)."""

from __future__ import annotations

import pytest

from megafleet import kube_rest


def test_paths_of_namespaced_cluster_and_custom_kinds() -> None:
    pods, nodes = kube_rest.RESOURCES["Pod"], kube_rest.RESOURCES["Node"]
    fleets = kube_rest.RESOURCES["MegatronGeneration"]
    assert pods.path("rl") == "/api/v1/namespaces/rl/pods"
    assert pods.path(None) == "/api/v1/pods"  # every namespace
    assert pods.path("rl", "p0") == "/api/v1/namespaces/rl/pods/p0"
    assert nodes.path("rl", "n0") == "/api/v1/nodes/n0"  # a cluster-scoped kind ignores the namespace
    assert (
        fleets.path("rl", "tiny", "status")
        == "/apis/megafleet.dev/v1alpha1/namespaces/rl/megatrongenerations/tiny/status"
    )
    assert kube_rest.RESOURCES["PriorityClass"].path(None, "high") == "/apis/scheduling.k8s.io/v1/priorityclasses/high"


@pytest.mark.parametrize("variable", ["HTTPS_PROXY", "https_proxy"])
def test_the_environments_proxy_unless_no_proxy_exempts_the_server(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert kube_rest.proxy_for("https://10.96.0.1:443") is None
    monkeypatch.setenv(variable, "http://proxy.example:3128")
    assert kube_rest.proxy_for("https://10.96.0.1:443") == "http://proxy.example:3128"
    monkeypatch.setenv("NO_PROXY", "10.96.0.1,.svc")
    assert kube_rest.proxy_for("https://10.96.0.1:443") is None
    assert kube_rest.proxy_for("https://kubernetes.default.svc") is None
