"""Progress lines for long work (builds, start-up), printed to stderr so stdout stays parseable."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[str], None]


def print_progress(message: str) -> None:
    """The default :data:`Progress` sink: one flushed ``[megafleet]`` line per step, written in one
    call so that lines of builds running in parallel (:mod:`megafleet_dev.builds`) never interleave."""
    sys.stderr.write(f"[megafleet] {message}\n")
    sys.stderr.flush()
