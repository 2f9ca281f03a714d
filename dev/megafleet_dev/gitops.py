"""Flux beside the local control plane: the real GitOps controllers that sync fleets from git.

Used by the GitOps tier's test (``tests/e2e/test_gitops.py``) and ``megafleet dev up --gitops``
(:mod:`megafleet_dev.cli`). :func:`start` builds Flux's two controllers on first use
(:data:`megafleet_dev.toolchain.GITOPS`, never with the rest of the control plane), installs their
CRDs and starts them as processes of the :class:`~megafleet_dev.cluster.LocalCluster` (so
``megafleet dev down`` stops them too):

- **source-controller** clones each ``GitRepository`` (from :mod:`megafleet_dev.gitserver` here)
  into a tarball it serves from its own HTTP artifact server on 127.0.0.1, advertised under that
  address, so kustomize-controller downloads from loopback.
- **kustomize-controller** builds each ``Kustomization``'s path with kustomize, applies the result
  with server-side apply (field manager ``kustomize-controller``), prunes what left git, and, with
  ``wait: true``, waits for every object to be Current by kstatus (a fleet: its Ready condition and
  ``status.observedGeneration``).

The two run as the cluster's admin (the kubeconfig's token), watching every namespace; no
notification-controller runs, so events go to the API server only. :func:`git_repository` and
:func:`kustomization` are the objects docs/gitops.md shows.

Invariant: every listener is on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from megafleet_dev import cluster, toolchain

NAMESPACE = "flux-system"
SOURCE_API = "source.toolkit.fluxcd.io/v1"
KUSTOMIZE_API = "kustomize.toolkit.fluxcd.io/v1"
FIELD_MANAGER = "kustomize-controller"
"""The field manager of kustomize-controller's server-side applies."""


@dataclasses.dataclass(frozen=True)
class Flux:
    """What :func:`start` started: the processes to stop and kustomize-controller's log (JSON lines)."""

    records: tuple[cluster.ProcessRecord, ...]
    kustomize_log: Path


def git_repository(name: str, url: str, *, branch: str = "main", interval: str = "1m") -> dict[str, Any]:
    """A Flux ``GitRepository`` in :data:`NAMESPACE` following ``branch`` of ``url``."""
    return {
        "apiVersion": SOURCE_API,
        "kind": "GitRepository",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"url": url, "ref": {"branch": branch}, "interval": interval, "timeout": "60s"},
    }


def kustomization(name: str, source: str, path: str, *, interval: str = "1m", timeout: str = "5m") -> dict[str, Any]:
    """A Flux ``Kustomization`` applying ``path`` of GitRepository ``source``: prune what leaves git,
    and wait (kstatus) until everything it applied is Current, a fleet Ready."""
    return {
        "apiVersion": KUSTOMIZE_API,
        "kind": "Kustomization",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "interval": interval,
            "retryInterval": interval,
            "timeout": timeout,
            "sourceRef": {"kind": "GitRepository", "name": source},
            "path": path,
            "prune": True,
            "wait": True,
        },
    }


def start(local: cluster.LocalCluster) -> Flux:
    """Build (once) and start source-controller and kustomize-controller for ``local``; returns when
    both are ready and their CRDs Established."""
    toolchain.ensure_built(toolchain.GITOPS, report=local.report)
    folder = local.state_dir / "gitops"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "artifacts").mkdir(parents=True)
    with local.kube() as client:
        if client.get(f"/api/v1/namespaces/{NAMESPACE}") is None:
            client.create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        for crds in ("flux-source-crds.yaml", "flux-kustomize-crds.yaml"):
            for definition in yaml.safe_load_all(toolchain.program_path(crds).read_text()):
                if definition:
                    client.install_crd(definition)
    env = dict(os.environ, KUBECONFIG=str(local.kubeconfig), RUNTIME_NAMESPACE=NAMESPACE, TMPDIR=str(folder))
    started: list[cluster.ProcessRecord] = []
    try:
        storage = cluster.free_port()
        started.append(
            _spawn(
                local,
                "source-controller",
                [
                    f"--storage-path={folder / 'artifacts'}",
                    f"--storage-addr=127.0.0.1:{storage}",
                    f"--storage-adv-addr=127.0.0.1:{storage}",
                ],
                env,
            )
        )
        started.append(_spawn(local, "kustomize-controller", ["--no-remote-bases=true"], env))
    except BaseException:
        local.stop_processes(started)
        raise
    return Flux(records=tuple(started), kustomize_log=Path(started[-1].log))


def stop(local: cluster.LocalCluster, running: Flux) -> None:
    local.stop_processes(list(running.records))


def applies(log: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """Every server-side apply kustomize-controller logged, in order: (revision, object -> action),
    the object as ``Kind/namespace/name`` and the action ``created``, ``configured``, ``unchanged``..."""
    for line in log.read_text(errors="replace").splitlines():
        if '"server-side apply completed"' not in line:
            continue
        entry = json.loads(line)
        yield str(entry.get("revision", "")), {str(k): str(v) for k, v in (entry.get("output") or {}).items()}


def _spawn(local: cluster.LocalCluster, name: str, flags: list[str], env: dict[str, str]) -> cluster.ProcessRecord:
    metrics, health = cluster.free_port(), cluster.free_port()
    record = local.spawn(
        name,
        [
            str(toolchain.program_path(name)),
            f"--metrics-addr=127.0.0.1:{metrics}",
            f"--health-addr=127.0.0.1:{health}",
            "--watch-all-namespaces=true",
            "--log-encoding=json",
            "--log-level=info",
            *flags,
        ],
        env=env,
    )
    local.wait_for(name, functools.partial(cluster.http_not_ok, f"http://127.0.0.1:{health}/readyz"))
    return record
