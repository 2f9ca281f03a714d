"""The ``megafleet`` command.

Sub-commands: ``version``; ``dev`` (the local control plane; needs the development extra and is
delegated to :mod:`megafleet_dev.cli`). Later sub-commands run the operator.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from collections.abc import Sequence

import megafleet


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megafleet", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the version")
    dev = commands.add_parser("dev", help="local control plane with simulated GPU nodes (development and tests)")
    dev_cli = _dev_cli()
    if dev_cli is not None:
        dev_cli.add_arguments(dev)
    args = parser.parse_args(argv)
    if args.command == "version":
        print(megafleet.__version__)
        return 0
    if dev_cli is None:
        print("megafleet dev needs the development tooling: pip install -e '.[dev]' from a checkout", file=sys.stderr)
        return 2
    result: int = dev_cli.run(args)
    return result


def _dev_cli() -> types.ModuleType | None:
    """The dev tooling is optional: absent from the operator image."""
    try:
        return importlib.import_module("megafleet_dev.cli")
    except ModuleNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
