"""A real CPU node in the local cluster: containerd + runc + CNI bridge, a kubelet registered with
the API server by a client certificate (Node authorizer, NodeRestriction, RBAC), kube-proxy for
ClusterIP Services, CoreDNS for ``<service>.<namespace>.svc`` names and a NetworkPolicy engine
(:mod:`megafleet_dev.netpolicy`), all inside a network and mount namespace this module makes
(:mod:`megafleet_dev.sandbox`).

Called by ``megafleet dev up --real-node`` and the ``realnode`` test tier, after
:meth:`cluster.LocalCluster.start`. Every program is a process of the cluster (stopped by
``megafleet dev down``); the containers, namespaces, link and cgroups are removed by
:func:`sandbox.teardown`, which ``LocalCluster.stop`` runs first. The node's containerd store (the
imported images, about twice the engine image's 6 GB) lives in the state folder: ``dev down``
deletes the folder, :func:`stop` (the test tier) deletes the store and keeps the logs.

Network (``network``, a /16 of which two parts are used; the defaults are 10.213.0.0/16):
pods get the first /24 behind a bridge; the host and the node share a /30 at the end of the range
(host .1, node .2); the host routes the pod /24 to the node, so the operator and the tests reach
pod IPs; nothing routes anywhere else. The API server stays on host loopback: a forwarder
(:mod:`megafleet_dev.forward`) listens on 127.0.0.1:6443 and on the node IP inside the node, and
is the ``kubernetes`` Service's endpoint (:func:`apiserver_slice`), so in-cluster clients work.
The node is a CPU node labelled ``megafleet.dev/real-node=true``; KWOK's simulated nodes stay for
GPU placement. What this sandbox forces (cgroup v1, no CAP_SYS_RESOURCE, global sysctls) is
handled here and in the kubelet configuration only; nothing in the chart or pod spec bends to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megafleet_dev import builds, cluster, images, kube, netpolicy, pki, progress, sandbox, toolchain

NODE_NAME = "megafleet-node-0"
REAL_NODE_LABEL = "megafleet.dev/real-node"
DEFAULT_NETWORK = "10.213.0.0/16"
API_PORT_IN_NODE = 6443
CLUSTER_DOMAIN = "cluster.local"
CTR_NAMESPACE = "k8s.io"
# In the node's private /run (a tmpfs of its mount namespace): short (unix socket paths are limited
# to about 100 bytes, and a test's state folder is long), and invisible on the host.
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
PROGRAMS = ("node", "coredns", "kube-router")  # toolchain components the real node runs
APISERVER_SLICE = "megafleet-dev-apiserver"
"""The EndpointSlice that gives the ``kubernetes`` Service its endpoint (:func:`apiserver_slice`)."""


@dataclasses.dataclass(frozen=True)
class Addresses:
    """The node's addresses, derived from one /16 (pure)."""

    pods: ipaddress.IPv4Network
    host_ip: str
    node_ip: str

    @classmethod
    def from_network(cls, network: str) -> Addresses:
        net = ipaddress.IPv4Network(network)
        if net.prefixlen > 16:
            raise ValueError(f"the real node's network {network} must be a /16 or larger")
        pods = next(net.subnets(new_prefix=24))
        transit = list(net.subnets(new_prefix=30))[-1]
        host, node = list(transit.hosts())
        return cls(pods=pods, host_ip=str(host), node_ip=str(node))


@dataclasses.dataclass(frozen=True)
class RealNode:
    """A started real node: what tests and ``dev up`` need to reach it."""

    name: str
    addresses: Addresses
    holder_pid: int
    containerd_socket: Path
    cgroup: str

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against the node's containerd (inside the node's namespaces)."""
        return sandbox.in_node(
            self.holder_pid, "ctr", "-a", str(self.containerd_socket), "-n", CTR_NAMESPACE, *args, check=check
        )


def _names(state_dir: Path) -> tuple[str, str, str]:
    """Host link, node link and cgroup names, unique per state dir (two clusters may coexist)."""
    tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:6]
    return f"mfh-{tag}", f"mfn-{tag}", f"/megafleet-node-{tag}"


def _kubeconfig(path: Path, *, server: str, ca: Path, cert: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [
            {
                "name": "node",
                "user": {
                    "client-certificate": str(cert.with_suffix(".crt")),
                    "client-key": str(cert.with_suffix(".key")),
                },
            }
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "node"}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(config, indent=2))


def containerd_config(folder: Path, *, socket: Path, pause_image: str) -> str:
    """containerd 1.6's configuration: own root, state and socket; runc; CNI from Debian's plugins;
    ``restrict_oom_score_adj`` (no CAP_SYS_RESOURCE here: sandboxes cannot get -998)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{folder / "root"}"
state = "{folder / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{socket}"
[{cri}]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{folder / "cni"}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.internal.v1.opt"]
  path = "{folder / "opt"}"
"""


def cni_config(addresses: Addresses, ipam_dir: Path) -> dict[str, object]:
    """One bridge with host-local addresses; pods' default route is the bridge (the node drops
    whatever is not for a pod, a Service, the node or the host link)."""
    return {
        "cniVersion": "0.4.0",
        "name": "megafleet",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "mfbr0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(addresses.pods)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    folder: Path, addresses: Addresses, *, socket: Path, client_ca: Path, cgroup: str
) -> dict[str, object]:
    """The KubeletConfiguration. Sandbox-only settings, each needed on this kind of machine:
    ``failCgroupV1: false`` (cgroup v1 host), ``oomScoreAdj: 0`` (no CAP_SYS_RESOURCE),
    ``protectKernelDefaults: false`` with the global sysctls faked in the node's mount namespace,
    ``makeIPTablesUtilChains: false``, and a cgroup parent of the node's own."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "containerRuntimeEndpoint": f"unix://{socket}",
        "imageServiceEndpoint": f"unix://{socket}",
        "podLogsDir": str(folder / "pod-logs"),
        "address": addresses.node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [addresses.node_ip],
        "resolvConf": "",
        "oomScoreAdj": 0,
        "protectKernelDefaults": False,
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "maxPods": 30,
        "syncFrequency": "10s",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
    }


def kube_proxy_config(folder: Path, addresses: Addresses) -> dict[str, object]:
    """iptables mode inside the node netns. ``masqueradeAll`` makes a pod reaching a Service that
    lands on a pod of the same bridge work without bridge netfilter; the conntrack settings at 0
    keep kube-proxy from writing (global) conntrack sysctls."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(folder / "kube-proxy.kubeconfig")},
        "hostnameOverride": NODE_NAME,
        "bindAddress": addresses.node_ip,
        "clusterCIDR": str(addresses.pods),
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{addresses.node_ip}/32"],
        "iptables": {"masqueradeAll": True, "localhostNodePorts": False, "syncPeriod": "10s", "minSyncPeriod": "0s"},
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
            "udpTimeout": "0s",
            "udpStreamTimeout": "0s",
        },
    }


def corefile(addresses: Addresses, kubeconfig: Path) -> str:
    """Cluster DNS only: no upstream (pods reach nothing outside the node)."""
    return f""".:53 {{
    bind {addresses.node_ip}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


_RBAC: list[tuple[str, dict[str, object]]] = [
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": "megafleet:apiserver-kubelet-client"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:kubelet-api-admin",
            },
            "subjects": [
                {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": cluster.KUBELET_CLIENT_USER}
            ],
        },
    ),
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        {
            "metadata": {"name": "megafleet:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "pods", "namespaces", "endpoints"],
                    "verbs": ["list", "watch"],
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            ],
        },
    ),
    (
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        {
            "metadata": {"name": "megafleet:coredns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "megafleet:coredns"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "megafleet:coredns"}],
        },
    ),
]


def apiserver_slice(addresses: Addresses) -> dict[str, object]:
    """The ``kubernetes`` Service's endpoint: the API server forwarder on the node's IP (pure).

    The local API server listens on host loopback, which pods cannot reach, so it publishes no
    endpoint itself (``--endpoint-reconciler-type=none``); with this one, in-cluster clients
    (``KUBERNETES_SERVICE_HOST``, ``kubernetes.default.svc``) reach it through kube-proxy as on a
    real cluster. The Service has no selector, so no controller manages or removes the slice."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": APISERVER_SLICE,
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "megafleet-dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [addresses.node_ip], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": API_PORT_IN_NODE, "protocol": "TCP"}],
    }


def _publish_apiserver(client: kube.Kube, addresses: Addresses) -> None:
    """Create :func:`apiserver_slice`, or point an existing one (a node started before on another
    network in the same cluster) at this node."""
    path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    body = apiserver_slice(addresses)
    if client.get(f"{path}/{APISERVER_SLICE}") is None:
        client.create(path, body)
    else:
        client.patch(f"{path}/{APISERVER_SLICE}", {"endpoints": body["endpoints"], "ports": body["ports"]})


def start(
    local: cluster.LocalCluster,
    *,
    network: str = DEFAULT_NETWORK,
    targets: tuple[str, ...] = images.TARGETS,
    report: progress.Progress = progress.print_progress,
) -> RealNode:
    """Build what is missing, start the node's programs in a fresh sandbox, import the images,
    wait until the node is Ready. On failure everything made so far is torn down."""
    built = builds.ensure_all(PROGRAMS, targets, report).images
    started = time.monotonic()
    addresses = Addresses.from_network(network)
    host_link, node_link, cgroup = _names(local.state_dir)
    if Path(f"/sys/class/net/{host_link}").exists():
        raise cluster.ClusterError(
            f"a real node of {local.state_dir} still exists ({host_link}); run megafleet dev down"
        )
    folder = local.state_dir / "realnode"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        node = _start(local, folder, addresses, host_link, node_link, cgroup, report)
        _import_images(node, built, folder / "containerd", report)
        _wait_ready(local, report)
        netpolicy.start(local, node.holder_pid, NODE_NAME, folder / "kube-router.kubeconfig", report)
    except BaseException:
        sandbox.teardown(local.state_dir)
        raise
    report(f"real node {NODE_NAME} Ready in {time.monotonic() - started:.1f} s (pods {addresses.pods})")
    return node


def runtime_dirs(state_dir: Path) -> list[Path]:
    """The node's bulky data under a cluster's state folder: containerd's store (content and
    snapshots of the imported images) and the kubelet's pod folders."""
    folder = state_dir / "realnode"
    return [folder / "containerd", folder / "kubelet"]


def stop(local: cluster.LocalCluster) -> None:
    """Stop the cluster with its real node (``LocalCluster.stop``), then delete the node's
    :func:`runtime_dirs` (12 GB with the engine image), which would otherwise stay in the state
    folder; the configuration and logs stay. Called by the realnode test tier."""
    local.stop()
    mounts = Path("/proc/self/mountinfo").read_text().split("\n")
    for folder in runtime_dirs(local.state_dir):
        # The node's mounts lived in its own mount namespace, gone with its last process; a mount
        # seen here would be deleted through, so it stops the removal instead.
        if any(f" {folder}/" in line or f" {folder} " in line for line in mounts):
            raise cluster.ClusterError(f"{folder} still has mounts; not deleting it")
        shutil.rmtree(folder, ignore_errors=True)


def _certificates(local: cluster.LocalCluster, folder: Path, addresses: Addresses) -> dict[str, Path]:
    """Client certificates and kubeconfigs of the node's programs (paths without suffix)."""
    certs = {
        "kubelet": (f"system:node:{NODE_NAME}", ("system:nodes",)),
        "kube-proxy": ("system:kube-proxy", ()),  # bound to system:node-proxier by the bootstrap policy
        "coredns": ("megafleet:coredns", ()),
        "kube-router": (netpolicy.USER, ()),
    }
    server = f"https://127.0.0.1:{API_PORT_IN_NODE}"
    paths: dict[str, Path] = {}
    for name, (user, groups) in certs.items():
        pki.issue(local.client_ca, folder / f"{name}-client", user, groups)
        _kubeconfig(folder / f"{name}.kubeconfig", server=server, ca=local.ca_file, cert=folder / f"{name}-client")
        paths[name] = folder / f"{name}.kubeconfig"
    return paths


def _start(
    local: cluster.LocalCluster,
    folder: Path,
    addresses: Addresses,
    host_link: str,
    node_link: str,
    cgroup: str,
    report: progress.Progress,
) -> RealNode:
    kubeconfigs = _certificates(local, folder, addresses)
    with local.kube() as client:
        for path, body in _RBAC:
            if client.get(f"{path}/{body['metadata']['name']}") is None:  # type: ignore[index]
                client.create(path, body)
        _publish_apiserver(client, addresses)
    fakes = {}
    for key, value in sandbox.FAKE_SYSCTLS.items():
        fake = folder / "sysctl" / key.replace("/", ".")
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(value + "\n")
        fakes[key] = fake
    holder = local.spawn("node-namespace", ["sleep", "infinity"], preexec_fn=sandbox.holder_preexec(fakes))
    _wait_namespaced(holder.pid)
    box = sandbox.Sandbox(holder.pid, sandbox.netns_inode(holder.pid), host_link, cgroup)
    box.save(local.state_dir)
    sandbox.make_cgroups(cgroup)
    sandbox.connect(holder.pid, host_link, node_link, addresses.host_ip, addresses.node_ip, str(addresses.pods))
    enter = sandbox.enter_preexec(holder.pid, folder)
    local.spawn(
        "node-api-forwarder",
        [
            sys.executable,
            "-m",
            "megafleet_dev.forward",
            str(holder.pid),
            str(local.api_port),
            f"127.0.0.1:{API_PORT_IN_NODE}",
            f"{addresses.node_ip}:{API_PORT_IN_NODE}",
        ],
    )

    runtime = folder / "containerd"
    (runtime / "cni").mkdir(parents=True, exist_ok=True)
    (runtime / "cni" / "10-megafleet.conflist").write_text(json.dumps(cni_config(addresses, runtime / "ipam")))
    socket = CONTAINERD_SOCKET
    config = containerd_config(runtime, socket=socket, pause_image=images.PAUSE_REFERENCE)
    (runtime / "config.toml").write_text(config)
    local.spawn("containerd", ["containerd", "--config", str(runtime / "config.toml")], preexec_fn=enter)
    local.wait_for("containerd", lambda: None if _node_has(holder.pid, socket) else "no socket yet")
    node = RealNode(NODE_NAME, addresses, holder.pid, socket, cgroup)

    (folder / "kubelet.yaml").write_text(
        json.dumps(
            kubelet_config(
                folder, addresses, socket=socket, client_ca=local.client_ca.with_suffix(".crt"), cgroup=cgroup
            )
        )
    )
    (folder / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(folder, addresses)))
    (folder / "Corefile").write_text(corefile(addresses, kubeconfigs["coredns"]))
    labels = f"{REAL_NODE_LABEL}=true,megafleet.dev/pool=real"
    local.spawn(
        "kubelet",
        [
            str(toolchain.program_path("kubelet")),
            f"--config={folder / 'kubelet.yaml'}",
            f"--kubeconfig={kubeconfigs['kubelet']}",
            f"--root-dir={folder / 'kubelet'}",
            f"--cert-dir={folder / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={addresses.node_ip}",
            f"--node-labels={labels}",
            "--v=1",
        ],
        preexec_fn=enter,
    )
    local.spawn(
        "kube-proxy",
        [str(toolchain.program_path("kube-proxy")), f"--config={folder / 'kube-proxy.yaml'}", "--v=1"],
        preexec_fn=enter,
    )
    local.spawn(
        "coredns", [str(toolchain.program_path("coredns")), "-conf", str(folder / "Corefile")], preexec_fn=enter
    )
    return node


def _node_has(holder_pid: int, path: Path) -> bool:
    """Whether ``path`` exists in the node's mount namespace (through the holder's root)."""
    return Path(f"/proc/{holder_pid}/root{path}").exists()


def _wait_namespaced(pid: int) -> None:
    deadline = time.monotonic() + 10
    own = sandbox.netns_inode(os.getpid())
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep") and sandbox.netns_inode(pid) != own:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise cluster.ClusterError("the real node's namespace holder did not start")


def import_needs_gb(archive_bytes: int) -> float:
    """Free GB importing an archive of this size needs: containerd keeps the layers twice, in its
    content store and unpacked as snapshots (measured: docs/development.md, "Real containers") (pure)."""
    return 2 * archive_bytes / 1e9 + 1.0


def _import_images(node: RealNode, built: list[images.Image], store: Path, report: progress.Progress) -> None:
    """Import each image archive into the node's containerd, whose store is ``store`` (skipped
    when the same image is there; a clear error first when the disk cannot hold them)."""
    present = node.ctr("images", "ls", "-q").stdout.split()
    missing = [image for image in built if f"localhost/megafleet/{image.target}:{image.key}" not in present]
    needs = import_needs_gb(sum(image.archive.stat().st_size for image in missing))
    images.require_free(needs, "importing the images into the real node's containerd", store)
    for image in missing:
        started = time.monotonic()
        node.ctr("images", "import", str(image.archive))  # names: the reference and the marker
        report(f"imported the {image.target} image into the node's containerd in {time.monotonic() - started:.0f} s")


def _wait_ready(local: cluster.LocalCluster, report: progress.Progress) -> None:
    def not_ready() -> str | None:
        with local.kube() as client:
            node = client.get(f"/api/v1/nodes/{NODE_NAME}")
        if node is None:
            return "not registered yet"
        ready = kube.condition(node, "Ready") or {}
        return None if ready.get("status") == "True" else f"Ready={ready.get('status')}: {ready.get('message')}"

    local.wait_for("kubelet", not_ready)
