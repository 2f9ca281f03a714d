"""The chart's agent NetworkPolicy, enforced by the real node's policy engine (kube-router's
firewall: :mod:`megafleet_dev.netpolicy`), measured with real connections from real containers: a pod
of another namespace, and a pod of the fleet's own namespace that is not the operator, are refused
at an engine pod's agent port and served at its frontend; the chart's operator, in its pod, reaches
the agent; and a refit, which the operator drives through the agents, still moves the fleet to the
trainer's weights with the policy on.

The operator here is the chart's, in-cluster: the policy names the operator's pods, as users get
it, and nothing in it is bent for this test. The tier's other operator, on the host, is no pod of the
release and is refused at agent ports a policy guards (checked here too); it works in the other
tests' namespaces, where no policy selects the engine pods.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import chart_release, real_node_fleet, refit_e2e
from megafleet_dev import images, kube, netpolicy, realnode, sandbox
from megafleet_protocol import agent_api, ports

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]

WAIT = 300  # the engine imports torch on two shared cores
FLEET = "guarded"
TRAINER_PORT = 29410  # inside the node's own netns (the fleet tests' trainer uses 29400)

# Run in a client pod: three TCP connects to the agent port (each refused, timed out or open), then a
# greedy completion from the frontend (a few bounded retries); the outcome as the termination message.
PROBE = """
import json, socket, sys, urllib.request
ip, agent_port, frontend_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
agent = []
for _ in range(3):
    try:
        socket.create_connection((ip, agent_port), timeout=5).close()
        agent.append("open")
    except ConnectionRefusedError:
        agent.append("refused")
    except OSError as error:
        agent.append("timeout" if isinstance(error, TimeoutError) else repr(error))
body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
url = f"http://{ip}:{frontend_port}/v1/completions"
frontend = None
for attempt in range(5):
    try:
        request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        frontend = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["text"]
        break
    except OSError as error:
        print(attempt, repr(error), file=sys.stderr, flush=True)
open("/dev/termination-log", "w").write(json.dumps({"agent": agent, "frontend": frontend}))
"""

# Run inside the chart's operator container: the agent's state, with the fleet's agent token.
OPERATOR_PROBE = """
import sys, urllib.request
request = urllib.request.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]})
print(urllib.request.urlopen(request, timeout=30).status)
"""


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def probe_pod(name: str, ip: str) -> dict[str, Any]:
    """A client pod on the real node, restricted as the chart's namespace demands, running :data:`PROBE`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "client"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "probe",
                    "image": images.reference("engine"),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", PROBE, ip, str(ports.AGENT_PORT), "8000"],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                }
            ],
        },
    }


def probe(client: kube.Kube, namespace: str, name: str, ip: str) -> dict[str, Any]:
    """Run :func:`probe_pod` to completion in ``namespace``; what it saw."""
    client.create(f"/api/v1/namespaces/{namespace}/pods", probe_pod(name, ip))
    done = client.wait(
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        lambda pod: (pod or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
        timeout=WAIT,
        what=f"probe pod {name} to finish",
    )
    assert done is not None
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", state
    seen: dict[str, Any] = json.loads(state["message"])
    return seen


@pytest.fixture(scope="module")
def guarded(chart_namespace: str, kube_admin: kube.Kube, real_node: realnode.RealNode) -> Iterator[dict[str, Any]]:
    """A one-shard tiny fleet in the chart's namespace, reconciled by the chart's operator; yields
    its engine pod once the policy engine guards that pod's address."""
    namespace = chart_namespace
    manifest = real_node_fleet.tiny(replicas=1)
    manifest["metadata"]["name"] = FLEET
    manifest["spec"]["model"]["servedName"] = "tiny"  # the name the clients here ask for
    kube_admin.create(fleets(namespace), manifest)
    try:
        ready = kube_admin.wait(f"{fleets(namespace)}/{FLEET}", refit_e2e.ready, timeout=WAIT, what="the fleet Ready")
        assert ready is not None
        pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{ready['status']['shards'][0]['pods'][0]}")
        assert pod is not None
        ip = pod["status"]["podIP"]
        deadline = time.monotonic() + 60  # the engine syncs on the pod's events
        while not netpolicy.guards(real_node.holder_pid, ip):
            assert time.monotonic() < deadline, netpolicy.filter_rules(real_node.holder_pid)
            time.sleep(1)
        yield pod
    finally:
        kube_admin.delete(f"{fleets(namespace)}/{FLEET}", missing_ok=True)
        kube_admin.wait_items(
            f"/api/v1/namespaces/{namespace}/pods",
            lambda items: not [item for item in items if item["metadata"]["name"].startswith(f"{FLEET}-")],
            timeout=WAIT,
            what="the fleet's pods gone",
        )


def test_the_chart_policy_guards_the_engine_pods_in_the_node_namespace_only(
    guarded: dict[str, Any], chart_namespace: str, kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    policy = kube_admin.get(
        f"/apis/networking.k8s.io/v1/namespaces/{chart_namespace}/networkpolicies/{chart_release.RELEASE}-agents"
    )
    assert policy is not None  # the chart's defaults, as a user gets them
    assert policy["spec"]["podSelector"] == {"matchLabels": {"megafleet.dev/component": "engine"}}
    assert guarded["metadata"]["labels"]["megafleet.dev/component"] == "engine"
    assert netpolicy.ipsets(real_node.holder_pid)  # the operator pods' addresses, a set of the node's
    host = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True, check=False).stdout
    assert "KUBE-ROUTER" not in host and "KUBE-NWPLCY" not in host  # nothing on the host's own tables


@pytest.mark.parametrize("where", ["another namespace", "the fleet's namespace"])
def test_a_pod_that_is_not_the_operator_is_refused_at_the_agent_port_and_served_at_the_frontend(
    where: str, guarded: dict[str, Any], chart_namespace: str, kube_admin: kube.Kube
) -> None:
    namespace = kube_admin.create_namespace("outsider") if where == "another namespace" else chart_namespace
    name = "probe-outsider" if namespace != chart_namespace else "probe-neighbour"
    try:
        seen = probe(kube_admin, namespace, name, guarded["status"]["podIP"])
    finally:
        if namespace != chart_namespace:
            kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
        else:
            kube_admin.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", missing_ok=True)
    assert seen["agent"] == ["refused"] * 3  # kube-router's REJECT: a TCP reset, every time
    assert seen["frontend"]  # the policy's other rule: every other port stays open to all


def test_the_chart_operator_reaches_the_agent_and_the_host_is_refused(
    guarded: dict[str, Any], chart_namespace: str, kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    volume = next(v for v in guarded["spec"]["volumes"] if v["name"] == "agent-token")
    secret = kube_admin.get(f"/api/v1/namespaces/{chart_namespace}/secrets/{volume['secret']['secretName']}")
    assert secret is not None
    token = base64.b64decode(secret["data"]["token"]).decode()
    agent = f"http://{guarded['status']['podIP']}:{ports.AGENT_PORT}{agent_api.STATE}"
    operators = kube_admin.list(
        f"/api/v1/namespaces/{chart_namespace}/pods", label_selector=chart_release.OPERATOR_SELECTOR
    )["items"]
    assert operators
    for operator in operators:  # both replicas: the policy names the release's pods, not the leader
        container_id = operator["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
        seen = real_node.ctr(
            "tasks", "exec", "--exec-id", f"agent-probe-{operator['metadata']['name'][-5:]}", container_id,
            "python", "-c", OPERATOR_PROBE, agent, token,
        )  # fmt: skip
        assert seen.stdout.strip() == "200"
    with pytest.raises(httpx.ConnectError):  # the host is no pod of the release: refused like any other
        httpx.get(agent, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert httpx.get(f"http://{guarded['status']['podIP']}:8000/v1/models", timeout=30).status_code == 200


def test_a_refit_moves_the_guarded_fleet_to_the_trainers_weights(
    guarded: dict[str, Any], chart_namespace: str, kube_admin: kube.Kube, real_node: realnode.RealNode, tmp_path: Path
) -> None:
    """The chart's operator drives the refit through the agents (the port the policy guards); the
    engines fetch the weights from a trainer in the node's own network namespace."""
    namespace = chart_namespace
    trainer = refit_e2e.TrainerModel()
    path = f"{refit_e2e.refits(namespace)}/{FLEET}-v1"
    manifest = refit_e2e.refit_manifest(FLEET, 1, port=TRAINER_PORT)
    manifest["spec"]["source"]["rendezvous"]["address"] = real_node.addresses.node_ip
    kube_admin.create(refit_e2e.refits(namespace), manifest)
    running = kube_admin.wait(
        path, lambda r: (r or {}).get("status", {}).get("phase") == "Running", timeout=WAIT, what="the membership"
    )
    assert running is not None
    argv = [
        sys.executable,
        str(Path(__file__).with_name("trainer_process.py")),
        real_node.addresses.node_ip,
        str(ports.attempt_port(TRAINER_PORT, running["status"]["attempts"])),
        str(running["status"]["membership"]["worldSize"]),
        "1",
        refit_e2e.TRAINER_SOURCE,
    ]
    log = tmp_path / "trainer.log"
    enter = sandbox.enter_preexec(real_node.holder_pid, tmp_path)
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=enter)
    try:
        done = kube_admin.wait(path, refit_e2e.refit_ended, timeout=WAIT, what="the refit to finish")
        assert process.wait(timeout=WAIT) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert done is not None and done["status"]["phase"] == "Succeeded", done
    assert refit_e2e.served(kube_admin, namespace, guarded["metadata"]["name"]) == (trainer.greedy(12), "1")
