"""The generated CRDs in a real API server: examples are accepted, bad manifests are rejected at
admission with a message naming the field, and the scale subresource works with kubectl."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from megafleet_dev import toolchain

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(toolchain.kubectl_path()), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
        check=False,
    )


def expectation(path: Path) -> tuple[str, str]:
    header = dict(line[2:].split(": ", 1) for line in path.read_text().splitlines() if line.startswith("# "))
    return header["field"], header["expect"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_accepted(crds: None, kubeconfig: Path, namespace: str, path: Path) -> None:
    result = kubectl(kubeconfig, "apply", "-n", namespace, "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert "created" in result.stdout


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(
    crds: None, kubeconfig: Path, namespace: str, path: Path
) -> None:
    field, expected = expectation(path)

    result = kubectl(kubeconfig, "apply", "-n", namespace, "-f", str(path))

    assert result.returncode != 0, f"{path.name} was accepted"
    assert expected in result.stderr
    assert field in result.stderr
    listed = kubectl(kubeconfig, "get", "mgen,mrefit,mrsess", "-n", namespace, "-o", "name")
    assert listed.stdout.strip() == ""  # nothing was stored


def test_refit_spec_is_immutable(crds: None, kubeconfig: Path, namespace: str) -> None:
    manifest: dict[str, Any] = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "Refit",
        "metadata": {"name": "v1"},
        "spec": {"fleetRef": {"name": "fleet"}, "version": 1, "source": {"checkpoint": {"path": "/ckpt/1"}}},
    }
    assert kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest)).returncode == 0
    manifest["spec"]["version"] = 2

    result = kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))

    assert result.returncode != 0
    assert "a Refit's spec is immutable" in result.stderr


def test_kubectl_scale_changes_replicas_and_printer_columns_show_them(
    crds: None, kubeconfig: Path, namespace: str
) -> None:
    assert kubectl(kubeconfig, "apply", "-n", namespace, "-f", str(ROOT / "examples" / "tiny-cpu.yaml")).returncode == 0

    scaled = kubectl(kubeconfig, "scale", "-n", namespace, "mgen/tiny", "--replicas=5")
    assert scaled.returncode == 0, scaled.stderr

    table = kubectl(kubeconfig, "get", "mgen", "tiny", "-n", namespace)
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "DESIRED", "READY", "WEIGHTS", "STATUS", "AGE"]
    assert row.split()[:2] == ["tiny", "5"]


def test_refit_session_spec_is_immutable_and_refit_info_is_set_once(
    crds: None, kubeconfig: Path, namespace: str
) -> None:
    world = {"address": "trainer-0", "port": 1473, "worldSize": 3, "trainerWorldSize": 1, "bucketBytes": 1 << 20}
    manifest: dict[str, Any] = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "RefitSession",
        "metadata": {"name": "grpo"},
        "spec": {"fleetRef": {"name": "fleet"}, "nemoCollective": world},
    }
    assert kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest)).returncode == 0
    info = {"configMapRef": {"name": "grpo-info", "key": "refitInfo.json.gz"}, "sha256": "a" * 64, "tensors": 3}
    manifest["spec"]["refitInfo"] = info
    set_once = kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))
    assert set_once.returncode == 0, set_once.stderr

    manifest["spec"]["refitInfo"] = {**info, "tensors": 4}
    changed_info = kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))
    manifest["spec"]["refitInfo"] = info
    manifest["spec"]["nemoCollective"] = {**world, "port": 1474}
    changed_port = kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))

    assert changed_info.returncode != 0
    assert "refitInfo is set once" in changed_info.stderr
    assert changed_port.returncode != 0
    assert "a RefitSession's spec is immutable" in changed_port.stderr
