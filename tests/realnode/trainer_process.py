"""A trainer for the real node's refit test, run as its own process inside the node's network
namespace (pods reach the node's address; nothing on the host is reachable from a pod).

Usage: ``python trainer_process.py ADDRESS PORT WORLD_SIZE VERSION SOURCE``: builds the tiny model
from SOURCE (other weights than the engines'), joins the refit group as rank 0 and sends.
"""

from __future__ import annotations

import sys

from megafleet_engine.models import tiny
from megafleet_protocol.refit import sender


def main(argv: list[str]) -> int:
    address, port, world_size, version, source = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    model, _ = tiny.build_tiny(source)
    weights = sender.WeightSender(port, world_size, address=address, timeout_seconds=120)
    try:
        weights.init()
        weights.send([(name, p.detach()) for name, p in model.named_parameters()], bucket_size_mib=1, version=version)
    finally:
        weights.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
