"""Progress lines for long work (builds, start-up), printed to stderr so stdout stays parseable."""

from __future__ import annotations

import sys
from collections.abc import Callable

Progress = Callable[[str], None]


def print_progress(message: str) -> None:
    """The default :data:`Progress` sink: one flushed ``[megafleet]`` line per step."""
    print(f"[megafleet] {message}", file=sys.stderr, flush=True)
