"""The Dockerfile's two images, built with buildah from the local Debian base, run their
entrypoints in containers of the real node's containerd (runc, no network, the image's user)."""

from __future__ import annotations

import json
import tarfile
from typing import Any

import pytest

from megafleet_dev import images, realnode

# The first test of a session starts the cluster and the node (and builds what is missing).
pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]


def image_config(image: images.Image) -> dict[str, Any]:
    """The image config inside a docker-archive (manifest.json -> config)."""
    with tarfile.open(image.archive) as archive:
        manifest_file = archive.extractfile("manifest.json")
        assert manifest_file is not None
        manifest = json.load(manifest_file)[0]
        assert image.reference in manifest["RepoTags"]
        config_file = archive.extractfile(manifest["Config"])
        assert config_file is not None
        config: dict[str, Any] = json.load(config_file)
        return config


def run_in_container(node: realnode.RealNode, image: images.Image, name: str, *argv: str) -> str:
    result = node.ctr("run", "--rm", "--cgroup", f"{node.cgroup}/image-tests/{name}", image.reference, name, *argv)
    return result.stdout


@pytest.mark.parametrize(
    ("target", "entrypoint", "argv", "expected"),
    [
        ("operator", ["megafleet"], ["version"], "0.1.0"),
        ("engine", ["megafleet-engine"], ["--help"], "usage: megafleet-engine"),
    ],
)
def test_each_image_runs_its_entrypoint_in_a_container(
    real_node: realnode.RealNode, target: str, entrypoint: list[str], argv: list[str], expected: str
) -> None:
    image = images.ensure_image(target)  # cached: the fixture built it; this only finds it
    config = image_config(image)["config"]
    assert config["Entrypoint"] == entrypoint
    assert config["User"] == "65532:65532"
    output = run_in_container(real_node, image, f"entrypoint-{target}", *entrypoint, *argv)
    assert expected in output


def test_the_operator_image_holds_no_torch_and_the_engine_image_does(real_node: realnode.RealNode) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is not None, u.find_spec('kopf') is not None)"
    operator = run_in_container(real_node, images.ensure_image("operator"), "probe-operator", "python", "-c", probe)
    engine = run_in_container(real_node, images.ensure_image("engine"), "probe-engine", "python", "-c", probe)
    assert operator.split() == ["False", "True"]
    assert engine.split() == ["True", "True"]


def test_an_unchanged_build_is_a_cache_hit() -> None:
    first = images.ensure_image("operator")
    again = images.ensure_image("operator", report=lambda line: pytest.fail(f"rebuilt: {line}"))
    assert again == first and first.archive.is_file()
