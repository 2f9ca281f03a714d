"""The real node's NetworkPolicy engine: kube-router's network policy controller alone (built without
its router and service proxy: ``gomod/kube-router/main.go``), so the cluster's NetworkPolicies, the
chart's agent policy among them, hold for the node's pods as under a CNI that enforces them.

Called by :func:`megafleet_dev.realnode.start` once the node is Ready (the controller reads the
node's Node object for its address), and by the realnode tests that look at its rules. It runs
inside the node's network and mount namespaces like the node's other programs. Its iptables rules
and ipsets are the node namespace's own: the pods' bridge and veths live there, and bridged traffic
between two pods passes that namespace's iptables through bridge netfilter, a per-namespace setting
(on by default in a new namespace) that is read here, never written. Nothing reaches the host's
tables; the rules and sets go with the namespace when :func:`sandbox.teardown` ends its last process.

Only what a policy selects is filtered: a pod no policy selects is reached as before. A pod a policy
selects is reached from the node itself (the kubelet's probes) and from peers the policy names;
anything else gets a TCP reset (kube-router's REJECT). The operator on the host is not a pod: the
chart's policy, which names the operator's pods, refuses it, as it would on a real cluster.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megafleet_dev import cluster, progress, sandbox, toolchain

PROCESS = "kube-router"
USER = "megafleet:kube-router"
"""The engine's client certificate user, bound to :data:`RBAC`'s ClusterRole."""
CHAINS = ("KUBE-ROUTER-INPUT", "KUBE-ROUTER-FORWARD", "KUBE-ROUTER-OUTPUT", "KUBE-NWPLCY-DEFAULT")
"""The chains the controller makes before its first sync."""
BRIDGE_NETFILTER = "/proc/sys/net/bridge/bridge-nf-call-iptables"

_ROLES = "/apis/rbac.authorization.k8s.io/v1/clusterroles"
_BINDINGS = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"
# What the controller reads: pods, namespaces and policies (watched), and the node's own Node object.
RBAC: list[tuple[str, dict[str, object]]] = [
    (
        _ROLES,
        {
            "metadata": {"name": USER},
            "rules": [
                {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
                {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]},
            ],
        },
    ),
    (
        _BINDINGS,
        {
            "metadata": {"name": USER},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": USER},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        },
    ),
]


def command(kubeconfig: Path, node_name: str, service_cidr: str) -> list[str]:
    """kube-router's command line: the firewall only, IPv4, no health or metrics listener (pure).
    The periodic resync stays at its default: pod and policy events start a sync at once."""
    return [
        str(toolchain.program_path("kube-router")),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--run-loadbalancer=false",
        "--enable-cni=false",
        "--enable-ipv4=true",
        "--enable-ipv6=false",
        f"--service-cluster-ip-range={service_cidr}",
        "--health-port=0",
        "--metrics-port=0",
        "--v=1",
    ]


def start(
    local: cluster.LocalCluster, holder_pid: int, node_name: str, kubeconfig: Path, report: progress.Progress
) -> None:
    """Start the engine in the node's namespaces (``holder_pid``'s) with ``kubeconfig`` (a client
    certificate of :data:`USER`); return once its chains exist."""
    _require_host_tools(holder_pid)
    with local.kube() as client:
        for path, body in RBAC:
            if client.get(f"{path}/{body['metadata']['name']}") is None:  # type: ignore[index]
                client.create(path, body)
    folder = kubeconfig.parent
    local.spawn(
        PROCESS,
        command(kubeconfig, node_name, cluster.SERVICE_CIDR),
        preexec_fn=sandbox.enter_preexec(holder_pid, folder),
    )
    local.wait_for(PROCESS, lambda: _not_ready(holder_pid))
    report(f"NetworkPolicy engine (kube-router {toolchain.KUBE_ROUTER_VERSION} firewall) running in the real node")


def _require_host_tools(holder_pid: int) -> None:
    """What kube-router runs and needs from the kernel, with the fix for each."""
    for program in ("iptables", "iptables-save", "iptables-restore", "ipset"):
        if shutil.which(program) is None:
            raise cluster.ClusterError(
                f"{program} is not installed: the real node's NetworkPolicy engine runs it "
                "(Debian: apt-get install iptables ipset)"
            )
    seen = sandbox.in_node(holder_pid, "cat", BRIDGE_NETFILTER, check=False)
    if seen.returncode != 0 or seen.stdout.strip() != "1":
        raise cluster.ClusterError(
            f"{BRIDGE_NETFILTER} is {seen.stdout.strip() or 'missing'} in the real node's network namespace: "
            "without bridge netfilter, traffic between two pods of the node bypasses iptables and no "
            "NetworkPolicy holds between them (a kernel with br_netfilter sets it to 1 in every new namespace)"
        )


def _not_ready(holder_pid: int) -> str | None:
    missing = [
        chain for chain in CHAINS if sandbox.in_node(holder_pid, "iptables", "-S", chain, check=False).returncode != 0
    ]
    return f"chains {', '.join(missing)} not made yet" if missing else None


def filter_rules(holder_pid: int) -> str:
    """The node namespace's filter table as ``iptables-save`` writes it."""
    return sandbox.in_node(holder_pid, "iptables-save", "-t", "filter").stdout


def ipsets(holder_pid: int) -> list[str]:
    """The names of the node namespace's ipsets (kube-router's only)."""
    return sandbox.in_node(holder_pid, "ipset", "list", "-n").stdout.split()


def guards(holder_pid: int, pod_ip: str) -> bool:
    """Whether the engine filters traffic to ``pod_ip`` through a policy (:func:`guarded`)."""
    return guarded(filter_rules(holder_pid), pod_ip)


def guarded(rules: str, pod_ip: str) -> bool:
    """Whether ``rules`` (``iptables-save`` of a filter table) send traffic to ``pod_ip`` through
    a network policy's chain: a jump for that destination from kube-router's forward chain to the
    pod's firewall chain, which runs a policy chain other than the default one (pure)."""
    lines = rules.splitlines()
    pod_chains = {
        line.rsplit(" -j ", 1)[1].strip()
        for line in lines
        if line.startswith("-A KUBE-ROUTER-FORWARD ") and f"-d {pod_ip}/32 " in line and " -j " in line
    }
    return any(
        line.startswith(f"-A {chain} ") and " -j KUBE-NWPLCY-" in line and " -j KUBE-NWPLCY-DEFAULT" not in line
        for chain in pod_chains
        for line in lines
    )
