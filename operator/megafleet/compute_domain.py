"""Pure builders of a shard's ComputeDomain: the IMEX domain that gives a shard spanning several nodes
of one NVLink clique NVLink between its nodes (GB200/GB300 racks), and the claim each pod makes on it.

Called by :mod:`megafleet.reconcile.compute_domains`, which creates the domain before the shard's
pods and deletes it with the shard. The API is NVIDIA's DRA driver's (``resource.nvidia.com``,
``ComputeDomain``), used as Grove uses it: one domain per shard placement, owned by the fleet (so
it goes with the fleet), naming a ResourceClaimTemplate of the same name that the driver's
controller creates; every pod of the shard references that template under
:data:`CLAIM_NAME` (``spec.resourceClaims``) and its engine container uses the claim, so
Kubernetes makes one ResourceClaim per pod on the domain's IMEX channel. A shard placed again
(after a node loss, or its pods went away) gets a domain of a new name: the old one may still be
terminating while the driver releases its daemons. Shards within one node get nothing.
"""

from __future__ import annotations

import copy

from megafleet import desired, planner
from megafleet.objects import Object

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ComputeDomain"
COMPONENT = "compute-domain"
"""The ``megafleet.dev/component`` label of a shard's ComputeDomain."""
CLAIM_NAME = "compute-domain-channel"
"""The pod-level claim (``spec.resourceClaims[].name``) on the domain's channel."""


def spans_nodes(placement: planner.ShardPlacement) -> bool:
    """Whether a placed shard needs a domain: its pods sit on more than one node of one clique."""
    return nodes_spanned(placement) > 1


def name(fleet: str, shard: int, token: str) -> str:
    """The domain (and channel template) of one placement of ``shard``; ``token`` tells placements apart."""
    return f"{fleet}-s{shard}-cd-{token}"


def nodes_spanned(placement: planner.ShardPlacement) -> int:
    """How many nodes of one clique a placed shard spans (0: none, its pods share no clique)."""
    return len({pod.node for pod in placement.pods}) if placement.clique is not None else 0


def compute_domain(fleet: desired.ParsedFleet, shard: int, domain: str, nodes: int) -> Object:
    """The ComputeDomain of one placed shard: one IMEX daemon per node of the shard (``numNodes``,
    which the driver reads in both of its daemon modes), one channel per pod."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": desired.metadata(fleet, domain, COMPONENT, shard),
        "spec": {
            "numNodes": nodes,
            "channel": {"resourceClaimTemplate": {"name": domain}, "allocationMode": "Single"},
        },
    }


def with_channel(pod: Object, domain: str) -> Object:
    """A copy of ``pod`` that claims a channel of ``domain`` (its ResourceClaimTemplate) for its
    engine container."""
    claimed = copy.deepcopy(pod)
    spec = claimed["spec"]
    spec["resourceClaims"] = [
        *spec.get("resourceClaims", []),
        {"name": CLAIM_NAME, "resourceClaimTemplateName": domain},
    ]
    for container in spec["containers"]:
        resources = container.setdefault("resources", {})
        resources["claims"] = [*resources.get("claims", []), {"name": CLAIM_NAME}]
    return claimed


def channel(pod: Object) -> str | None:
    """The domain whose channel ``pod`` claims, or None."""
    for claim in (pod.get("spec") or {}).get("resourceClaims") or []:
        if claim.get("name") == CLAIM_NAME:
            template = claim.get("resourceClaimTemplateName")
            return str(template) if template else None
    return None
