"""``megafleet dev down`` leaves nothing of a real node: no process in its cgroups or netns, no
host link or route, no cgroup; and the host's global sysctls and forwarding are untouched. The
NetworkPolicy engine's iptables chains and ipsets exist in the node's namespace only, never in the
host's, and go with it. The test tier's own stop (:func:`realnode.stop`) deletes the node's
containerd store and keeps the logs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import pod_networks
from megafleet_dev import cluster, netpolicy, realnode, sandbox

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(900)]

# Beside the tier's session cluster (its own slot), one of these clusters at a time.
NETWORKS = pod_networks.cluster_networks(pod_networks.session_network(), pod_networks.TEARDOWN_SLOT)

GLOBAL_SETTINGS = (
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/panic_on_oops",
    "/proc/sys/net/ipv4/ip_forward",
)


def read_settings() -> dict[str, str]:
    return {path: Path(path).read_text() for path in GLOBAL_SETTINGS}


def test_dev_down_removes_every_trace_of_the_real_node() -> None:
    before = read_settings()
    # A short folder: the kubelet's unix sockets live under it (about 100 bytes at most).
    state = Path(tempfile.mkdtemp(prefix="mf-down-"))
    local = cluster.LocalCluster(state, pools=(), pod_network=NETWORKS.kwok)
    local.start()
    try:
        # Only the pause image: this test is about the node's sandbox, not the engine.
        node = realnode.start(local, network=NETWORKS.real_node, targets=())
        box = sandbox.Sandbox.load(state)
        assert box is not None and box.holder_pid == node.holder_pid
        assert sandbox.leftovers(box)  # the node exists: processes, cgroups, the host link
        assert read_settings() == before  # the node's own forwarding and fake sysctls only
        routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
        assert str(node.addresses.pods) in routes and "default" not in _node_routes(node)
        assert all(f":{chain} " in netpolicy.filter_rules(node.holder_pid) for chain in netpolicy.CHAINS)
        assert _policy_engine_on_host() == []  # its rules and sets are the node namespace's own
    except BaseException:
        local.stop()
        raise
    down = subprocess.run(
        [sys.executable, "-m", "megafleet.cli", "dev", "--state-dir", str(state), "down"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    assert down.returncode == 0, down.stderr
    local.stop()  # finds nothing running; only collects the exit status of this process's children
    assert sandbox.leftovers(box) == []
    assert not state.exists()
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert str(node.addresses.pods) not in routes
    assert read_settings() == before
    assert _policy_engine_on_host() == []


def test_the_tier_stop_deletes_the_containerd_store_and_keeps_the_logs() -> None:
    state = Path(tempfile.mkdtemp(prefix="mf-stop-"))
    local = cluster.LocalCluster(state, pools=(), pod_network=NETWORKS.kwok)
    local.start()
    try:
        node = realnode.start(local, network=NETWORKS.real_node, targets=())
        assert "localhost/megafleet/pause:catatonit" in node.ctr("images", "ls", "-q").stdout.split()
        store = state / "realnode" / "containerd" / "root"
        assert _size(store) > 0  # the imported pause image: content and snapshot
        box = sandbox.Sandbox.load(state)
        assert box is not None
    finally:
        realnode.stop(local)
    try:
        assert sandbox.leftovers(box) == []
        for folder in realnode.runtime_dirs(state):
            assert not folder.exists()
        assert any((state / "logs").iterdir())  # what a failed run needs to read stays
    finally:
        shutil.rmtree(state)


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _node_routes(node: realnode.RealNode) -> str:
    return sandbox.in_node(node.holder_pid, "ip", "route").stdout


def _policy_engine_on_host() -> list[str]:
    """kube-router's chains, rules and sets as the host's own namespace has them (it must have none)."""
    tables = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True, check=True).stdout
    sets = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True, check=True).stdout
    chains = ("KUBE-ROUTER", "KUBE-NWPLCY", "KUBE-POD-FW")
    rules = [line for line in tables.splitlines() if any(chain in line for chain in chains)]
    return rules + [name for name in sets.split() if name.startswith(("KUBE-", "kube-router"))]
