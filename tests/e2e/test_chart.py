"""The Helm chart against the real local control plane: lint, server-side dry run of the rendered
manifests, the operator running with only the chart's RBAC, and restricted Pod Security.

The operator here runs as a local process (there is no kubelet to run its image) but with the chart's
ServiceAccount token and the arguments of the chart's Deployment, watching ``mfchart-*`` namespaces
(apart from the session operator's ``t-*``).
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from megafleet.objects import Object
from megafleet_dev import cluster, kube, runner, toolchain

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "megafleet"
WATCHED = "mfchart-*"
WAIT = 90


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolchain.program_path("helm")), *args], capture_output=True, text=True, check=check, timeout=60
    )


def kubectl(kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolchain.kubectl_path()), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )


def render(release: str, namespace: str, *settings: str) -> list[dict[str, Any]]:
    flags = [arg for setting in settings for arg in ("--set", setting)]
    text = helm("template", release, str(CHART), "--namespace", namespace, *flags).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = (doc for doc in documents if doc["kind"] == kind)
    return found


def fleet(name: str, replicas: int) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    document["metadata"]["name"] = name
    document["spec"]["replicas"] = replicas
    return document


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def ready(obj: Object | None) -> bool:
    return (kube.condition(obj, "Ready") or {}).get("status") == "True"


# -- rendering -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        (),
        ("peering.enabled=false", "replicaCount=1"),
        ("metrics.serviceMonitor.enabled=true", "operator.watchNamespaces={rl-*,team-a}"),
        ("networkPolicy.namespaces={rl-a,rl-b}", "metrics.enabled=false"),
    ],
    ids=["defaults", "standalone", "service-monitor", "policies-elsewhere"],
)
def test_helm_lint_passes(settings: tuple[str, ...]) -> None:
    flags = [arg for setting in settings for arg in ("--set", setting)]
    result = helm("lint", "--strict", str(CHART), *flags)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (("peering.enabled=false",), "replicaCount > 1 needs peering.enabled=true"),
        (("metrics.enabled=false", "metrics.serviceMonitor.enabled=true"), "needs metrics.enabled=true"),
        (("metrics.port=80",), "metrics.port must be between 1024 and 65535"),
        (("peering.priority=7",), "a tie pauses all"),
        (("serviceAccount.create=false",), "serviceAccount.create=false needs serviceAccount.name"),
    ],
    ids=["replicas-without-peering", "monitor-without-metrics", "privileged-port", "fixed-priority", "default-sa"],
)
def test_values_validator_fails_with_a_clear_message(settings: tuple[str, ...], message: str) -> None:
    flags = [arg for setting in settings for arg in ("--set", setting)]
    result = helm("template", "r", str(CHART), *flags, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_defaults_are_secure_and_elect_one_leader() -> None:
    documents = render("fleet-ops", "ops")
    deployment = by_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2
    assert container["args"][:2] == ["operator", "--peering=fleet-ops"]
    assert by_kind(documents, "ClusterKopfPeering")["metadata"]["name"] == "fleet-ops"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    policy = by_kind(documents, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "ops"
    agent_rule = policy["spec"]["ingress"][0]
    assert agent_rule["ports"] == [{"protocol": "TCP", "port": 8471}]
    assert agent_rule["from"][0]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    other_ports = policy["spec"]["ingress"][1]["ports"]
    assert all(not (p["port"] <= 8471 <= p["endPort"]) for p in other_ports if p["protocol"] == "TCP")


@pytest.mark.parametrize(
    "settings",
    [(), ("peering.enabled=false", "replicaCount=1", "operator.watchNamespaces={rl-*}", "operator.verbose=true")],
    ids=["defaults", "standalone"],
)
def test_rendered_manifests_pass_a_server_side_dry_run(
    crds: None, kubeconfig: Path, namespace: str, tmp_path: Path, settings: tuple[str, ...]
) -> None:
    release = f"dry-{uuid.uuid4().hex[:6]}"
    documents = render(release, namespace, *settings)
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(documents))

    result = kubectl(kubeconfig, "apply", "--dry-run=server", "-f", str(manifest))

    accepted = [line for line in result.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(documents), result.stdout
    kinds = {doc["kind"] for doc in documents}
    assert {"ClusterRole", "ClusterRoleBinding", "Deployment", "NetworkPolicy", "ServiceAccount"} <= kinds
    assert ("ClusterKopfPeering" in kinds) == ("peering.enabled=false" not in settings)


# -- the operator with the chart's ServiceAccount ------------------------------------------------


@dataclass
class ChartOperator:
    kubeconfig: Path
    token: str
    log: Path


def _token_kubeconfig(admin: Path, token: str, target: Path) -> Path:
    config = yaml.safe_load(admin.read_text())
    config["users"] = [{"name": "operator", "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = "operator"
    target.write_text(json.dumps(config))
    target.chmod(0o600)
    return target


@pytest.fixture(scope="module")
def chart_operator(
    crds: None,
    kube_admin: kube.Kube,
    kubeconfig: Path,
    pod_runner: runner.Runner,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ChartOperator]:
    """The chart's ServiceAccount, ClusterRole, binding and peering created for real; the operator runs
    with a token of that ServiceAccount and the chart Deployment's arguments."""
    folder = tmp_path_factory.mktemp("chart-operator")
    release_namespace = kube_admin.create_namespace("mfrel")
    release = f"mf-{uuid.uuid4().hex[:6]}"
    documents = render(release, release_namespace, "metrics.enabled=false", f"operator.watchNamespaces={{{WATCHED}}}")
    wanted = [doc for doc in documents if doc["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    wanted.append(by_kind(documents, "ClusterKopfPeering"))
    manifest = folder / "rbac.yaml"
    manifest.write_text(yaml.safe_dump_all(wanted))
    kubectl(kubeconfig, "apply", "-f", str(manifest))
    account = by_kind(documents, "ServiceAccount")["metadata"]["name"]
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    token = kube_admin.create(f"/api/v1/namespaces/{release_namespace}/serviceaccounts/{account}/token", request)
    config = _token_kubeconfig(kubeconfig, token["status"]["token"], folder / "kubeconfig")
    args = by_kind(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--peering={release}" in args and f"--namespace={WATCHED}" in args
    log = folder / "operator.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "megafleet.cli", *args],
            env=dict(os.environ, KUBECONFIG=str(config)),
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        yield ChartOperator(config, token["status"]["token"], log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        kubectl(kubeconfig, "delete", "--ignore-not-found", "--wait=false", "-f", str(manifest), check=False)
        kube_admin.delete(f"/api/v1/namespaces/{release_namespace}", missing_ok=True)


@pytest.fixture
def fleet_namespace(kube_admin: kube.Kube) -> Iterator[str]:
    name = kube_admin.create_namespace("mfchart")
    yield name
    kube_admin.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


def test_the_operator_reconciles_a_fleet_with_only_the_chart_rbac(
    chart_operator: ChartOperator, kube_admin: kube.Kube, fleet_namespace: str
) -> None:
    kube_admin.create(fleets(fleet_namespace), fleet("tiny", replicas=2))

    done = kube_admin.wait(f"{fleets(fleet_namespace)}/tiny", ready, timeout=WAIT, what="tiny Ready")

    assert done is not None
    assert [shard["phase"] for shard in done["status"]["shards"]] == ["Ready", "Ready"]
    log = chart_operator.log.read_text()
    # a refusal shows as a 403 response line (not "403" anywhere: timestamps hold milliseconds)
    for refusal in ("Forbidden", '"HTTP/1.1 403', "Not enough permissions"):
        assert refusal not in log


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "allowed"),
    [
        ("create", "pods", "rl-a", True),
        ("patch", "megatrongenerations.megafleet.dev/status", "rl-a", True),
        ("patch", "clusterkopfpeerings.kopf.dev", None, True),
        ("patch", "refits.megafleet.dev/status", "rl-a", True),
        ("watch", "refitsessions.megafleet.dev", "rl-a", True),
        ("watch", "nodes", None, True),  # the watch-fed GPU inventory (Kopf index)
        ("watch", "services", "rl-a", True),
        ("patch", "refitsessions.megafleet.dev", "rl-a", True),
        ("patch", "refitsessions.megafleet.dev/status", "rl-a", True),
        ("update", "refitsessions.megafleet.dev/finalizers", "rl-a", True),
        ("get", "configmaps", "rl-a", True),
        ("get", "serviceaccounts", "rl-a", True),
        ("get", "priorityclasses.scheduling.k8s.io", None, True),
        ("list", "serviceaccounts", "rl-a", False),
        ("create", "serviceaccounts/token", "rl-a", False),
        ("create", "priorityclasses.scheduling.k8s.io", None, False),
        ("create", "refitsessions.megafleet.dev", "rl-a", False),
        ("delete", "refitsessions.megafleet.dev", "rl-a", False),
        ("update", "megatrongenerations.megafleet.dev/status", "rl-a", False),
        ("list", "secrets", "kube-system", False),
        ("watch", "secrets", "rl-a", False),
        ("update", "secrets", "rl-a", False),
        ("delete", "nodes", None, False),
        ("patch", "nodes", None, False),
        ("update", "pods", "rl-a", False),
        ("create", "pods/exec", "rl-a", False),
        ("delete", "megatrongenerations.megafleet.dev", "rl-a", False),
        ("create", "clusterroles.rbac.authorization.k8s.io", None, False),
        ("create", "clusterkopfpeerings.kopf.dev", None, False),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io", None, False),
    ],
    ids=lambda value: str(value),
)
def test_the_token_is_refused_what_the_operator_does_not_need(
    chart_operator: ChartOperator, verb: str, resource: str, namespace: str | None, allowed: bool
) -> None:
    scope = [f"--namespace={namespace}"] if namespace else []
    if "/" in resource:  # `can-i verb kind/name` reads a name: a subresource needs its own flag
        resource, subresource = resource.split("/")
        scope.append(f"--subresource={subresource}")
    result = kubectl(chart_operator.kubeconfig, "auth", "can-i", verb, resource, *scope, check=False)
    assert result.stdout.strip() == ("yes" if allowed else "no"), result.stderr


def test_reading_secrets_elsewhere_answers_403(
    chart_operator: ChartOperator, local_cluster: cluster.LocalCluster
) -> None:
    config = yaml.safe_load(chart_operator.kubeconfig.read_text())
    server = config["clusters"][0]["cluster"]["server"]
    with httpx.Client(
        base_url=server,
        verify=ssl.create_default_context(cafile=str(local_cluster.ca_file)),
        headers={"Authorization": f"Bearer {chart_operator.token}"},
    ) as client:
        assert client.get("/api/v1/namespaces/kube-system/secrets").status_code == 403
        assert client.delete("/api/v1/nodes/no-such-node").status_code == 403
        assert client.get("/apis/kopf.dev/v1/clusterkopfpeerings").status_code == 200


# -- restricted Pod Security -----------------------------------------------------------------------


def test_restricted_pod_security_admits_engines_and_rejects_privileged_pods(
    chart_operator: ChartOperator, kube_admin: kube.Kube, fleet_namespace: str
) -> None:
    kube_admin.patch(
        f"/api/v1/namespaces/{fleet_namespace}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    kube_admin.create(fleets(fleet_namespace), fleet("strict", replicas=1))

    done = kube_admin.wait(f"{fleets(fleet_namespace)}/strict", ready, timeout=WAIT, what="strict Ready")

    assert done is not None  # its engine pod was admitted under `restricted`, and it runs
    pods = kube_admin.list(f"/api/v1/namespaces/{fleet_namespace}/pods")["items"]
    assert len(pods) == 1
    privileged = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]},
    }
    with pytest.raises(kube.KubeError) as refused:
        kube_admin.create(f"/api/v1/namespaces/{fleet_namespace}/pods", privileged)
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in json.loads(refused.value.body)["message"]


# -- documentation ---------------------------------------------------------------------------------


def test_every_value_is_documented_and_listed_in_the_readme() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    readme = (CHART / "README.md").read_text()
    documented: list[str] = []
    path: list[str] = []
    for number, line in enumerate(lines):
        key = re.match(r"^( *)([A-Za-z]\w*):", line)
        if key is None:
            continue
        path = [*path[: len(key.group(1)) // 2], key.group(2)]
        above = [text.strip() for text in reversed(lines[:number])]
        comment = next((text for text in above if not text.startswith("# ") or text.startswith("# --")), "")
        has_doc = bool(above) and above[0].startswith("#") and comment.startswith("# --")
        if len(path) == 1:
            assert has_doc, f"values.yaml: top-level key {key.group(2)} lacks a '# --' comment"
        if has_doc:
            documented.append(".".join(path))
    parents = {name for name in documented if any(other.startswith(name + ".") for other in documented)}
    for name in set(documented) - parents:
        assert f"| {name} |" in readme, f"charts/megafleet/README.md does not list {name}"
