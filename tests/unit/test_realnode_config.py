"""The real node's pure parts: its addresses, the image input hash, and the settings that keep the
node inside its namespace (no global sysctl written, no route out)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from helpers import pod_networks
from megafleet_dev import images, realnode, sandbox


def test_addresses_come_from_one_range_and_never_overlap() -> None:
    addresses = realnode.Addresses.from_network("10.214.0.0/16")
    assert str(addresses.pods) == "10.214.0.0/24"
    assert (addresses.host_ip, addresses.node_ip) == ("10.214.255.253", "10.214.255.254")
    assert ipaddress.ip_address(addresses.node_ip) not in addresses.pods
    with pytest.raises(ValueError, match="/16"):
        realnode.Addresses.from_network("10.214.0.0/24")


def test_the_kubernetes_service_endpoint_is_the_forwarder_on_the_node_ip() -> None:
    addresses = realnode.Addresses.from_network("10.214.0.0/16")
    body = realnode.apiserver_slice(addresses)
    assert body["metadata"]["labels"]["kubernetes.io/service-name"] == "kubernetes"  # type: ignore[index]
    assert body["endpoints"] == [{"addresses": ["10.214.255.254"], "conditions": {"ready": True}}]
    # The Service's port is named https (443 -> 6443): the slice's port name must match it.
    assert body["ports"] == [{"name": "https", "port": realnode.API_PORT_IN_NODE, "protocol": "TCP"}]


def test_test_sessions_on_other_pod_networks_never_share_a_cluster_network() -> None:
    # Every /12 but 127.0.0.0/12 (127.0.0.1) and the dev cluster's 127.64.0.0/12 can be a session's.
    sessions = [f"127.{16 * k}.0.0/12" for k in range(1, 16) if k != 4]
    dev = [ipaddress.IPv4Network("127.64.0.0/12"), ipaddress.IPv4Network(realnode.DEFAULT_NETWORK)]
    taken = list(dev)
    for session in sessions:
        # The e2e tier's KWOK nodes: the first /24s of the session network.
        e2e = next(ipaddress.IPv4Network(session).subnets(new_prefix=16))
        for slot in (pod_networks.REALNODE_SLOT, pod_networks.TEARDOWN_SLOT):
            networks = pod_networks.cluster_networks(session, slot)
            for network in (ipaddress.IPv4Network(networks.kwok), ipaddress.IPv4Network(networks.real_node)):
                assert not any(network.overlaps(other) for other in taken), (session, slot, network)
                assert not network.overlaps(e2e)
                taken.append(network)
            realnode.Addresses.from_network(networks.real_node)  # a /16 the node accepts
    default = pod_networks.cluster_networks("127.128.0.0/12", pod_networks.REALNODE_SLOT)
    assert default == pod_networks.ClusterNetworks(kwok="127.142.0.0/16", real_node="10.142.0.0/16")
    assert pod_networks.cluster_networks("127.200.0.0/16", 14) == pod_networks.cluster_networks("127.192.0.0/12", 14)
    with pytest.raises(ValueError, match="loopback"):
        pod_networks.cluster_networks("10.0.0.0/12", 14)


def test_the_image_key_follows_contents_and_ignores_caches(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "Dockerfile").write_text("FROM scratch AS s\n")
    files = images.context_files(tmp_path, ("Dockerfile", "pkg"))
    assert files == [Path("Dockerfile"), Path("pkg/a.py")]
    key = images.content_key(tmp_path, files, "engine")
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"cache")
    assert images.content_key(tmp_path, images.context_files(tmp_path, ("Dockerfile", "pkg")), "engine") == key
    assert images.content_key(tmp_path, files, "operator") != key
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert images.content_key(tmp_path, files, "engine") != key


def test_the_kubelet_is_kept_from_global_kernel_settings(tmp_path: Path) -> None:
    addresses = realnode.Addresses.from_network(realnode.DEFAULT_NETWORK)
    config = realnode.kubelet_config(
        tmp_path, addresses, socket=tmp_path / "c.sock", client_ca=tmp_path / "ca.crt", cgroup="/megafleet-node-x"
    )
    assert config["protectKernelDefaults"] is False and config["makeIPTablesUtilChains"] is False
    assert config["oomScoreAdj"] == 0  # no CAP_SYS_RESOURCE in this sandbox
    assert config["clusterDNS"] == [addresses.node_ip] and config["address"] == addresses.node_ip
    # The sysctls the kubelet would set are faked inside the node's mount namespace instead.
    assert set(sandbox.FAKE_SYSCTLS) == {"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"}
    proxy = realnode.kube_proxy_config(tmp_path, addresses)
    conntrack = proxy["conntrack"]
    assert isinstance(conntrack, dict) and conntrack["maxPerCore"] == 0 and conntrack["min"] == 0


def test_pods_route_only_to_the_bridge_and_dns_has_no_upstream(tmp_path: Path) -> None:
    addresses = realnode.Addresses.from_network(realnode.DEFAULT_NETWORK)
    plugins = realnode.cni_config(addresses, tmp_path)["plugins"]
    assert isinstance(plugins, list)
    bridge = plugins[0]
    assert bridge["ipam"]["ranges"] == [[{"subnet": str(addresses.pods)}]] and bridge["ipMasq"] is False
    corefile = realnode.corefile(addresses, tmp_path / "kubeconfig")
    assert f"bind {addresses.node_ip}" in corefile and "forward" not in corefile
