"""The container's termination message: the first reason wins, it is cut to what the kubelet keeps,
and an engine without a termination file (started by hand) writes nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from megafleet_engine import termination


def test_the_first_reason_is_kept_and_the_ranks_it_stops_do_not_replace_it(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    path.touch()  # the kubelet makes it empty
    termination.record("rank 1: RuntimeError: CUDA out of memory", path)
    termination.record("rank-0 exited with status 1", path)
    assert path.read_text() == "rank 1: RuntimeError: CUDA out of memory"


def test_a_long_reason_is_cut_to_whole_characters_within_the_kubelets_limit(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    termination.record("é" * termination.MAX_BYTES, path)
    written = path.read_bytes()
    assert len(written) <= termination.MAX_BYTES and written.decode() == "é" * (termination.MAX_BYTES // 2)


def test_without_a_path_it_writes_only_where_the_kubelet_made_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = tmp_path / "dev" / "termination-log"
    monkeypatch.setattr(termination, "DEFAULT_PATH", default)
    termination.record("no file here", None)
    assert not default.exists()
    default.parent.mkdir()
    default.touch()
    termination.record("invalid configuration: MEGAFLEET_KV_CACHE_GIB must be at least 1, got 0", None)
    assert default.read_text() == "invalid configuration: MEGAFLEET_KV_CACHE_GIB must be at least 1, got 0"


def test_an_unwritable_path_is_only_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    termination.record("reason", tmp_path / "missing-folder" / "termination-log")
    assert "could not write the termination message" in caplog.text
