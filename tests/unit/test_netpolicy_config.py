"""The real node's NetworkPolicy engine, its pure parts: kube-router started as a firewall alone, and
the reading of its rules that tells when a pod is guarded by a policy."""

from __future__ import annotations

from pathlib import Path

from megafleet_dev import cluster, netpolicy, realnode

# Shaped as iptables-save writes kube-router's rules for a guarded pod (10.213.0.7) and for a pod
# that no policy selects (10.213.0.8: its chain runs the default chain only).
RULES = """*filter
:KUBE-ROUTER-FORWARD - [0:0]
:KUBE-POD-FW-GUARDED - [0:0]
:KUBE-POD-FW-OPEN - [0:0]
-A KUBE-ROUTER-FORWARD -d 10.213.0.7/32 -m comment --comment "to POD name:a" -j KUBE-POD-FW-GUARDED
-A KUBE-ROUTER-FORWARD -d 10.213.0.8/32 -m comment --comment "to POD name:b" -j KUBE-POD-FW-OPEN
-A KUBE-POD-FW-GUARDED -m comment --comment "run through nw policy megafleet-rn-agents" -j KUBE-NWPLCY-ABCDEF
-A KUBE-POD-FW-OPEN -m comment --comment "run through default ingress" -d 10.213.0.8/32 -j KUBE-NWPLCY-DEFAULT
COMMIT
"""


def test_kube_router_runs_its_firewall_alone_on_the_node(tmp_path: Path) -> None:
    argv = netpolicy.command(tmp_path / "kube-router.kubeconfig", realnode.NODE_NAME, cluster.SERVICE_CIDR)
    assert argv[0].endswith("/kube-router")
    flags = set(argv[1:])
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false", "--enable-ipv6=false"} <= flags
    assert f"--hostname-override={realnode.NODE_NAME}" in flags
    assert f"--service-cluster-ip-range={cluster.SERVICE_CIDR}" in flags
    assert {"--health-port=0", "--metrics-port=0"} <= flags  # no listener of its own in the node
    assert "kube-router" in realnode.PROGRAMS  # built with the node's programs


def test_a_pod_counts_as_guarded_only_through_a_policy_chain() -> None:
    assert netpolicy.guarded(RULES, "10.213.0.7")
    assert not netpolicy.guarded(RULES, "10.213.0.8")  # the default chain lets everything through
    assert not netpolicy.guarded(RULES, "10.213.0.70")  # no rule for that address at all
    assert not netpolicy.guarded("", "10.213.0.7")
