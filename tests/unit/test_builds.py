"""``megafleet dev build``'s two lanes (:mod:`megafleet_dev.builds`): the Go components and the
images build at the same time, and a failed lane lets the other finish before its error is raised."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megafleet_dev import builds, go_lane, images, progress, toolchain

PAUSE = images.Image("pause", images.PAUSE_REFERENCE, Path("/nowhere/pause.tar"), "k")


def test_the_go_and_image_lanes_run_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each fake lane waits until the other has started: run one after the other, they would time out.
    both = threading.Barrier(2, timeout=10)
    seen: dict[str, object] = {}

    def go(names: tuple[str, ...], *, report: progress.Progress) -> None:
        both.wait()
        seen["go"] = names

    def image_lane(targets: tuple[str, ...], report: progress.Progress) -> list[images.Image]:
        both.wait()
        seen["images"] = targets
        return [PAUSE]

    monkeypatch.setattr(toolchain, "ensure_built", go)
    monkeypatch.setattr(images, "ensure_all", image_lane)
    built = builds.ensure_all(("keda",), ("engine",), lambda _: None)
    assert seen == {"go": ("keda",), "images": ("engine",)}
    assert built.images == [PAUSE] and built.go_seconds >= 0 and built.images_seconds >= 0


def test_a_failed_go_lane_lets_the_images_finish_then_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    finished = threading.Event()

    def go(names: tuple[str, ...], *, report: progress.Progress) -> None:
        raise toolchain.ToolchainError("building keda failed")

    def image_lane(targets: tuple[str, ...], report: progress.Progress) -> list[images.Image]:
        finished.set()
        return [PAUSE]

    monkeypatch.setattr(toolchain, "ensure_built", go)
    monkeypatch.setattr(images, "ensure_all", image_lane)
    with pytest.raises(toolchain.ToolchainError, match="keda"):
        builds.ensure_all(("keda",), ("engine",), lambda _: None)
    assert finished.is_set()


def test_without_targets_no_image_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "ensure_built", lambda names, *, report: None)
    monkeypatch.setattr(images, "ensure_all", lambda *_: pytest.fail("an image was built"))
    assert builds.ensure_all(("etcd",), None, lambda _: None).images == []


def test_the_go_lane_of_make_up_needs_only_the_standard_library() -> None:
    # `make up` runs it before the virtual environment exists, with the machine's python3 in
    # isolated mode: any third-party import (now or added later to toolchain/progress) fails here.
    dev = Path(__file__).resolve().parents[2] / "dev"
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import megafleet_dev.go_lane; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'__main__'})))"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, str(dev)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["megafleet_dev"]


def test_the_go_lane_refuses_unknown_components_without_building() -> None:
    assert go_lane.main(["etcd", "no-such-component"]) == 2
