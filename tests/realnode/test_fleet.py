"""The tiny CPU fleet in real containers on the real node, through the operator's unchanged pod
spec, in a namespace that enforces the restricted Pod Security Standard: Ready, greedy completions
from a client pod through the shard's ClusterIP Service (kube-proxy) and its DNS name (CoreDNS), a
refit through a Refit object from a trainer inside the node's network, a killed engine
container healing behind the same Service, and the agent token read inside the container from the
mounted Secret (the agent takes that token and refuses another)."""

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

from helpers import real_node_fleet, refit_e2e
from megafleet_dev import images, kube, realnode, sandbox
from megafleet_protocol import agent_api, ports

# The first test of a session starts the cluster and the node (and builds what is missing).
pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
WAIT = 240  # the first engine start imports torch on two shared cores
RESTRICTED = "pod-security.kubernetes.io/enforce"

# A client as a user writes one: a few bounded retries (a Service briefly without a Ready endpoint
# refuses), every error on stderr (the pod's termination message on failure).
CLIENT = """
import json, sys, time, urllib.request
answers = []
for base in sys.argv[1:]:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}).encode()
    for attempt in range(10):
        try:
            request = urllib.request.Request(base + "/completions", body, {"Content-Type": "application/json"})
            answers.append(json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["text"])
            break
        except OSError as error:
            print(base, attempt, repr(error), file=sys.stderr, flush=True)
            time.sleep(1)
    else:
        sys.exit(1)
open("/dev/termination-log", "w").write(json.dumps(answers))
"""


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def is_ready(obj: dict[str, Any] | None) -> bool:
    return (kube.condition(obj, "Ready") or {}).get("status") == "True"


def restricted() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def client_pod(name: str, urls: list[str]) -> dict[str, Any]:
    """A pod on the real node that asks each URL for a greedy completion and reports the answers
    as its termination message (no log access needed)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "client",
                    "image": images.reference("engine"),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", CLIENT, *urls],
                    "terminationMessagePolicy": "FallbackToLogsOnError",  # a traceback when it fails
                    "securityContext": restricted(),
                }
            ],
        },
    }


def ask(client: kube.Kube, namespace: str, name: str, urls: list[str]) -> list[str]:
    """Run a client pod to completion; its answers, one per URL."""
    client.create(f"/api/v1/namespaces/{namespace}/pods", client_pod(name, urls))
    done = client.wait(
        f"/api/v1/namespaces/{namespace}/pods/{name}",
        lambda pod: (pod or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
        timeout=WAIT,
        what=f"client pod {name} to finish",
    )
    assert done is not None
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert done["status"]["phase"] == "Succeeded", state
    answers: list[str] = json.loads(state["message"])
    return answers


@pytest.fixture(scope="module")
def fleet(operator: Path, kube_admin: kube.Kube) -> Iterator[tuple[str, dict[str, Any]]]:
    """The tiny example fleet placed on the real node; yields (namespace, its Ready object)."""
    namespace = kube_admin.create_namespace("t")
    # The restricted Pod Security Standard, enforced by the API server's admission for every pod
    # here: the engine pods and the client pods must pass it as they are.
    kube_admin.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {RESTRICTED: "restricted"}}})
    manifest = real_node_fleet.tiny(replicas=2)
    kube_admin.create(fleets(namespace), manifest)
    ready = kube_admin.wait(f"{fleets(namespace)}/tiny", is_ready, timeout=WAIT, what="the tiny fleet Ready")
    assert ready is not None
    try:
        yield namespace, ready
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)


def test_the_fleet_runs_in_real_containers_on_the_real_node(
    fleet: tuple[str, dict[str, Any]], kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace, ready = fleet
    labels = (kube_admin.get(f"/api/v1/namespaces/{namespace}") or {})["metadata"]["labels"]
    assert labels[RESTRICTED] == "restricted"
    assert [shard["phase"] for shard in ready["status"]["shards"]] == ["Ready", "Ready"]
    for shard in ready["status"]["shards"]:
        pod = kube_admin.wait(
            f"/api/v1/namespaces/{namespace}/pods/{shard['pods'][0]}",
            lambda obj: bool(((obj or {}).get("status", {}).get("containerStatuses") or [{}])[0].get("ready")),
            timeout=WAIT,
            what="the engine container ready",
        )
        assert pod is not None
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME
        assert pod["status"]["podIP"] in {str(ip) for ip in real_node.addresses.pods.hosts()}
        status = pod["status"]["containerStatuses"][0]
        assert status["containerID"].startswith("containerd://")
        assert status["imageID"]  # resolved by containerd from the imported engine image


def completions_served(kube_admin: kube.Kube, namespace: str, pod_name: str) -> int:
    """The completions a frontend answered with 200, from its pod's metrics port."""
    pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}") or {}
    text = httpx.get(f"http://{pod['status']['podIP']}:{ports.METRICS_PORT}/metrics", timeout=10).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("megafleet_requests_total{")
        and 'endpoint="/v1/completions"' in line
        and 'status="200"' in line
    )


def test_a_client_pod_gets_greedy_completions_through_the_service_ip_and_its_dns_name(
    fleet: tuple[str, dict[str, Any]], kube_admin: kube.Kube
) -> None:
    """Both shards share one frontends Service (one ClusterIP, a port each): kube-proxy sends each
    shard's port to that shard's frontend alone, through the ClusterIP and through CoreDNS."""
    namespace, ready = fleet
    endpoints = ready["status"]["endpoints"]
    assert [endpoint["service"] for endpoint in endpoints] == ["tiny-f0", "tiny-f0"]
    # Shard 0 asked once by each route, shard 1 four times by each: the counts tell the routes apart.
    urls = [endpoints[0]["url"], endpoints[0]["dnsURL"]] + [endpoints[1]["url"], endpoints[1]["dnsURL"]] * 4
    assert all(".svc:" in url for url in urls[1::2])
    frontends = [shard["pods"][0] for shard in ready["status"]["shards"]]
    before = [completions_served(kube_admin, namespace, pod) for pod in frontends]
    answers = ask(kube_admin, namespace, "client-services", urls)
    assert len(answers) == 10 and answers[0]
    assert len(set(answers)) == 1  # same weights, greedy: every shard and every route agrees
    deadline = time.monotonic() + 30  # the API servers report their requests to the core in batches
    while True:
        served = [completions_served(kube_admin, namespace, pod) - b for pod, b in zip(frontends, before, strict=True)]
        if served == [2, 8]:
            break
        assert time.monotonic() < deadline, f"completions served per shard: {served}, expected [2, 8]"
        time.sleep(0.5)


def test_a_killed_engine_container_heals_behind_the_same_service(
    fleet: tuple[str, dict[str, Any]], kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace, ready = fleet
    pod_path = f"/api/v1/namespaces/{namespace}/pods/{ready['status']['shards'][0]['pods'][0]}"
    pod = kube_admin.get(pod_path)
    assert pod is not None
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    real_node.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)

    def restarted_and_ready(obj: dict[str, Any] | None) -> bool:
        status = ((obj or {}).get("status", {}).get("containerStatuses") or [{}])[0]
        return status.get("restartCount", 0) > restarts and bool(status.get("ready"))

    assert kube_admin.wait(pod_path, restarted_and_ready, timeout=WAIT, what="the killed container back") is not None
    healed = kube_admin.wait(f"{fleets(namespace)}/tiny", is_ready, timeout=WAIT, what="the fleet Ready again")
    assert healed is not None
    endpoint = healed["status"]["endpoints"][0]
    assert endpoint == ready["status"]["endpoints"][0]  # the same Service, the same addresses
    assert ask(kube_admin, namespace, "client-healed", [endpoint["url"]])[0]


def test_a_refit_object_moves_the_containers_to_the_trainers_weights(
    fleet: tuple[str, dict[str, Any]], kube_admin: kube.Kube, real_node: realnode.RealNode, tmp_path: Path
) -> None:
    namespace, ready = fleet
    trainer = refit_e2e.TrainerModel()
    port = 29400  # inside the node's own netns: nothing else listens there
    name = "tiny-v1"
    kube_admin.create(
        refit_e2e.refits(namespace),
        {
            "apiVersion": "megafleet.dev/v1alpha1",
            "kind": "Refit",
            "metadata": {"name": name},
            "spec": {
                "fleetRef": {"name": "tiny"},
                "version": 1,
                "source": {"rendezvous": {"address": real_node.addresses.node_ip, "port": port, "trainerWorldSize": 1}},
            },
        },
    )
    running = kube_admin.wait(
        f"{refit_e2e.refits(namespace)}/{name}",
        lambda r: (r or {}).get("status", {}).get("phase") == "Running",
        timeout=WAIT,
        what="the refit's membership",
    )
    assert running is not None
    argv = [
        sys.executable,
        str(Path(__file__).with_name("trainer_process.py")),
        real_node.addresses.node_ip,
        str(ports.attempt_port(port, running["status"]["attempts"])),
        str(running["status"]["membership"]["worldSize"]),
        "1",
        refit_e2e.TRAINER_SOURCE,
    ]
    log = tmp_path / "trainer.log"
    enter = sandbox.enter_preexec(real_node.holder_pid, tmp_path)
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=enter)
    try:
        done = kube_admin.wait(
            f"{refit_e2e.refits(namespace)}/{name}",
            lambda r: (r or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
            timeout=WAIT,
            what="the refit to finish",
        )
        assert process.wait(timeout=WAIT) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert done is not None and done["status"]["phase"] == "Succeeded", done
    expected = trainer.greedy(12)
    for shard in ready["status"]["shards"]:
        tokens, version = refit_e2e.served(kube_admin, namespace, shard["pods"][0])
        assert (tokens, version) == (expected, "1")


# Run inside the engine container as its own user: where the token file is, what it holds, its mode.
TOKEN_PROBE = """
import json, os, stat
path = os.environ["MEGAFLEET_AGENT_TOKEN_FILE"]
print(json.dumps({"path": path, "token": open(path).read(), "mode": oct(stat.S_IMODE(os.stat(path).st_mode)),
                  "uid": os.getuid(), "writable": os.access(path, os.W_OK)}))
"""


def test_the_agent_token_is_mounted_from_its_secret_and_the_agent_requires_it(
    fleet: tuple[str, dict[str, Any]], kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace, ready = fleet
    pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{ready['status']['shards'][1]['pods'][0]}")
    assert pod is not None
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "agent-token")
    secret = kube_admin.get(f"/api/v1/namespaces/{namespace}/secrets/{volume['secret']['secretName']}")
    assert secret is not None
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32

    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    probe = real_node.ctr("tasks", "exec", "--exec-id", "token-probe", container_id, "python", "-c", TOKEN_PROBE)
    seen = json.loads(probe.stdout)
    assert seen["path"].startswith("/var/run/megafleet/agent/")
    assert seen["token"] == token  # the Secret's bytes, through the kubelet's volume, in the container
    assert seen["uid"] == 65532 and seen["mode"] == "0o440" and not seen["writable"]

    agent = f"http://{pod['status']['podIP']}:{ports.AGENT_PORT}{agent_api.STATE}"
    assert httpx.get(agent, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
    assert httpx.get(agent, headers={"Authorization": "Bearer not-the-token"}, timeout=30).status_code == 401
