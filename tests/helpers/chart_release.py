"""The chart as a user installs it on the real-node cluster (``helm install`` of ``charts/megafleet``
with the operator image of ``megafleet dev images``), for the realnode tests of the in-cluster
operator and of the chart's agent NetworkPolicy; the session fixture is in tests/realnode/conftest.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from megafleet_dev import images, realnode, toolchain

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "megafleet"
RELEASE = "megafleet-rn"  # holds the chart name: the objects are named after the release alone
OPERATOR_SELECTOR = "app.kubernetes.io/component=operator"


def helm(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolchain.program_path("helm")), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def values(namespace: str) -> dict[str, Any]:
    """The values of the test's release: the built image, watching ``namespace``, on the real node;
    everything else (the agent NetworkPolicy included) as the chart's defaults give it."""
    return {
        "image": {"tag": images.project_version(), "pullPolicy": "Never"},
        "operator": {"watchNamespaces": [namespace], "verbose": True},
        "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
    }
