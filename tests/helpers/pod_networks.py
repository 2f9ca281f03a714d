"""The networks a test session's clusters use, all derived from ``MEGAFLEET_TEST_POD_NETWORK`` so
that test sessions running side by side on one machine (each with its own /12) never collide.

The e2e tier's KWOK nodes take /24s from the start of the session's loopback /12
(``tests/conftest.py``). A cluster of the realnode tier, numbered ``slot`` (its session cluster,
the teardown tests' clusters), takes /16 number ``slot`` of that /12 for KWOK's fallback pod CIDR
(it has no KWOK node) and the same /16 of the /12 mirrored into 10.0.0.0/8 for its real node: the
session 127.128.0.0/12 gives slot 14 127.142.0.0/16 and 10.142.0.0/16. The dev cluster's defaults
(127.64.0.0/12, 10.213.0.0/16 = slot 5 of the 127.208.0.0/12 mirror) stay clear of slots 14 and 15.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os

DEFAULT_SESSION_NETWORK = "127.128.0.0/12"
REALNODE_SLOT = 14  # the realnode tier's session cluster (tests/realnode/conftest.py)
TEARDOWN_SLOT = 15  # the teardown tests' own clusters, alive beside it (one at a time)


def session_network() -> str:
    """This session's loopback /12: ``$MEGAFLEET_TEST_POD_NETWORK``, else the default."""
    return os.environ.get("MEGAFLEET_TEST_POD_NETWORK", DEFAULT_SESSION_NETWORK)


@dataclasses.dataclass(frozen=True)
class ClusterNetworks:
    """A realnode-tier cluster's networks: ``kwok`` (LocalCluster's pod_network), ``real_node``
    (realnode.start's network)."""

    kwok: str
    real_node: str


def cluster_networks(session: str, slot: int) -> ClusterNetworks:
    """The networks of cluster ``slot`` (0-15) of the session network ``session`` (pure; a
    session network narrower than a /12 counts as the /12 it lies in)."""
    network = ipaddress.IPv4Network(session)
    if not network.subnet_of(ipaddress.IPv4Network("127.0.0.0/8")):
        raise ValueError(f"the test pod network {session} must lie inside 127.0.0.0/8 (loopback)")
    if not 0 <= slot < 16:
        raise ValueError(f"slot {slot} is not one of the 16 /16s of a /12")
    block = network if network.prefixlen <= 12 else network.supernet(new_prefix=12)
    second = block.network_address.packed[1] + slot
    return ClusterNetworks(kwok=f"127.{second}.0.0/16", real_node=f"10.{second}.0.0/16")
