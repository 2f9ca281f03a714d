"""The soak (docs/development.md#chaos-drills-and-the-soak): a 3-shard tiny fleet under client load
for ``minutes``, a checkpoint Refit every :data:`REFIT_SECONDS` (weights alternating between two
sources, versions 1, 2, 3...) and a scale change (3 → 2 → 3 ...) every :data:`SCALE_SECONDS`
(shorter for short runs: three changes in all). The operator's and every engine's resident memory,
open file descriptors and threads are sampled from ``/proc`` throughout.

Used by ``tests/chaos/test_soak.py``: ``make test`` runs a short soak, ``make soak`` the full 30
minutes (``MEGAFLEET_SOAK_MINUTES``) and writes its figures to ``bench/results/``.
What must hold: every request served (0 failed, 0 mixed), versions never backwards on any frontend,
every Refit Succeeded, and after warm-up no process grows its memory by more than
:data:`MAX_RSS_GROWTH` nor its descriptors or threads beyond small slack.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from chaos import drill as drill_module
from helpers import refit_e2e as base
from megafleet_dev import kube

REFIT_SECONDS = 10.0
SCALE_SECONDS = 120.0
SAMPLE_SECONDS = 5.0
WARM_UP_FRACTION = 0.25
"""Samples before this share of the run are the warm-up (imports, first allocations, caches)."""
MAX_RSS_GROWTH = 0.10
FD_SLACK = 8
"""Open descriptors a process may hold beyond its post-warm-up median (connections come and go)."""
THREAD_SLACK = 4
SOURCES = ("tiny://llama?seed=11", "tiny://llama?seed=7")
"""Refit ``v`` loads ``SOURCES[v % 2]``; version 0 is the fleet's own ``tiny://llama``."""


def source_of(version: int) -> str:
    return drill_module.SOURCES[0] if version == 0 else SOURCES[version % 2]


def expected_tokens(max_version: int) -> dict[int, list[int]]:
    """The greedy tokens of every version up to ``max_version`` (three distinct models in all)."""
    by_source = {source: drill_module.greedy(source) for source in {drill_module.SOURCES[0], *SOURCES}}
    return {version: by_source[source_of(version)] for version in range(max_version + 1)}


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float
    process: str  # "operator" or the engine's pod name and PID
    rss_kib: int
    fds: int
    threads: int


def read_process(pid: int) -> tuple[int, int, int] | None:
    """(RSS KiB, open descriptors, threads) of ``pid`` and its direct children (an engine's API
    servers), or None once it is gone."""
    total = [0, 0, 0]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for member in (pid, *map(int, children)):
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{member}/status").read_text().splitlines() if ":" in line
            )
            total[0] += int(fields["VmRSS"].split()[0])
            total[1] += len(os.listdir(f"/proc/{member}/fd"))
            total[2] += int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None
    return total[0], total[1], total[2]


class Sampler:
    """Samples the operator and the namespace's engines every :data:`SAMPLE_SECONDS`, on a thread."""

    def __init__(self, drill: drill_module.Drill) -> None:
        self.drill = drill
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            watched = {"operator": self.drill.operator.pid}
            folder = self.drill.pod_runner.workdir / self.drill.namespace
            for process in list(self.drill.pod_runner.processes.values()):
                if process.log.parent.parent == folder:
                    watched[f"{process.name}/{process.popen.pid}"] = process.popen.pid
            for name, pid in watched.items():
                figures = read_process(pid)
                if figures is not None:
                    self.samples.append(Sample(now, name, *figures))
            self._stop.wait(SAMPLE_SECONDS)  # the sampling period


@dataclasses.dataclass(frozen=True)
class Growth:
    process: str
    rss_mib: tuple[float, float]
    fds: tuple[float, float]
    threads: tuple[float, float]
    """Each: (median just after warm-up, median of the last quarter)."""

    def problems(self) -> list[str]:
        found = []
        if self.rss_mib[1] > self.rss_mib[0] * (1 + MAX_RSS_GROWTH):
            found.append(f"{self.process}: RSS {self.rss_mib[0]:.0f} -> {self.rss_mib[1]:.0f} MiB")
        if self.fds[1] > self.fds[0] + FD_SLACK:
            found.append(f"{self.process}: descriptors {self.fds[0]:.0f} -> {self.fds[1]:.0f}")
        if self.threads[1] > self.threads[0] + THREAD_SLACK:
            found.append(f"{self.process}: threads {self.threads[0]:.0f} -> {self.threads[1]:.0f}")
        return found


def growth(samples: list[Sample], start: float, end: float) -> list[Growth]:
    """Per process alive through the whole measured window: its figures after warm-up (the second
    quarter of the run) against the last quarter. Engines replaced by a scale change are left out."""
    span = end - start
    early = (start + span * WARM_UP_FRACTION, start + span * 0.5)
    late = (start + span * 0.75, end)
    found = []
    for process in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == process]
        first = [s for s in mine if early[0] <= s.at <= early[1]]
        last = [s for s in mine if late[0] <= s.at <= late[1]]
        if not first or not last or mine[0].at > early[0]:
            continue
        found.append(
            Growth(
                process,
                (statistics.median(s.rss_kib for s in first) / 1024, statistics.median(s.rss_kib for s in last) / 1024),
                (statistics.median(s.fds for s in first), statistics.median(s.fds for s in last)),
                (statistics.median(s.threads for s in first), statistics.median(s.threads for s in last)),
            )
        )
    return found


def backwards(outcomes: list[drill_module.Outcome]) -> list[str]:
    """Answers whose version is below an earlier answer's from the same frontend."""
    latest: dict[str, int] = {}
    found = []
    for outcome in sorted(outcomes, key=lambda o: o.at):
        if outcome.version is None:
            continue
        if outcome.version < latest.get(outcome.target, -1):
            found.append(f"{outcome.target}: {latest[outcome.target]} then {outcome.version}")
        latest[outcome.target] = max(outcome.version, latest.get(outcome.target, -1))
    return found


@dataclasses.dataclass
class Soak:
    """One soak in ``drill``'s namespace; ``run`` returns when ``minutes`` have passed."""

    drill: drill_module.Drill
    minutes: float
    refits: list[tuple[int, str, float]] = dataclasses.field(default_factory=list)
    """(version, final phase, seconds from creation to that phase)."""
    scales: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """(replicas, seconds until the fleet was Ready at them)."""

    def scale_seconds(self) -> float:
        return min(SCALE_SECONDS, self.minutes * 60 / 4)

    def run(self) -> None:
        kube_admin = self.drill.kube
        end = time.monotonic() + self.minutes * 60
        next_scale = time.monotonic() + self.scale_seconds()
        replicas, version = 3, 0
        while time.monotonic() < end:
            started = time.monotonic()
            version += 1
            self.refits.append((version, *self._refit(kube_admin, version)))
            if time.monotonic() >= next_scale:
                replicas = 2 if replicas == 3 else 3
                self.scales.append((replicas, self._scale(kube_admin, replicas)))
                next_scale = time.monotonic() + self.scale_seconds()
            time.sleep(max(0.0, started + REFIT_SECONDS - time.monotonic()))  # the refit cadence
        self.scales.append((3, self._scale(kube_admin, 3)) if replicas != 3 else (3, 0.0))

    def _refit(self, kube_admin: kube.Kube, version: int) -> tuple[str, float]:
        started = time.monotonic()
        self.drill.refit_checkpoint(version, source_of(version))
        path = f"{base.refits(self.drill.namespace)}/{drill_module.FLEET}-v{version}"
        refit = kube_admin.wait(
            path, base.refit_ended, timeout=drill_module.STEP_TIMEOUT_SECONDS, what=f"Refit v{version} ended"
        )
        return str(drill_module.refit_phase(refit)), round(time.monotonic() - started, 1)

    def _scale(self, kube_admin: kube.Kube, replicas: int) -> float:
        started = time.monotonic()
        kube_admin.patch(f"{self.drill.fleet_path}/scale", {"spec": {"replicas": replicas}})
        kube_admin.wait(
            self.drill.fleet_path,
            lambda f: base.ready(f) and (f or {}).get("status", {}).get("readyReplicas") == replicas,
            timeout=drill_module.STEP_TIMEOUT_SECONDS,
            what=f"Ready at {replicas} replicas",
        )
        return round(time.monotonic() - started, 1)


def table(growths: list[Growth]) -> Iterator[str]:
    yield f"{'process':<26}{'RSS MiB':>18}{'fds':>12}{'threads':>12}"
    for g in growths:
        yield (
            f"{g.process:<26}{g.rss_mib[0]:>8.0f} -> {g.rss_mib[1]:<6.0f}"
            f"{g.fds[0]:>5.0f} -> {g.fds[1]:<3.0f}{g.threads[0]:>5.0f} -> {g.threads[1]:<3.0f}"
        )
