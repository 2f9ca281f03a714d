"""Everything a run needs built, in two lanes at once: the Go components (compiling: CPU-bound)
and the images (mmdebstrap and buildah: mostly downloading wheels and writing layers, IO-bound).

Called by ``megafleet dev build`` (what ``make test`` runs before pytest) and by
:func:`megafleet_dev.realnode.start`. On a 2-core machine two Go builds at once only share the
same cores, so the Go components stay one after another in their lane; the image lane overlaps
them (measured: docs/development.md, "Measured start-up"). Each lane reports through the same
:data:`~megafleet_dev.progress.Progress` sink, every line naming its component; a failure in one
lane lets the other finish (its product is cached for the next run) and is raised afterwards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

from megafleet_dev import images, progress, toolchain


@dataclasses.dataclass(frozen=True)
class Built:
    """What :func:`ensure_all` did: the images (pause first), and each lane's wall time in seconds."""

    images: list[images.Image]
    go_seconds: float
    images_seconds: float


def ensure_all(
    components: tuple[str, ...],
    targets: tuple[str, ...] | None,
    report: progress.Progress = progress.print_progress,
) -> Built:
    """Build the missing ``components`` (:data:`toolchain.COMPONENTS` names) and, unless
    ``targets`` is None, the pause image and the image ``targets``, the two lanes in parallel."""

    def go_lane() -> float:
        started = time.monotonic()
        toolchain.ensure_built(components, report=report)
        return time.monotonic() - started

    def image_lane() -> tuple[list[images.Image], float]:
        started = time.monotonic()
        built = images.ensure_all(targets, report) if targets is not None else []
        return built, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="megafleet-build") as pool:
        go = pool.submit(go_lane)
        imaged = pool.submit(image_lane)
    # Leaving the pool waited for both lanes.
    go_seconds = go.result()  # raises the Go lane's error, if any, once both lanes ended
    built, images_seconds = imaged.result()
    return Built(built, go_seconds, images_seconds)
