"""Development and test tooling: a local Kubernetes control plane with simulated GPU nodes.

Not part of the operator or engine images. Entry points: ``megafleet dev up|down|status|build``
(:mod:`megafleet_dev.cli`) and :class:`megafleet_dev.cluster.LocalCluster` for test fixtures.
"""

__all__: list[str] = []
