"""The images cache's disk rules (dev/megafleet_dev/images.py, realnode.py), without buildah: which
stored images a prune removes, the early error when the disk cannot hold a build or an import, and
the build context that the image key hashes (the dependency script included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megafleet_dev import images, realnode

ROOT = Path(__file__).resolve().parents[2]


def test_a_prune_keeps_the_current_key_the_base_and_the_pause_image() -> None:
    stored = [
        "localhost/megafleet/engine:aaaa",
        "localhost/megafleet/engine:bbbb",
        "localhost/megafleet/operator:cccc",
        "localhost/megafleet/pause:dddd",
        "localhost/megafleet/debian-python:eeee",
    ]
    assert images.stale_names(stored, "engine", "bbbb") == ["localhost/megafleet/engine:aaaa"]
    # None: free space is short, the archive stays the only cache of the target.
    assert images.stale_names(stored, "engine", None) == [
        "localhost/megafleet/engine:aaaa",
        "localhost/megafleet/engine:bbbb",
    ]
    assert images.stale_names(stored, "operator", "cccc") == []


def test_a_short_disk_fails_early_naming_needed_free_and_the_cache(tmp_path: Path) -> None:
    free = images.free_gb(tmp_path)
    images.require_free(0.0, "building nothing", tmp_path)  # enough: no error
    with pytest.raises(images.ImageError) as raised:
        images.require_free(free + 1000, "building the engine image", tmp_path)
    message = str(raised.value)
    assert "building the engine image" in message
    assert f"about {free + 1000:.0f} GB free" in message
    assert str(images.images_dir()) in message


def test_the_engine_build_asks_more_when_cold_and_the_storage_copy_goes_before_an_import() -> None:
    for needs in images.BUILD_NEEDS_GB.values():
        assert needs["cold"] > needs["warm"] > 0
    archive = 6 * 10**9  # the engine image
    # containerd holds it twice (content and snapshots): keeping the storage copy too must leave that.
    assert realnode.import_needs_gb(archive) == pytest.approx(13.0)
    assert realnode.import_needs_gb(archive) < images.KEEP_STORAGE_FREE_GB


def test_the_dependency_script_is_part_of_the_hashed_build_context() -> None:
    hashed = images.context_files(
        ROOT, [entry for entry in images.CONTEXT_ENTRIES if entry not in images.UNHASHED_ENTRIES]
    )
    assert Path("docker/deps.py") in hashed
    assert Path("Dockerfile") in hashed
