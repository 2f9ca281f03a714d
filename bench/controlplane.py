"""Control-plane benchmark, megafleet head to head with LeaderWorkerSet, on simulated H200 nodes.

One run starts a fresh local control plane (KWOK nodes, 8 GPUs each) with the API server's audit
log on, and runs the same workload through both systems in turn: N groups of 8 pods of 8 GPUs
(``tp8``: 8 shards of one TP=8 pod per group; ``tp16``: 4 shards of two TP=16 pods, leader and
worker, per group). megafleet: N MegatronGenerations, the operator as a separate process (as a user
runs it); LeaderWorkerSet: N LeaderWorkerSets, its controller (built from pinned Go modules, see
``megafleet_dev.toolchain``) with its webhooks served on 127.0.0.1 with a certificate this script
issues (the pod webhook labels every group's pods: LWS does not work without it). Each controller is
started fresh for each scenario and stopped after it.

Per scenario: seconds from the first apply until every pod is bound and Running (and, for megafleet,
until every fleet's endpoints are in its status); API writes and reads from the audit log, the same
source for both, by actor (the controller itself, kube-controller-manager, scheduler, KWOK) with
Events counted apart; where the time went (each kind of write's first and last arrival and its
latency inside the API server, and when the median and the last group had its Services, pods,
bindings and Running pods); the controller's CPU seconds and peak RSS. The ``ready`` scenario runs real
tiny engines (CPU) and then measures a settled fleet's idle cost: API writes, reads and agent calls
per minute. Writes JSON with the machine details.

    .venv/bin/python bench/controlplane.py --groups 10,100,125 --variants tp8,tp16 \
        --ready 10 --out bench/results/controlplane-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from megafleet import desired, names, planner
from megafleet.api import crd, v1alpha1
from megafleet_dev import cluster, kube, nodes, pki, runner, toolchain

PODS_PER_GROUP = 8
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
BENCH_AGENT = "megafleet-bench"
SERVICE_BOUND_ENV = "MEGAFLEET_API_SERVICE_CREATES_IN_FLIGHT"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "verbs": ["watch"]},
        {"level": "None", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "Metadata"},
    ],
}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
READS = {"get", "list"}
GPU_TOLERATION = {"key": nodes.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
CPU_FLEET = {
    "model": {"source": "tiny://llama", "dtype": "float32", "maxSequenceLength": 256},
    "replicas": 1,
    "resources": {"gpusPerNode": 0, "cpu": "1", "memory": "1Gi"},
    "placement": {"tolerations": []},
    "engine": {"backend": "transformers", "maxBatchSize": 4},
}


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- workloads ---------------------------------------------------------------------------------


def fleet_spec(variant: str) -> dict[str, Any]:
    """A megafleet group: 8 pods of 8 GPUs (TP=16 over two H200s: NVLink only inside a node)."""
    tensor, replicas = (8, 8) if variant == "tp8" else (16, 4)
    placement: dict[str, Any] = {"nodeSelector": {nodes.POOL_LABEL: "h200"}}
    if tensor > 8:
        placement["nvlink"] = "Preferred"
    return {
        "model": {"source": "/models/llama-70b"},
        "replicas": replicas,
        "parallelism": {"tensor": tensor},
        "resources": {"gpusPerNode": 8},
        "placement": placement,
    }


def engine_pod_spec(variant: str) -> dict[str, Any]:
    """The pod spec megafleet renders for the first pod of a ``variant`` shard (its engine container
    with env, ports, probe, resources and security context, its volumes and tolerations), without
    what only megafleet needs: the node pinning (LWS leaves placement to the scheduler), the pod's
    hostname and subdomain, and the agent-token volume (LWS runs no agent). The same pods through
    both systems: the comparison is of the controllers, not of the pods' sizes."""
    spec = v1alpha1.MegatronGenerationSpec.model_validate(fleet_spec(variant))
    fleet = desired.ParsedFleet("g0", "bench", "bench-uid", 1, spec)
    layout = fleet.layout
    pods = tuple(planner.PodPlacement(node="any", gpus=layout.gpus_per_pod) for _ in range(layout.pods_per_shard))
    placement = planner.ShardPlacement(clique=None, pods=pods)
    pod_spec: dict[str, Any] = desired.shard_pods(fleet, 0, placement)[0]["spec"]
    for field in ("affinity", "hostname", "subdomain"):
        pod_spec.pop(field, None)
    pod_spec["volumes"] = [v for v in pod_spec["volumes"] if v["name"] != names.VOLUME_AGENT_TOKEN]
    for container in pod_spec["containers"]:
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != names.VOLUME_AGENT_TOKEN]
    return pod_spec


def lws_object(name: str, variant: str, template: str = "engine") -> dict[str, Any]:
    """The same group as a LeaderWorkerSet: ``replicas`` groups of ``size`` pods of 8 GPUs, each pod
    megafleet's engine pod (:func:`engine_pod_spec`), or with ``template`` ``minimal`` a pod of one
    container with only its GPU request (the template of the runs before 2026-12-03)."""
    replicas, size = (8, 1) if variant == "tp8" else (4, 2)
    if template == "engine":
        pod_spec = engine_pod_spec(variant)
    else:
        pod_spec = {
            "containers": [
                {
                    "name": "engine",
                    "image": "megafleet/engine:bench",
                    "resources": {"limits": {nodes.GPU_RESOURCE: "8"}, "requests": {nodes.GPU_RESOURCE: "8"}},
                }
            ],
            "nodeSelector": {nodes.POOL_LABEL: "h200"},
            "tolerations": [GPU_TOLERATION],
        }
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": size, "workerTemplate": {"spec": pod_spec}}},
    }


def fleets_path(namespace: str) -> str:
    return f"/apis/{v1alpha1.API_VERSION}/namespaces/{namespace}/megatrongenerations"


def lws_path(namespace: str) -> str:
    return f"/apis/{LWS_API}/namespaces/{namespace}/leaderworkersets"


# -- measuring ---------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (kube-controller-manager and kube-scheduler run
    under a supervisor process)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat.parent.name == str(pid) or fields[1] == str(pid):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")


def settle(local: cluster.LocalCluster, *, window: float = 10.0, most: float = 180.0) -> dict[str, float]:
    """Wait, before each scenario, until the control plane's background work has settled (a fresh
    cluster's 1,001 KWOK nodes turning Ready, or kube-controller-manager still working through the
    previous scenario's deleted objects): two consecutive ``window``-second samples of its CPU within
    20 % of each other (at most ``most`` seconds), so that no scenario pays for another's. Returns the
    idle control plane's CPU seconds per second, by program (1,001 nodes' leases cost some even idle)."""
    deadline = time.monotonic() + most
    before, previous = control_plane_cpu(local), None
    while True:
        time.sleep(window)
        after = control_plane_cpu(local)
        rate = {name: (after[name] - before.get(name, 0.0)) / window for name in after}
        total = sum(rate.values())
        if previous is not None and abs(total - previous) <= 0.2 * max(previous, 0.05):
            break
        if time.monotonic() > deadline:
            break
        before, previous = after, total
    programs = ", ".join(f"{name} {value:.2f}" for name, value in rate.items())
    say(f"idle control plane, CPU seconds per second: {total:.2f} ({programs})")
    return {name: round(value, 3) for name, value in rate.items()}


def control_plane_cpu(local: cluster.LocalCluster) -> dict[str, float]:
    """CPU seconds so far of each control-plane program (both systems share them)."""
    return {r.name: tree_cpu_seconds(r.pid) for r in local._records if r.name in CONTROL_PLANE}


def memory_available_mib() -> float:
    """The machine's ``MemAvailable``: what engines started meanwhile took, read as a difference."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (not idle nor waiting for I/O) since boot."""
    fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def actor(user_agent: str, controller: str) -> str:
    for prefix, name in (
        ("kube-scheduler", "scheduler"),
        ("kube-controller-manager", "kube-controller-manager"),
        ("kwok", "kwok"),
        (BENCH_AGENT, "bench"),
        ("lws-controller", "lws-controller"),
    ):
        if user_agent.startswith(prefix):
            return name
    return controller  # the operator: Kopf (aiohttp) and lightkube (httpx)


def audit_counts(log: Path, offset: int, namespace: str, controller: str) -> dict[str, Any]:
    """Successful writes and reads in ``namespace`` (and cluster-scoped ones by the controller) since
    ``offset``, keyed ``"<actor> <verb> <resource>"``. Refused requests do not count: on this
    control plane kube-controller-manager's Endpoints updates are refused (pod IPs are loopback
    addresses) and retried, for both systems' Services."""
    writes: collections.Counter[str] = collections.Counter()
    reads: collections.Counter[str] = collections.Counter()
    with log.open("rb") as stream:
        stream.seek(offset)
        for line in stream:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            who = actor(event.get("userAgent", ""), controller)
            if ref.get("namespace") != namespace and not (who == controller and not ref.get("namespace")):
                continue
            if (event.get("responseStatus") or {}).get("code", 200) >= 400 or ref.get("resource") == "ipaddresses":
                continue  # refused requests, and the ClusterIP records the API server writes itself
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            key = f"{who} {event['verb']} {resource}"
            if event["verb"] in WRITES:
                writes[key] += 1
            elif event["verb"] in READS:
                reads[key] += 1
    return {"writes": dict(sorted(writes.items())), "reads": dict(sorted(reads.items()))}


def _seconds(stamp: str) -> float:
    """An audit timestamp (RFC 3339, microseconds) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def timeline(log: Path, offset: int, namespace: str, controller: str, started: float, until: float) -> dict[str, Any]:
    """Where the time between the apply (``started``, epoch seconds) and the last pod Running went:
    per ``"<actor> <verb> <resource>"`` of the successful writes in ``namespace`` (Events apart),
    how many, when the first and the last arrived at the API server (seconds after the apply), and
    their median and longest latency in the API server (received to answered, milliseconds). Also
    ``apiserver create ipaddresses``: the ClusterIP records the API server writes to itself while it
    creates a ClusterIP Service (cluster-scoped; those received within ``until`` seconds of the apply)."""
    seen: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    with log.open("rb") as stream:
        stream.seek(offset)
        for line in stream:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if (event.get("responseStatus") or {}).get("code", 200) >= 400 or event["verb"] not in WRITES:
                continue
            allocation = ref.get("resource") == "ipaddresses" and event["verb"] == "create"
            if allocation:  # the API server's ClusterIP records: one per ClusterIP, allocated one at a time
                if not started <= _seconds(event["requestReceivedTimestamp"]) <= started + until:
                    continue
            elif ref.get("namespace") != namespace or ref.get("resource") == "events":
                continue
            who = "apiserver" if allocation else actor(event.get("userAgent", ""), controller)
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            received = _seconds(event["requestReceivedTimestamp"])
            seen[f"{who} {event['verb']} {resource}"].append((received, _seconds(event["stageTimestamp"]) - received))
    table = {}
    for key, found in sorted(seen.items(), key=lambda item: min(r for r, _ in item[1])):
        arrivals = sorted(r for r, _ in found)
        latencies = sorted(latency for _, latency in found)
        table[key] = {
            "count": len(found),
            "first_s": round(arrivals[0] - started, 2),
            "last_s": round(arrivals[-1] - started, 2),
            "median_ms": round(latencies[len(latencies) // 2] * 1000, 1),
            "max_ms": round(latencies[-1] * 1000, 1),
        }
    return table


PHASES = (
    ("services", "create", "services"),
    ("pods_created", "create", "pods"),
    ("bound", "create", "pods/binding"),
    ("running", "patch", "pods/status"),
)
"""The steps of one group on its way to Running, each done when the last of its writes of that kind
(verb, resource; any actor: the operator's pods, or LWS's StatefulSets' through
kube-controller-manager) was answered."""


def phases(log: Path, offset: int, namespace: str, started: float, until: float) -> dict[str, Any]:
    """When each group (objects named ``g<index>`` or ``g<index>-...``) finished each of
    :data:`PHASES`, seconds after the apply (``started``, epoch seconds): the median group and the
    last one. Shows whether a system's groups advance together (all waiting on one step) or one
    after another. Writes answered more than ``until`` seconds after the apply (a clean-up's) do not count."""
    done: dict[str, dict[str, float]] = collections.defaultdict(dict)
    with log.open("rb") as stream:
        stream.seek(offset)
        for line in stream:
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if ref.get("namespace") != namespace or (event.get("responseStatus") or {}).get("code", 200) >= 400:
                continue
            group = (ref.get("name") or "").split("-")[0]
            resource = ref.get("resource", "") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            for phase, verb, kind in PHASES:
                if (event["verb"], resource) == (verb, kind) and group.startswith("g"):
                    at = _seconds(event["stageTimestamp"]) - started
                    if at > until:
                        continue
                    done[group][phase] = max(done[group].get(phase, 0.0), at)
    table = {}
    for phase, _, _ in PHASES:
        times = sorted(found[phase] for found in done.values() if phase in found)
        if times:
            table[phase] = {
                "groups": len(times),
                "median_s": round(times[len(times) // 2], 2),
                "last_s": round(times[-1], 2),
            }
    return table


def summarize(counts: dict[str, Any], pods: int, controller: str) -> dict[str, Any]:
    """Per-pod figures: the system's own writes (the operator's, or LWS's controller's), the
    controllers' writes (those plus kube-controller-manager's on its behalf: LWS's StatefulSets'
    pods, both systems' Endpoints and EndpointSlices), Events apart, and every write."""

    def total(table: dict[str, int], keep: Callable[[str, str, str], bool]) -> int:
        found = 0
        for key, count in table.items():
            who, verb, resource = key.split(" ", 2)
            if keep(who, verb, resource):
                found += count
        return found

    controllers = (controller, "kube-controller-manager")
    writes = counts["writes"]
    own = total(writes, lambda who, _v, res: who in controllers and res != "events")
    events = total(writes, lambda who, _v, res: who in controllers and res == "events")
    every = total(writes, lambda who, _v, _r: who != "bench")
    alone = total(writes, lambda who, _v, res: who == controller and res != "events")
    return {
        "own_writes_per_pod": round(alone / pods, 2),
        "controller_writes": own,
        "controller_writes_per_pod": round(own / pods, 2),
        "controller_event_writes": events,
        "all_writes_per_pod": round(every / pods, 2),
        "controller_reads": total(counts["reads"], lambda who, _v, _r: who == controller),
        "controller_lists": total(counts["reads"], lambda who, verb, _r: who == controller and verb == "list"),
    }


def wait_until(what: str, check: Callable[[], bool], *, timeout: float, poll: float = 0.5) -> float:
    """Poll ``check`` until it holds; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic()


def watch_until(
    client: kube.Kube, collection: str, count: int, ok: Callable[[dict[str, Any]], bool], *, timeout: float
) -> float:
    """The monotonic time at which ``collection`` first held ``count`` objects, every one ``ok``: one
    LIST, then one watch from it (the state of each object from its events; a LIST again only when the
    watch expires). Not a LIST every second: polling 1,000 pods or 125 fleets was itself load on the
    API server under measurement (hundreds of milliseconds each on these two cores), for both systems."""
    deadline = time.monotonic() + timeout
    objects: dict[str, Any] = {}
    good: set[str] = set()

    def seen(obj: dict[str, Any], deleted: bool = False) -> None:
        name = obj["metadata"]["name"]
        if deleted:
            objects.pop(name, None)
        else:
            objects[name] = obj
        if not deleted and ok(obj):
            good.add(name)
        else:
            good.discard(name)

    def done() -> bool:
        return len(objects) == count and len(good) == count

    while True:
        listing = client.list(collection)
        objects.clear()
        good.clear()
        for item in listing["items"]:
            seen(item)
        if done():
            return time.monotonic()
        version = listing["metadata"]["resourceVersion"]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {collection}")
        params = {"watch": "1", "resourceVersion": version, "timeoutSeconds": str(max(1, int(remaining)))}
        http_timeout = httpx.Timeout(30.0, read=remaining + 5.0)
        with client._http.stream("GET", collection, params=params, timeout=http_timeout) as response:
            if response.status_code != 200:
                continue  # e.g. 410 Gone: list again
            for line in response.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    break
                seen(event["object"], deleted=event["type"] == "DELETED")
                if done():
                    return time.monotonic()


def pod_running(pod: dict[str, Any]) -> bool:
    return bool(pod["spec"].get("nodeName")) and pod.get("status", {}).get("phase") == "Running"


def fleet_published(fleet: dict[str, Any]) -> bool:
    return bool(len(fleet.get("status", {}).get("endpoints", [])) == fleet["spec"]["replicas"])


def fleets_ready(client: kube.Kube, namespace: str, count: int) -> Callable[[], bool]:
    def check() -> bool:
        items = client.list(fleets_path(namespace))["items"]
        return len(items) == count and all(
            (kube.condition(item, "Ready") or {}).get("status") == "True" for item in items
        )

    return check


# -- the two systems ---------------------------------------------------------------------------


class Bench:
    """The cluster, its audit log, and how each system's controller is started."""

    def __init__(
        self, local: cluster.LocalCluster, client: kube.Kube, audit_log: Path, state: Path, lws_template: str
    ) -> None:
        self.local, self.client, self.audit_log, self.state = local, client, audit_log, state
        self.lws_dir = toolchain.component_dir(next(c for c in toolchain.COMPONENTS if c.name == "lws"))
        self.webhook_port = cluster.free_port()
        self.webhook_ca = state / "lws-pki" / "ca"
        self.warm_namespace: str | None = None
        self.canaries = 0
        self.lws_template = lws_template
        """LWS's pod template (:func:`lws_object`)."""

    def start_operator(self, service_bound: int | None = None) -> tuple[subprocess.Popen[bytes] | None, int, int]:
        """The operator watching every namespace; (record, pid, metrics port). ``service_bound``: its
        ClusterIP Service creates in flight (``MEGAFLEET_API_SERVICE_CREATES_IN_FLIGHT``), if not the default."""
        port = cluster.free_port()
        env = dict(os.environ, KUBECONFIG=str(self.local.kubeconfig))
        if service_bound is not None:
            env[SERVICE_BOUND_ENV] = str(service_bound)
        command = [sys.executable, "-m", "megafleet.cli", "operator", "--metrics-port", str(port)]
        record = self.local.spawn(f"operator-{port}", command, env=env)
        self.local.wait_for("operator", lambda: None if _up(f"http://127.0.0.1:{port}/metrics") else "not serving")
        return None, record.pid, port

    def prepare_lws(self) -> None:
        """LWS's CRD, and a serving certificate for its webhooks on 127.0.0.1."""
        bases = self.lws_dir / "config" / "crd" / "bases" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
        self.client.install_crd(yaml.safe_load(bases.read_text()))
        certs = self.state / "lws-pki"
        certs.mkdir(exist_ok=True)
        pki.make_ca(self.webhook_ca, "lws-webhook-ca")
        pki.issue(self.webhook_ca, certs / "tls", "lws-webhook", server_ips=("127.0.0.1",))
        config = {
            "apiVersion": "config.lws.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": self.webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{cluster.free_port()}"},
            "clientConnection": {"qps": 500, "burst": 500},
        }
        (self.state / "lws-config.yaml").write_text(yaml.safe_dump(config))

    def start_lws(self) -> int:
        """LWS's controller, then its webhook configurations pointing at it; the controller's pid."""
        record = self.local.spawn(
            f"lws-{cluster.free_port()}",
            [
                str(self.lws_dir / "lws-controller"),
                f"--config={self.state / 'lws-config.yaml'}",
            ],
            env=dict(os.environ, KUBECONFIG=str(self.local.kubeconfig)),
        )
        url = f"https://127.0.0.1:{self.webhook_port}/"
        self.local.wait_for("lws webhooks", lambda: None if _up(url, verify=False, any_status=True) else "not serving")
        ca = base64.b64encode(self.webhook_ca.with_suffix(".crt").read_bytes()).decode()
        for document in yaml.safe_load_all((self.lws_dir / "config" / "webhook" / "manifests.yaml").read_text()):
            if not document:
                continue
            for hook in document["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}
                if path.endswith("-v1-pod"):  # as LWS's own kustomize patch: only LWS's pods
                    hook["objectSelector"] = {"matchExpressions": [{"key": LWS_NAME_LABEL, "operator": "Exists"}]}
            plural = (
                "mutatingwebhookconfigurations"
                if document["kind"].startswith("Mutating")
                else "validatingwebhookconfigurations"
            )
            self.client.delete(
                f"/apis/admissionregistration.k8s.io/v1/{plural}/{document['metadata']['name']}", missing_ok=True
            )
            self.client.create(f"/apis/admissionregistration.k8s.io/v1/{plural}", document)
        return record.pid

    def stop_lws_webhooks(self) -> None:
        for plural, name in (
            ("mutatingwebhookconfigurations", "mutating-webhook-configuration"),
            ("validatingwebhookconfigurations", "validating-webhook-configuration"),
        ):
            self.client.delete(f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}", missing_ok=True)

    def stop(self, pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and not _zombie(pid):
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists() and not _zombie(pid):
            os.kill(pid, signal.SIGKILL)

    def warm(self, system: str) -> None:
        """Wait until the fresh controller answers a canary object (replicas 0, in a namespace of its
        own that is not measured): its caches are filled (Kopf fills its indexes, 1,000 nodes
        among them, before it runs any handler), so the timed apply finds it listening."""
        if self.warm_namespace is None:
            self.warm_namespace = self.client.create_namespace("warm")
        self.canaries += 1
        name = f"canary-{self.canaries}"
        if system == "megafleet":
            path = fleets_path(self.warm_namespace)
            spec = {**fleet_spec("tp8"), "replicas": 0}
            body = {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": "MegatronGeneration",
                "metadata": {"name": name},
                "spec": spec,
            }
            self.client.create(path, body)
        else:
            path = lws_path(self.warm_namespace)
            body = lws_object(name, "tp8", self.lws_template)
            body["spec"]["replicas"] = 0
            self.client.create(path, body)
        started = time.monotonic()
        for attempt in range(30):  # a CRD's storage answers 429 for a moment after it is installed
            try:
                self.client.wait(
                    f"{path}/{name}", lambda obj: bool((obj or {}).get("status")), timeout=600, what=f"{system} warm"
                )
                break
            except kube.KubeError as error:
                if error.status != 429 or attempt == 29:
                    raise
                time.sleep(1)
        say(f"{system}: answered a canary {time.monotonic() - started:.1f} s after it was applied")
        self.client.delete(f"{path}/{name}")

    def cleanup(self, namespace: str) -> None:
        """The namespace goes, its pods first, all at once without grace (untimed: a namespace's
        garbage collection of 1,000 simulated pods one by one took over 15 minutes under load)."""
        options = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        try:  # the collection DELETE of 800 pods can outlast the client's read timeout: it goes on regardless
            self.client._http.request("DELETE", f"/api/v1/namespaces/{namespace}/pods", json=options, timeout=300)
        except httpx.HTTPError as error:
            say(f"deleting the pods of {namespace}: {error!r}; the namespace deletion removes them")
        self.client.delete(f"/api/v1/namespaces/{namespace}")
        self.client.wait(f"/api/v1/namespaces/{namespace}", lambda obj: obj is None, timeout=600, what="cleanup")

    def placed(self, system: str, variant: str, groups: int, service_bound: int | None = None) -> dict[str, Any]:
        """One scenario: ``groups`` groups through ``system``; every pod bound and Running."""
        namespace = self.client.create_namespace(f"{system}-{variant}-{groups}")
        pods = groups * PODS_PER_GROUP
        if system == "megafleet":
            _, pid, _ = self.start_operator(service_bound)
        else:
            pid = self.start_lws()
        self.warm(system)
        offset, cpu_before = self.audit_log.stat().st_size, cpu_seconds(pid)
        plane_before = control_plane_cpu(self.local)
        say(f"{system} {variant}: applying {groups} groups ({pods} pods) into {namespace}")
        started, started_wall = time.monotonic(), time.time()
        for index in range(groups):
            if system == "megafleet":
                body = {
                    "apiVersion": v1alpha1.API_VERSION,
                    "kind": "MegatronGeneration",
                    "metadata": {"name": f"g{index}"},
                    "spec": fleet_spec(variant),
                }
                self.client.create(fleets_path(namespace), body)
            else:
                self.client.create(lws_path(namespace), lws_object(f"g{index}", variant, self.lws_template))
        result: dict[str, Any] = {"system": system, "variant": variant, "groups": groups, "pods": pods}
        if system == "megafleet":
            result["service_creates_in_flight"] = service_bound or int(os.environ.get(SERVICE_BOUND_ENV, "2"))
        result["load_average_before"] = [round(value, 2) for value in os.getloadavg()]
        result["apply_seconds"] = round(time.monotonic() - started, 2)
        timeout = 900.0
        if system == "megafleet":
            at = watch_until(self.client, fleets_path(namespace), groups, fleet_published, timeout=timeout)
            result["endpoints_published_seconds"] = round(at - started, 2)
        at = watch_until(self.client, f"/api/v1/namespaces/{namespace}/pods", pods, pod_running, timeout=timeout)
        result["all_running_seconds"] = round(at - started, 2)
        result["controller_cpu_seconds"] = round(cpu_seconds(pid) - cpu_before, 2)
        result["controller_peak_rss_mib"] = round(peak_rss_mib(pid), 1)
        result["control_plane_cpu_seconds"] = {
            name: round(value - plane_before.get(name, 0.0), 2) for name, value in control_plane_cpu(self.local).items()
        }
        say(f"{system} {variant} {groups} groups: every pod Running after {result['all_running_seconds']:.1f} s")
        say(
            f"  CPU s: {system} {result['controller_cpu_seconds']}, control plane {result['control_plane_cpu_seconds']}"
        )
        time.sleep(3)  # let the audit log catch the last writes of the burst (it is written in batches)
        controller = "operator" if system == "megafleet" else "lws-controller"
        counts = audit_counts(self.audit_log, offset, namespace, controller)
        result.update(summarize(counts, pods, controller))
        result["audit"] = counts
        until = result["all_running_seconds"] + 1
        result["timeline"] = timeline(self.audit_log, offset, namespace, controller, started_wall, until)
        result["phases"] = phases(self.audit_log, offset, namespace, started_wall, until)
        say(f"  phases (median group, last group): {result['phases']}")
        for key, entry in result["timeline"].items():
            say(f"  {key}: {entry}")
        if system == "lws":
            self.stop_lws_webhooks()
        self.stop(pid)
        try:
            self.cleanup(namespace)
        except (TimeoutError, httpx.HTTPError) as error:  # what was measured stands; the next has its own namespace
            say(f"cleanup of {namespace}: {error}")
        return result

    def ready(self, count: int, idle_seconds: float) -> dict[str, Any]:
        """``count`` one-shard fleets of real tiny engines: time to all Ready, then one idle window."""
        namespace = self.client.create_namespace(f"ready-{count}")
        _, pid, port = self.start_operator()
        self.warm("megafleet")
        say(f"ready: applying {count} tiny CPU fleets into {namespace}")
        available = memory_available_mib()
        started = time.monotonic()
        for index in range(count):
            body = {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": "MegatronGeneration",
                "metadata": {"name": f"f{index}"},
                "spec": CPU_FLEET,
            }
            self.client.create(fleets_path(namespace), body)
        at = wait_until("Ready", fleets_ready(self.client, namespace, count), timeout=900.0, poll=1.0)
        result: dict[str, Any] = {"fleets": count, "engines": count, "all_ready_seconds": round(at - started, 2)}
        say(f"ready: {count} fleets Ready after {result['all_ready_seconds']:.1f} s")
        time.sleep(20)  # past the probe delay's growth to its longest
        offset, calls, busy = self.audit_log.stat().st_size, _agent_calls(port), busy_cpu_seconds()
        taken = available - memory_available_mib()
        time.sleep(idle_seconds)
        idle_cores = (busy_cpu_seconds() - busy) / idle_seconds
        # What the machine holds: engines until memory runs out (less 2 GiB for the rest), each
        # taking what these took on average; CPU is not the bound once they are Ready (idle_cores).
        result["engines_memory_mib"] = round(taken / count, 1)
        result["memory_available_before_mib"] = round(available, 1)
        result["machine_busy_cores_while_idle"] = round(idle_cores, 3)
        result["engines_the_machine_holds"] = int((available - 2048) // max(taken / count, 1.0))
        counts = audit_counts(self.audit_log, offset, namespace, "operator")
        minutes = idle_seconds / 60
        idle = summarize(counts, count, "operator")
        result["idle"] = {
            "seconds": idle_seconds,
            "operator_writes_per_minute": round(idle["controller_writes"] / minutes, 2),
            "operator_reads_per_minute": round(idle["controller_reads"] / minutes, 2),
            "operator_lists_per_minute": round(idle["controller_lists"] / minutes, 2),
            "agent_calls_per_pod_minute": round((_agent_calls(port) - calls) / count / minutes, 2),
            "audit": counts,
        }
        result["operator_peak_rss_mib"] = round(peak_rss_mib(pid), 1)
        self.stop(pid)
        self.cleanup(namespace)
        return result


def _agent_calls(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("megafleet_operator_agent_calls_total{")
    )


def _up(url: str, *, verify: bool = True, any_status: bool = False) -> bool:
    try:
        response = httpx.get(url, timeout=2, verify=verify)
    except httpx.HTTPError:
        return False
    return any_status or response.status_code == 200


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = next(
        int(line.split()[1]) // 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_mib": memory,
        "load_average_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "kubernetes": toolchain.KUBERNETES_VERSION,
        "etcd": toolchain.ETCD_VERSION,
        "kwok": toolchain.KWOK_VERSION,
        "lws": toolchain.LWS_VERSION,
        "operator_overrides": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("MEGAFLEET_") and "TEST" not in k
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **source_version(),
    }


def source_version() -> dict[str, Any]:
    """The commit measured, and whether the working tree differed from it."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted_changes": bool(git("status", "--porcelain"))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="10,100,125", help="group counts (8 pods of 8 GPUs each)")
    parser.add_argument("--variants", default="tp8,tp16")
    parser.add_argument("--systems", default="megafleet,lws")
    parser.add_argument("--ready", default="10", help="fleet counts for the Ready scenario (tiny CPU engines)")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--pod-network", default="127.160.0.0/12", help="a /12 no other cluster here uses")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--controllers",
        default="*",
        help="kube-controller-manager's --controllers (diagnostics only: the results record it)",
    )
    parser.add_argument(
        "--service-bounds",
        default="",
        help="megafleet once per value of its ClusterIP Service creates in flight (default: its default once)",
    )
    parser.add_argument(
        "--lws-template",
        choices=("engine", "minimal"),
        default="engine",
        help="LWS's pod: megafleet's engine pod (the same pods through both) or one bare container",
    )
    parser.add_argument("--keep-audit", type=Path, help="copy the API server's audit log here at the end")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on SIGTERM too
    group_counts = [int(n) for n in args.groups.split(",") if n]
    ready_counts = [int(n) for n in args.ready.split(",") if n]
    systems = [s for s in args.systems.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    bounds: list[int | None] = [int(b) for b in args.service_bounds.split(",") if b] or [None]
    if "lws" in systems:
        toolchain.ensure_built(("lws",), report=say)
    pools = (
        nodes.NodePool("h200", max([*group_counts, 1]) * PODS_PER_GROUP, 1, 8),
        nodes.NodePool("cpu", 1, max([*ready_counts, 1]), 0, "none", cpu="64", memory="256Gi"),
    )
    results: dict[str, Any] = {"benchmark": "controlplane", "machine": machine(), "placed": [], "ready": []}
    results["kube_controller_manager_controllers"] = args.controllers
    results["lws_pod_template"] = args.lws_template
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        policy, audit_log = state / "audit-policy.yaml", state / "audit.log"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        audit_args = (
            f"--audit-policy-file={policy}",
            f"--audit-log-path={audit_log}",
            "--audit-log-format=json",
            "--audit-log-maxsize=1000000",  # MB: never rotated (0 means 100 MB, which cut a 1,000-pod run's log)
        )
        cluster.START_TIMEOUT_SECONDS = 600.0  # 1,000 KWOK nodes take minutes to turn Ready on 2 busy cores
        local = cluster.LocalCluster(
            state / "cluster",
            pools=pools,
            pod_network=args.pod_network,
            report=say,
            apiserver_args=audit_args,
            controllers=args.controllers,
        )
        local.start()
        try:
            with local.kube() as client:
                client._http.headers["User-Agent"] = BENCH_AGENT  # its own writes are told apart in the audit log
                for info in v1alpha1.KINDS:
                    client.install_crd(crd.definition(info))
                bench = Bench(local, client, audit_log, state, args.lws_template)
                if "lws" in systems:
                    bench.prepare_lws()
                for groups in group_counts:  # in the order given: the largest first keeps what matters most
                    for variant in variants:
                        for system in systems:
                            for bound in bounds if system == "megafleet" else [None]:
                                idle = settle(local)
                                results["placed"].append(bench.placed(system, variant, groups, bound))
                                results["placed"][-1]["idle_control_plane_cpu_per_second_before"] = idle
                                _write(args.out, results)
                if ready_counts:
                    pod_runner = runner.Runner(client, state / "pods")
                    pod_runner.start()
                    try:
                        for count in ready_counts:
                            results["ready"].append(bench.ready(count, args.idle_seconds))
                            _write(args.out, results)
                    finally:
                        pod_runner.stop()
        finally:
            local.stop()
            if args.keep_audit is not None:
                shutil.copyfile(audit_log, args.keep_audit)
    _write(args.out, results)
    say(f"wrote {args.out}")
    return 0


def _write(path: Path, results: dict[str, Any]) -> None:
    """Written after every scenario, so a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
