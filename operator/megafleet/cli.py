"""The ``megafleet`` command.

Sub-commands: ``version``; ``crds`` (generated CRDs and API reference); ``dev`` (the local control
plane; needs the development extra and is delegated to :mod:`megafleet_dev.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import megafleet


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megafleet", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the version")
    crds = commands.add_parser("crds", help="write the CRDs and API reference generated from the API models")
    crds.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (default: current directory)")
    crds.add_argument("--check", action="store_true", help="only report files that are out of date (exit 1)")
    operator = commands.add_parser("operator", help="run the operator (reconciles MegatronGeneration objects)")
    operator.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeat)")
    operator.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="elect one active replica through this ClusterKopfPeering (default: standalone)",
    )
    operator.add_argument("--priority", type=int, default=None, help="peering priority (default: random)")
    operator.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    operator.add_argument("--verbose", action="store_true", help="debug logging")
    dev = commands.add_parser("dev", help="local control plane with simulated GPU nodes (development and tests)")
    dev_cli = _dev_cli()
    if dev_cli is not None:
        dev_cli.add_arguments(dev)
    args = parser.parse_args(argv)
    if args.command == "version":
        print(megafleet.__version__)
        return 0
    if args.command == "operator":
        from megafleet import operator_main

        operator_main.run(
            namespaces=args.namespace,
            peering=args.peering,
            priority=args.priority,
            metrics_port=args.metrics_port,
            verbose=args.verbose,
        )
        return 0
    if args.command == "crds":
        return _crds(args.root, check=args.check)
    if dev_cli is None:
        print("megafleet dev needs the development tooling: pip install -e '.[dev]' from a checkout", file=sys.stderr)
        return 2
    result: int = dev_cli.run(args)
    return result


def _crds(root: Path, *, check: bool) -> int:
    from megafleet.api import generate

    if check:
        stale = generate.stale_files(root)
        for path in stale:
            print(f"out of date: {path.relative_to(root)} (run: megafleet crds)", file=sys.stderr)
        return 1 if stale else 0
    for path in generate.write(root):
        print(f"wrote {path.relative_to(root)}")
    return 0


def _dev_cli() -> types.ModuleType | None:
    """The dev tooling is optional: absent from the operator image."""
    try:
        return importlib.import_module("megafleet_dev.cli")
    except ModuleNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
