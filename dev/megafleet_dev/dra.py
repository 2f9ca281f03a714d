"""NVIDIA's ComputeDomain API on the local cluster, for the DRA tier (``tests/e2e/test_compute_domains.py``).

What runs for real: kube-apiserver serving ``resource.k8s.io/v1`` (DRA is GA in the pinned
Kubernetes), kube-controller-manager's ResourceClaim controller (one claim per pod from the
template a pod names), and kube-scheduler's DRA plugin, which allocates every claim from the
ResourceSlices published here before it binds the pod. What is stood in for, because NVIDIA's
driver (``github.com/NVIDIA/k8s-dra-driver-gpu``) is not served by the Go module proxy this project
builds from, and because its node side needs the hardware:

- the **ComputeDomain CRD** (:func:`crd`): written here from the driver's Go types
  (``api/nvidia.com/resource/v1beta1``: ``numNodes``, ``channel.resourceClaimTemplate.name``,
  ``channel.allocationMode``; a status of ``status`` and ``nodes``), not copied from the driver;
- the **driver's controller**, only the part the pods wait for (:class:`ChannelTemplates`): for each
  ComputeDomain, the ResourceClaimTemplate it names, requesting one device of the channel
  DeviceClass with the domain's uid in its opaque config, owned by the domain. The real controller
  also runs one IMEX daemon per node (a DaemonSet and its own claims) and writes the domain's
  status: none of that is done here;
- the **kubelet plugin's ResourceSlices** (:func:`resource_slices`): IMEX channel devices on each
  node of a clique. The real plugin publishes them from the GPUs' fabric state and, on a pod's node,
  prepares the claim (creates ``/dev/nvidia-caps-imex-channels/channel<N>`` in the container) once
  the node's IMEX daemon joined the domain. KWOK's nodes run no kubelet: the claims are allocated
  and reserved for the pods, never prepared.
"""

from __future__ import annotations

import threading
from typing import Any

from megafleet_dev import kube

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
DRIVER = "compute-domain.nvidia.com"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
CHANNELS_PER_NODE = 4
DOMAINS = f"/apis/{GROUP}/{VERSION}/computedomains"
DEVICE_CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
SLICE_LABEL = "megafleet.dev/dra-stand-in"


def crd() -> dict[str, Any]:
    """The ComputeDomain CustomResourceDefinition, with the fields of the driver's v1beta1 types."""
    channel = {
        "type": "object",
        "required": ["resourceClaimTemplate"],
        "properties": {
            "resourceClaimTemplate": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}},
            },
            "allocationMode": {"type": "string", "enum": ["All", "Single"], "default": "Single"},
        },
    }
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "ipAddress": {"type": "string"},
            "cliqueID": {"type": "string"},
            "index": {"type": "integer"},
            "status": {"type": "string"},
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["numNodes", "channel"],
                "properties": {"numNodes": {"type": "integer", "minimum": 0}, "channel": channel},
                "x-kubernetes-validations": [
                    {"rule": "self == oldSelf", "message": "A computeDomain.spec is immutable"}
                ],
            },
            "status": {
                "type": "object",
                "properties": {"status": {"type": "string"}, "nodes": {"type": "array", "items": node}},
            },
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"computedomains.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": "ComputeDomain",
                "listKind": "ComputeDomainList",
                "plural": "computedomains",
                "singular": "computedomain",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def device_class() -> dict[str, Any]:
    """The DeviceClass of IMEX channels, selecting the driver's channel devices."""
    expression = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'channel'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": CHANNEL_CLASS},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def resource_slices(nodes: list[str], clique: str) -> list[dict[str, Any]]:
    """One ResourceSlice per node: :data:`CHANNELS_PER_NODE` IMEX channels of ``clique``."""
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}", "labels": {SLICE_LABEL: "true"}},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": f"channel-{index}",
                        "attributes": {
                            "type": {"string": "channel"},
                            "id": {"int": index},
                            "cliqueID": {"string": clique},
                        },
                    }
                    for index in range(CHANNELS_PER_NODE)
                ],
            },
        }
        for node in nodes
    ]


def channel_template(domain: dict[str, Any]) -> dict[str, Any]:
    """The ResourceClaimTemplate the driver's controller makes for ``domain``: one channel device,
    configured with the domain's uid, owned by the domain."""
    metadata = domain["metadata"]
    channel = domain["spec"]["channel"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": channel["resourceClaimTemplate"]["name"],
            "namespace": metadata["namespace"],
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "ComputeDomain",
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "channel", "exactly": {"deviceClassName": CHANNEL_CLASS}}],
                    "config": [
                        {
                            "requests": ["channel"],
                            "opaque": {
                                "driver": DRIVER,
                                "parameters": {
                                    "apiVersion": f"{GROUP}/{VERSION}",
                                    "kind": "ComputeDomainChannelConfig",
                                    "domainID": metadata["uid"],
                                    "allocationMode": channel.get("allocationMode", "Single"),
                                },
                            },
                        }
                    ],
                }
            }
        },
    }


class ChannelTemplates:
    """The driver controller's stand-in: every ``interval`` seconds, the channel template of each
    ComputeDomain that has none (its own thread, its own client; :meth:`stop` ends it)."""

    def __init__(self, client: kube.Kube, *, interval: float = 0.3) -> None:
        self._client, self._interval = client, interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megafleet-channel-templates", daemon=True)
        self.made: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._pass()
            except kube.KubeError:  # the API server is busy (a CRD's storage initializing): next pass
                continue

    def _pass(self) -> None:
        for domain in self._client.list(DOMAINS)["items"]:
            if domain["metadata"].get("deletionTimestamp"):
                continue
            template = channel_template(domain)
            namespace, name = template["metadata"]["namespace"], template["metadata"]["name"]
            templates = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates"
            if self._client.get(f"{templates}/{name}") is not None:
                continue
            try:
                self._client.create(templates, template)
            except kube.KubeError:  # the domain went away meanwhile; the next pass looks again
                continue
            self.made.append(f"{namespace}/{name}")
