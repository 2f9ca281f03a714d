"""``megafleet dev build``'s two lanes (:mod:`megafleet_dev.builds`): the Go components and the
images build at the same time, and a failed lane lets the other finish before its error is raised."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from megafleet_dev import builds, images, progress, toolchain

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
