"""Simulated node pools: parsing and the Node objects handed to KWOK."""

from __future__ import annotations

import ipaddress

import pytest

from megafleet_dev import nodes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gb200:2x18:4:NVIDIA-GB200", nodes.NodePool("gb200", 2, 18, 4, "NVIDIA-GB200")),
        ("h200:4x1:8", nodes.NodePool("h200", 4, 1, 8, "NVIDIA-H200")),
        ("cpu:1x2:0:none", nodes.NodePool("cpu", 1, 2, 0, "none")),
    ],
    ids=["gb200", "default-product", "cpu"],
)
def test_pool_parses(text: str, expected: nodes.NodePool) -> None:
    assert nodes.NodePool.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "phrase"),
    [
        ("gb200", "NAME:CLIQUESxNODES:GPUS"),
        ("gb200:2x18", "NAME:CLIQUESxNODES:GPUS"),
        ("Bad_Name:1x1:8", "DNS label"),
        ("g:0x4:8", "at least one clique"),
    ],
    ids=["name-only", "no-gpus", "bad-name", "zero-cliques"],
)
def test_bad_pool_is_rejected_with_the_expected_form(text: str, phrase: str) -> None:
    with pytest.raises(ValueError, match=phrase):
        nodes.NodePool.parse(text)


def test_manifests_group_nodes_into_cliques_with_loopback_pod_cidrs() -> None:
    pools = (nodes.NodePool("gb200", 2, 3, 4, "NVIDIA-GB200"), nodes.NodePool("cpu", 1, 1, 0, "none"))
    manifests = nodes.node_manifests(pools, ipaddress.IPv4Network("127.64.0.0/12"))

    assert [m["metadata"]["name"] for m in manifests] == [
        "gb200-c0-n0",
        "gb200-c0-n1",
        "gb200-c0-n2",
        "gb200-c1-n0",
        "gb200-c1-n1",
        "gb200-c1-n2",
        "cpu-c0-n0",
    ]
    cidrs = [ipaddress.IPv4Network(m["spec"]["podCIDR"]) for m in manifests]
    assert len(set(cidrs)) == len(cidrs)
    assert all(cidr.subnet_of(ipaddress.IPv4Network("127.64.0.0/12")) for cidr in cidrs)
    gpu_nodes = manifests[:6]
    cliques = [m["metadata"]["labels"][nodes.CLIQUE_LABEL] for m in gpu_nodes]
    assert len(set(cliques[:3])) == 1 and len(set(cliques[3:])) == 1 and cliques[0] != cliques[3]
    assert cliques[0] == f"{pools[0].cluster_uuid}.0"
    assert all(m["status"]["allocatable"][nodes.GPU_RESOURCE] == "4" for m in gpu_nodes)
    assert all(m["spec"]["taints"][0]["key"] == nodes.GPU_TAINT_KEY for m in gpu_nodes)
    cpu = manifests[6]
    assert nodes.GPU_RESOURCE not in cpu["status"]["allocatable"]
    assert nodes.CLIQUE_LABEL not in cpu["metadata"]["labels"]
    assert cpu["spec"]["taints"] == []


def test_pod_network_must_be_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        nodes.node_manifests(nodes.DEFAULT_POOLS, ipaddress.IPv4Network("10.0.0.0/16"))


def test_pod_network_too_small_is_rejected() -> None:
    with pytest.raises(ValueError, match="fewer than"):
        nodes.node_manifests(nodes.DEFAULT_POOLS, ipaddress.IPv4Network("127.1.0.0/23"))


def test_duplicate_pool_names_are_rejected() -> None:
    pool = nodes.NodePool("a", 1, 1, 8)
    with pytest.raises(ValueError, match="unique"):
        nodes.node_manifests((pool, pool), ipaddress.IPv4Network("127.64.0.0/12"))
