"""``megafleet dev``: build, start, inspect and stop the local control plane.

Called by :mod:`megafleet.cli`, which delegates the ``dev`` sub-command here, so the operator
image never needs this package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

from megafleet_dev import (
    autoscale,
    builds,
    cluster,
    demo,
    gitops,
    images,
    kube,
    kueue,
    nodes,
    progress,
    realnode,
    runner,
    sandbox,
    toolchain,
)


def default_state_dir() -> Path:
    """The dev cluster's files: ``$MEGAFLEET_DEV_STATE``, else ``<cache>/dev-cluster``."""
    explicit = os.environ.get("MEGAFLEET_DEV_STATE")
    return Path(explicit) if explicit else toolchain.cache_root() / "dev-cluster"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the cluster's files live (default: $MEGAFLEET_DEV_STATE or the cache)",
    )
    commands = parser.add_subparsers(dest="dev_command", required=True)
    up = commands.add_parser("up", help="build what is missing, start the control plane and simulated GPU nodes")
    up.add_argument(
        "--pool",
        action="append",
        type=nodes.NodePool.parse,
        default=None,
        metavar="NAME:CLIQUESxNODES:GPUS[:PRODUCT]",
        help="a pool of simulated nodes; repeat for several (default: "
        + ", ".join(str(pool) for pool in nodes.DEFAULT_POOLS)
        + ")",
    )
    up.add_argument(
        "--pod-network",
        default="127.64.0.0/12",
        help="loopback range the nodes' pod CIDRs come from (use another one for a second cluster)",
    )
    up.add_argument(
        "--control-plane-only",
        action="store_true",
        help="start only the control plane and nodes (no operator, pod runner or sample fleet)",
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="add a real CPU node (containerd, kubelet, kube-proxy, CoreDNS in a network namespace); "
        "the sample fleet then runs in containers from the engine image built with buildah",
    )
    up.add_argument(
        "--real-node-network",
        default=realnode.DEFAULT_NETWORK,
        help="the /16 the real node's pods and host link use (use another one for a second cluster)",
    )
    up.add_argument(
        "--autoscale",
        action="store_true",
        help="also Prometheus (scraping every engine pod) and KEDA (operator, external metrics API), "
        "built on first use; docs/autoscaling.md",
    )
    up.add_argument(
        "--gitops",
        action="store_true",
        help="also Flux's source-controller and kustomize-controller, built on first use; docs/gitops.md",
    )
    up.add_argument(
        "--kueue",
        action="store_true",
        help="also Kueue (its controller manager, pod integration, webhooks), built on first use; docs/kueue.md",
    )
    commands.add_parser("down", help="stop every process of the local cluster and delete its files")
    built = commands.add_parser(
        "images", help="build the operator and engine images with buildah if their inputs changed"
    )
    built.add_argument(
        "targets", nargs="*", metavar="TARGET", help=f"Dockerfile targets (default: {' '.join(images.TARGETS)})"
    )
    commands.add_parser("runner", help="run the local pod runner in the foreground (started by 'up')")
    commands.add_parser("status", help="say what is running and where the kubeconfig is")
    build = commands.add_parser("build", help="build the pinned control-plane programs into the cache if missing")
    build.add_argument(
        "--real-node",
        action="store_true",
        help="also the real node's programs (kubelet, kube-proxy, CoreDNS) and the operator and engine images",
    )
    build.add_argument("--autoscale", action="store_true", help="also Prometheus and KEDA")
    build.add_argument("--gitops", action="store_true", help="also Flux's source-controller and kustomize-controller")
    build.add_argument("--kueue", action="store_true", help="also Kueue")


def run(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir or default_state_dir()
    try:
        if args.dev_command == "build":
            names = toolchain.CONTROL_PLANE + (realnode.PROGRAMS if args.real_node else ())
            names += toolchain.AUTOSCALE if args.autoscale else ()
            names += toolchain.GITOPS if args.gitops else ()
            names += toolchain.KUEUE if args.kueue else ()
            # The Go components and the images build in parallel lanes (megafleet_dev.builds).
            built = builds.ensure_all(names, images.TARGETS if args.real_node else None)
            for component in toolchain.COMPONENTS:
                if component.name in names:
                    print(f"{component.name} {component.version}: {toolchain.component_dir(component)}")
            for image in built.images:
                print(f"{image.reference}: {image.archive}")
            lanes = f"Go components {built.go_seconds:.0f} s, images {built.images_seconds:.0f} s"
            progress.print_progress(f"build lanes done (in parallel): {lanes}")
            return 0
        if args.dev_command == "images":
            unknown = set(args.targets) - set(images.TARGETS)
            if unknown:
                raise images.ImageError(f"unknown targets {sorted(unknown)}; choose from {list(images.TARGETS)}")
            for image in images.ensure_all(tuple(args.targets) or images.TARGETS):
                print(f"{image.reference} ({image.key}): {image.archive}")
            return 0
        if args.dev_command == "up":
            pools = tuple(args.pool) if args.pool else nodes.DEFAULT_POOLS
            real_network = args.real_node_network if args.real_node else None
            return _up(
                state_dir,
                pools,
                full=not args.control_plane_only,
                pod_network=args.pod_network,
                real_node=real_network,
                addons=frozenset(
                    name
                    for name, on in (("autoscale", args.autoscale), ("gitops", args.gitops), ("kueue", args.kueue))
                    if on
                ),
            )
        if args.dev_command == "runner":
            return _runner(state_dir)
        if args.dev_command == "down":
            return _down(state_dir)
        return _status(state_dir)
    except (toolchain.ToolchainError, cluster.ClusterError, images.ImageError) as error:
        print(f"megafleet dev {args.dev_command}: {error}", file=sys.stderr)
        return 1


def _up(
    state_dir: Path,
    pools: tuple[nodes.NodePool, ...],
    *,
    full: bool,
    pod_network: str,
    real_node: str | None,
    addons: frozenset[str] = frozenset(),
) -> int:
    """Start the local cluster; ``addons``: ``autoscale`` (Prometheus, KEDA), ``gitops`` (Flux), ``kueue`` (Kueue)."""
    if list(cluster.running_processes(state_dir)):
        print(f"the local cluster is already running from {state_dir}")
        return _status(state_dir)
    if state_dir.exists():
        shutil.rmtree(state_dir)
    local = cluster.LocalCluster(state_dir, pools=pools, pod_network=pod_network)
    state = local.start()
    try:
        if real_node is not None:
            realnode.start(local, network=real_node)
        if full:
            demo.start(local, real_node=real_node is not None)
        scaling = autoscale.start(local) if "autoscale" in addons else None
        if "gitops" in addons:
            gitops.start(local)
        if "kueue" in addons:
            kueue.start(local)
    except BaseException:
        local.stop()
        raise
    print(f"\nAPI server:  {state.api_server}")
    print(f"kubeconfig:  {state.kubeconfig}")
    print(f"\n  export KUBECONFIG={state.kubeconfig}")
    print(f"  {toolchain.kubectl_path()} get nodes -L {nodes.CLIQUE_LABEL}")
    if full:
        print("\n".join(demo.usage(local)))
    if "gitops" in addons:
        print(f"\nFlux:        source-controller and kustomize-controller watch every namespace ({gitops.NAMESPACE})")
    if scaling is not None:
        print(f"\nPrometheus:  {scaling.prometheus_url} (serverAddress of a ScaledObject's prometheus trigger)")
        print("KEDA:        operator and external metrics API (kubectl get apiservice v1beta1.external.metrics.k8s.io)")
    if "kueue" in addons:
        print("Kueue:       pod integration on; make a ResourceFlavor, a ClusterQueue and a LocalQueue (docs/kueue.md)")
    print("\nStop it with: megafleet dev down")
    return 0


def _runner(state_dir: Path) -> int:
    state = cluster.ClusterState.load(state_dir)
    if state is None:
        print(f"no local cluster in {state_dir}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with kube.Kube.from_kubeconfig(Path(state.kubeconfig)) as client:
        local = runner.Runner(client, state_dir / "pods")
        local.start()
        stop.wait()
        local.stop()
    return 0


def _down(state_dir: Path) -> int:
    state = cluster.ClusterState.load(state_dir)
    if state is None:
        print(f"no local cluster in {state_dir}")
        return 0
    box = sandbox.Sandbox.load(state_dir)
    cluster.LocalCluster(state_dir).stop()
    left = list(cluster.running_processes(state_dir))
    if left:
        print("still running: " + ", ".join(f"{record.name} (pid {record.pid})" for record in left), file=sys.stderr)
        return 1
    leftovers = sandbox.leftovers(box) if box is not None else []
    if leftovers:
        print("the real node left: " + ", ".join(leftovers), file=sys.stderr)
        return 1
    shutil.rmtree(state_dir)
    print(f"stopped {len(state.processes)} processes and removed {state_dir}")
    return 0


def _status(state_dir: Path) -> int:
    state = cluster.ClusterState.load(state_dir)
    if state is None:
        print(f"no local cluster in {state_dir}")
        return 3
    running = {record.pid for record in cluster.running_processes(state_dir)}
    for record in state.processes:
        print(f"{record.name:<24} pid {record.pid:<8} {'running' if record.pid in running else 'stopped'}")
    print(f"API server: {state.api_server}\nkubeconfig: {state.kubeconfig}\nnode pools: {', '.join(state.pools)}")
    return 0 if len(running) == len(state.processes) else 3
