"""The tiny example fleet as the realnode tier places it: on the real node, at half a core per engine.

The real node offers the machine's cores (two on CI's machine) to everything the tier runs at once:
the chart's two operator replicas (a session fixture), up to two engine pods of one fleet and a
client pod. At the example's one core per engine, the second engine of a fleet stays Pending
("Insufficient cpu") while the chart is installed; half a core each leaves room for all of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megafleet_dev import realnode

ROOT = Path(__file__).resolve().parents[2]
ENGINE_CPU = "500m"


def tiny(replicas: int) -> dict[str, Any]:
    """``examples/tiny-cpu.yaml`` with ``replicas`` shards, pinned to the real node, half a core each."""
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    spec = manifest["spec"]
    spec["replicas"] = replicas
    spec["resources"]["cpu"] = ENGINE_CPU
    spec["placement"]["nodeSelector"] = {realnode.REAL_NODE_LABEL: "true"}
    return manifest
