"""The GitOps tier's git server: a commit pushed to the bare repository is what an HTTP clone sees,
through git's smart protocol (the only one Flux's go-git speaks); and kustomize-controller's apply
log, as :func:`megafleet_dev.gitops.applies` reads it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megafleet_dev import gitops, gitserver


@pytest.mark.slow
def test_a_commit_is_cloned_over_smart_http(tmp_path: Path) -> None:
    server = gitserver.GitServer(tmp_path / "served")
    server.start()
    try:
        repository = server.repository("fleets")
        first = repository.commit({"fleets/a.yaml": "a: 1\n"}, "first")
        second = repository.commit({"fleets/a.yaml": None, "fleets/b.yaml": "b: 2\n"}, "second")
        assert first != second
        url = server.url(repository)
        assert url.startswith("http://127.0.0.1:")
        clone = tmp_path / "clone"
        subprocess.run(
            ["git", "-c", "protocol.version=2", "clone", "--quiet", "--branch", "main", url, str(clone)],
            check=True,
            capture_output=True,
            timeout=60,
        )
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=clone, check=True, capture_output=True, text=True, timeout=60
        )
        assert head.stdout.strip() == second
        assert sorted(p.name for p in (clone / "fleets").iterdir()) == ["b.yaml"]
    finally:
        server.stop()


def test_applies_reads_the_change_set_of_each_apply(tmp_path: Path) -> None:
    log = tmp_path / "kustomize-controller.log"
    lines = [
        {
            "level": "info",
            "msg": "server-side apply completed",
            "revision": "main@sha1:1",
            "output": {"A/ns/a": "created"},
        },
        {"level": "info", "msg": "Reconciliation finished"},
        {
            "level": "info",
            "msg": "server-side apply completed",
            "revision": "main@sha1:1",
            "output": {"A/ns/a": "unchanged"},
        },
    ]
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json at all\n")
    assert list(gitops.applies(log)) == [
        ("main@sha1:1", {"A/ns/a": "created"}),
        ("main@sha1:1", {"A/ns/a": "unchanged"}),
    ]
