"""Building the control-plane programs: cache layout and the errors a user sees."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from megafleet_dev import cluster, toolchain


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEGAFLEET_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_folders_are_keyed_by_version(empty_cache: Path) -> None:
    assert toolchain.program_path("kube-apiserver") == (
        empty_cache / "controlplane" / f"kubernetes-{toolchain.KUBERNETES_VERSION}" / "kube-apiserver"
    )
    assert toolchain.program_path("kwok.yaml").parent.name == f"kwok-{toolchain.KWOK_VERSION}"


def test_missing_go_gives_a_clear_message(empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(toolchain.ToolchainError, match="Go is needed once to build"):
        toolchain.ensure_built(("etcd",), report=lambda _: None)


def test_failed_build_shows_the_log_tail_and_leaves_no_partial_build(
    empty_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake_go = fake_bin / "go"
    fake_go.write_text("#!/bin/sh\necho 'compile error: something broke' >&2\nexit 1\n")
    fake_go.chmod(fake_go.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")

    with pytest.raises(toolchain.ToolchainError, match="something broke"):
        toolchain.ensure_built(("etcd",), report=lambda _: None)

    etcd = next(c for c in toolchain.COMPONENTS if c.name == "etcd")
    assert not toolchain.is_built(etcd)
    leftovers = [p.name for p in (empty_cache / "controlplane").iterdir() if not p.name.endswith(".build.log")]
    assert leftovers == []


def test_a_component_counts_as_built_only_with_every_file(empty_cache: Path) -> None:
    kwok = next(c for c in toolchain.COMPONENTS if c.name == "kwok")
    folder = toolchain.component_dir(kwok)
    folder.mkdir(parents=True)
    (folder / "kwok").write_text("")
    assert not toolchain.is_built(kwok)
    (folder / "kwok.yaml").write_text("")
    assert toolchain.is_built(kwok)


def test_process_record_is_not_alive_when_the_pid_runs_another_program() -> None:
    record = cluster.ProcessRecord(name="x", pid=os.getpid(), argv=["/not/our/program"], log="")
    assert not record.alive()


def test_free_port_is_bindable_on_loopback() -> None:
    import socket

    port = cluster.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_flux_is_built_only_for_the_gitops_tier(empty_cache: Path) -> None:
    assert toolchain.GITOPS == ("flux-source", "flux-kustomize")
    assert not set(toolchain.GITOPS) & set(toolchain.CONTROL_PLANE + toolchain.AUTOSCALE)
    assert toolchain.program_path("source-controller").parent.name == f"flux-source-{toolchain.FLUX_SOURCE_VERSION}"
    assert toolchain.program_path("flux-kustomize-crds.yaml").parent.name == (
        f"flux-kustomize-{toolchain.FLUX_KUSTOMIZE_VERSION}"
    )
    for component in toolchain.COMPONENTS:
        if component.name in toolchain.GITOPS:
            assert (toolchain.GOMOD_DIR / component.module / "go.sum").is_file()
