"""``python3 -m megafleet_dev.go_lane [NAME ...]``: build the named Go components (the control
plane's when none are named) with nothing but the standard library.

``make up`` runs it beside pip's install of the Python environment: on a new machine the two take
minutes each, and one after the other they made a first ``make up`` miss its 10-minute goal. The
virtual environment does not exist yet while it runs, so this module and everything it imports
(:mod:`megafleet_dev.toolchain`, :mod:`megafleet_dev.progress`) use the standard library only
(``tests/unit/test_builds.py`` checks it).
"""

from __future__ import annotations

import sys
import time

from megafleet_dev import progress, toolchain

UP = ("etcd", "kubernetes", "kwok")
"""What ``megafleet dev up`` starts (helm is only for the chart's tests and the realnode tier)."""


def main(argv: list[str] | None = None) -> int:
    """Build the components named in ``argv`` (default :data:`UP`) that are not cached yet."""
    names = tuple(sys.argv[1:] if argv is None else argv) or UP
    known = {component.name for component in toolchain.COMPONENTS}
    unknown = sorted(set(names) - known)
    if unknown:
        sys.stderr.write(f"go_lane: unknown components {unknown}; choose from {sorted(known)}\n")
        return 2
    missing = [c.name for c in toolchain.COMPONENTS if c.name in names and not toolchain.is_built(c)]
    if not missing:
        progress.print_progress(f"Go lane: {', '.join(names)} already built")
        return 0
    progress.print_progress(f"Go lane: building {', '.join(missing)} while the Python environment installs")
    started = time.monotonic()
    try:
        toolchain.ensure_built(names)
    except toolchain.ToolchainError as error:
        sys.stderr.write(f"go_lane: {error}\n")
        return 1
    progress.print_progress(f"Go lane: done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
