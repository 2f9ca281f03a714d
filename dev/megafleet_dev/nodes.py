"""Simulated GPU nodes for KWOK: pools of nodes grouped into NVLink cliques.

Called by :mod:`megafleet_dev.cluster` when a local cluster starts. Node objects carry what
GPU Feature Discovery and the NVIDIA device plugin would publish on real hardware
(``nvidia.com/gpu`` capacity, ``nvidia.com/gpu.product``/``count``/``memory``/``clique`` labels),
and a pod CIDR inside 127.0.0.0/8 so that every pod IP KWOK hands out is a loopback address a
test process can listen on.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import uuid
from typing import Any

from megafleet_dev import toolchain

GPU_RESOURCE = "nvidia.com/gpu"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
POOL_LABEL = "megafleet.dev/pool"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT_KEY = "nvidia.com/gpu"

# GPU memory in MiB as GPU Feature Discovery reports it, by product label.
_GPU_MEMORY_MIB = {"NVIDIA-H200": 143771, "NVIDIA-H100-80GB-HBM3": 81559, "NVIDIA-GB200": 189471}


@dataclasses.dataclass(frozen=True)
class NodePool:
    """A group of identical nodes: ``cliques`` NVLink domains of ``nodes_per_clique`` nodes each."""

    name: str
    cliques: int
    nodes_per_clique: int
    gpus_per_node: int
    product: str = "NVIDIA-H200"
    cpu: str = "64"
    memory: str = "512Gi"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?", self.name):
            raise ValueError(f"pool name {self.name!r} must be a short DNS label (a-z, 0-9, '-')")
        if self.cliques < 1 or self.nodes_per_clique < 1:
            raise ValueError(f"pool {self.name!r} needs at least one clique of at least one node")
        if self.gpus_per_node < 0:
            raise ValueError(f"pool {self.name!r}: GPUs per node cannot be negative")

    @property
    def node_count(self) -> int:
        return self.cliques * self.nodes_per_clique

    @property
    def cluster_uuid(self) -> str:
        """Stable per pool, as the NVLink fabric manager's cluster UUID is stable per rack."""
        return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{self.name}.pools.megafleet.dev"))

    def clique_id(self, clique: int) -> str:
        return f"{self.cluster_uuid}.{clique}"

    @classmethod
    def parse(cls, text: str) -> NodePool:
        """Parse ``NAME:CLIQUESxNODES:GPUS[:PRODUCT]``, e.g. ``gb200:2x18:4:NVIDIA-GB200``."""
        match = re.fullmatch(r"([^:]+):(\d+)x(\d+):(\d+)(?::([A-Za-z0-9._-]+))?", text.strip())
        if match is None:
            raise ValueError(
                f"node pool {text!r} is not NAME:CLIQUESxNODES:GPUS[:PRODUCT] (for example h200:4x1:8:NVIDIA-H200)"
            )
        name, cliques, nodes, gpus, product = match.groups()
        return cls(name, int(cliques), int(nodes), int(gpus), product or "NVIDIA-H200")

    def __str__(self) -> str:
        return f"{self.name}:{self.cliques}x{self.nodes_per_clique}:{self.gpus_per_node}:{self.product}"


# H200 HGX nodes are NVLink domains of one node each; GB200 NVL72 racks are cliques of 18 trays
# of 4 GPUs; a small CPU pool hosts pods that need no GPU (the tiny demo fleet, tooling).
DEFAULT_POOLS: tuple[NodePool, ...] = (
    NodePool("h200", cliques=4, nodes_per_clique=1, gpus_per_node=8, product="NVIDIA-H200"),
    NodePool("gb200", cliques=2, nodes_per_clique=18, gpus_per_node=4, product="NVIDIA-GB200"),
    NodePool("cpu", cliques=1, nodes_per_clique=2, gpus_per_node=0, product="none", cpu="32", memory="128Gi"),
)


def pod_cidr(pod_network: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Network:
    """The ``index``-th /24 of ``pod_network``, which must lie inside 127.0.0.0/8."""
    if not pod_network.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
        raise ValueError(f"pod network {pod_network} must lie inside 127.0.0.0/8 (loopback)")
    subnet = ipaddress.IPv4Network((int(pod_network.network_address) + index * 256, 24))
    if not subnet.subnet_of(pod_network):
        raise ValueError(f"pod network {pod_network} has fewer than {index + 1} /24 subnets")
    return subnet


def node_manifests(pools: tuple[NodePool, ...], pod_network: ipaddress.IPv4Network) -> list[dict[str, Any]]:
    """Node objects for every node of every pool, with status KWOK keeps as given."""
    names = [pool.name for pool in pools]
    if len(set(names)) != len(names):
        raise ValueError(f"node pool names must be unique, got {names}")
    manifests: list[dict[str, Any]] = []
    for pool in pools:
        for clique in range(pool.cliques):
            for slot in range(pool.nodes_per_clique):
                name = f"{pool.name}-c{clique}-n{slot}"
                manifests.append(_node(pool, clique, name, pod_cidr(pod_network, len(manifests))))
    return manifests


def _node(pool: NodePool, clique: int, name: str, cidr: ipaddress.IPv4Network) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        POOL_LABEL: pool.name,
    }
    resources = {"cpu": pool.cpu, "memory": pool.memory, "pods": "110"}
    taints: list[dict[str, str]] = []
    if pool.gpus_per_node > 0:
        labels |= {
            "nvidia.com/gpu.present": "true",
            PRODUCT_LABEL: pool.product,
            COUNT_LABEL: str(pool.gpus_per_node),
            CLIQUE_LABEL: pool.clique_id(clique),
        }
        if pool.product in _GPU_MEMORY_MIB:
            labels[MEMORY_LABEL] = str(_GPU_MEMORY_MIB[pool.product])
        resources[GPU_RESOURCE] = str(pool.gpus_per_node)
        # GPU node pools are usually tainted so that only pods asking for GPUs land there.
        taints.append({"key": GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_ANNOTATION: "fake"}},
        "spec": {"podCIDR": str(cidr), "podCIDRs": [str(cidr)], "taints": taints},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": toolchain.KUBERNETES_VERSION,
                "kubeProxyVersion": toolchain.KUBERNETES_VERSION,
                "containerRuntimeVersion": "kwok",
                "kernelVersion": "",
                "osImage": "kwok",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }
