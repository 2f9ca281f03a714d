"""The pure decisions of in-flight refits, as tables: what an attempt does with the sequences in flight
and where it writes (:func:`megafleet_engine.refit_attempts.modes.resolve`), the staging memory rule
(:func:`megafleet_engine.refit_staging.decide`) and how free memory is read on the CPU, and the pause
point's hand-offs without a backend thread (:mod:`megafleet_engine.pause_point`)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from megafleet_engine import pause_point, refit_staging
from megafleet_engine.backends import base, transformers_backend
from megafleet_engine.refit_attempts import controller, modes, phases, staging_memory
from megafleet_protocol import vocabulary

GIB = 2**30
COPY = refit_staging.StagingPlan("auto", bytes=3 * GIB)
NO_ROOM = refit_staging.StagingPlan("auto", reason="needs 4.0 GiB (P 1.0 + B 2.0 + H 1.0 GiB), free 2.0 GiB")
TRANSFORMERS: frozenset[vocabulary.KvCacheMode] = frozenset({"persist", "recompute"})


@dataclasses.dataclass(frozen=True)
class Case:
    in_flight: vocabulary.InFlightMode
    kv: vocabulary.KvCacheMode
    staging: vocabulary.StagingMode
    keep_modes: frozenset[vocabulary.KvCacheMode]
    copy: refit_staging.StagingPlan
    expected: modes.Modes


def in_flight(
    requested: vocabulary.InFlightMode,
    effective: vocabulary.InFlightMode,
    kv: vocabulary.KvCacheMode,
    reason: str | None = None,
) -> phases.InFlight:
    return phases.InFlight(requested=requested, effective=effective, kv_cache_mode=kv, reason=reason)


IN_PLACE = phases.Staging(requested="off", effective="inPlace")
CANNOT_KEEP = "the transformers backend cannot keep sequences across a refit; drained"
CANNOT_STAGE = "this backend cannot stage a refit: it writes weights in place only"
CASES = {
    "keep-persist": Case(
        "keep", "persist", "off", TRANSFORMERS, COPY, modes.Modes(in_flight("keep", "keep", "persist"), IN_PLACE)
    ),
    "keep-recompute": Case(
        "keep", "recompute", "off", TRANSFORMERS, COPY, modes.Modes(in_flight("keep", "keep", "recompute"), IN_PLACE)
    ),
    "keep-offload-drains": Case(
        "keep",
        "offload",
        "off",
        TRANSFORMERS,
        COPY,
        modes.Modes(
            in_flight(
                "keep",
                "drain",
                "offload",
                "the transformers backend keeps with persist or recompute, not offload; drained",
            ),
            IN_PLACE,
        ),
    ),
    "keep-on-a-backend-that-cannot": Case(
        "keep",
        "persist",
        "off",
        frozenset(),
        COPY,
        modes.Modes(
            in_flight(
                "keep", "drain", "persist", "the transformers backend cannot keep sequences across a refit; drained"
            ),
            IN_PLACE,
        ),
    ),
    "drain-stays": Case(
        "drain", "offload", "off", frozenset(), COPY, modes.Modes(in_flight("drain", "drain", "offload"), IN_PLACE)
    ),
    "abort-stays": Case(
        "abort", "persist", "off", TRANSFORMERS, COPY, modes.Modes(in_flight("abort", "abort", "persist"), IN_PLACE)
    ),
    "auto-stages": Case(
        "keep",
        "persist",
        "auto",
        TRANSFORMERS,
        COPY,
        modes.Modes(
            in_flight("keep", "keep", "persist"), phases.Staging(requested="auto", effective="staged", bytes=3 * GIB)
        ),
    ),
    "auto-without-room-writes-in-place": Case(
        "drain",
        "persist",
        "auto",
        TRANSFORMERS,
        NO_ROOM,
        modes.Modes(
            in_flight("drain", "drain", "persist"),
            phases.Staging(requested="auto", effective="inPlace", reason=NO_ROOM.reason),
        ),
    ),
    "required-stages": Case(
        "abort",
        "persist",
        "required",
        TRANSFORMERS,
        COPY,
        modes.Modes(
            in_flight("abort", "abort", "persist"),
            phases.Staging(requested="required", effective="staged", bytes=3 * GIB),
        ),
    ),
    "required-without-a-copy-is-unavailable": Case(
        "keep",
        "persist",
        "required",
        TRANSFORMERS,
        refit_staging.OFF,
        modes.Modes(
            in_flight("keep", "keep", "persist"),
            phases.Staging(requested="required", effective="inPlace", reason=refit_staging.OFF.reason),
            unavailable=f"StagingUnavailable: staging is required, but {refit_staging.OFF.reason}",
        ),
    ),
    "off-ignores-the-copy": Case(
        "keep", "persist", "off", TRANSFORMERS, COPY, modes.Modes(in_flight("keep", "keep", "persist"), IN_PLACE)
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_resolve(case: Case) -> None:
    resolved = modes.resolve(
        in_flight=case.in_flight,
        kv_cache_mode=case.kv,
        staging=case.staging,
        backend="transformers",
        keep_modes=case.keep_modes,
        copy=case.copy,
    )
    assert resolved == case.expected
    assert resolved.suspend_mode == ("abort" if case.expected.in_flight.effective == "abort" else "drain")


NEEDS = refit_staging.Needs(parameters=GIB, buffers=2 * GIB, headroom=GIB)


@pytest.mark.parametrize(
    ("mode", "needs", "free", "expected"),
    [
        ("off", NEEDS, 100 * GIB, refit_staging.OFF),
        ("auto", NEEDS, 4 * GIB, refit_staging.StagingPlan("auto", bytes=GIB)),
        ("required", NEEDS, 5 * GIB, refit_staging.StagingPlan("required", bytes=GIB)),
        (
            "auto",
            NEEDS,
            4 * GIB - 1,
            refit_staging.StagingPlan("auto", reason="needs 4.0 GiB (P 1.0 + B 2.0 + H 1.0 GiB), free 4.0 GiB"),
        ),
        (
            "required",
            refit_staging.Needs(parameters=15 * GIB, buffers=2 * GIB, headroom=GIB),
            int(9.8 * GIB),
            refit_staging.StagingPlan("required", reason="needs 18.0 GiB (P 15.0 + B 2.0 + H 1.0 GiB), free 9.8 GiB"),
        ),
        (
            "auto",
            refit_staging.Needs(parameters=0, buffers=2 * GIB, headroom=GIB),
            100 * GIB,
            refit_staging.StagingPlan(
                "auto", reason="this backend cannot stage a refit: it writes weights in place only"
            ),
        ),
    ],
    ids=["off", "room", "room-required", "one-byte-short", "the-proposal's-8B", "backend-cannot"],
)
def test_the_staging_memory_rule(
    mode: vocabulary.StagingMode, needs: refit_staging.Needs, free: int, expected: refit_staging.StagingPlan
) -> None:
    assert refit_staging.decide(mode, needs, free) == expected


def test_free_memory_on_the_cpu_reads_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    assert staging_memory._meminfo_available(meminfo) == 8000000 * 1024
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert staging_memory._cgroup_room(cgroup) is None  # no limit files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert staging_memory._cgroup_room(cgroup) is None
    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{3 * GIB}\n")
    assert staging_memory._cgroup_room(cgroup) == 5 * GIB
    v1 = tmp_path / "v1"  # cgroup v1 (the real node's): the pod's limit counts there too
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    assert staging_memory._cgroup_room(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    assert staging_memory._cgroup_room(v1) == GIB
    free, measured = staging_memory.free_memory("cpu")
    assert free > 0 and measured.startswith("free (")


def test_a_backend_is_named_by_its_class() -> None:
    assert controller.backend_name(object.__new__(transformers_backend.TransformersBackend)) == "transformers"


def test_the_pause_point_hands_calls_and_releases_to_the_parked_thread_only() -> None:
    point = pause_point.PausePoint()
    assert not point.submit(pause_point.Call(lambda: None)), "no pause asked: the caller queues it itself"
    assert not point.release(pause_point.Release()), "nothing parked to release"
    point.request()
    queued = pause_point.Call(lambda: 7)
    assert point.submit(queued)
    assert point.withdraw() == [queued], "taken back before parking: the call goes back to the caller"
    assert not point.requested

    point.request()
    ran = pause_point.Call(lambda: 41)
    assert point.submit(ran)
    order = pause_point.SwitchOrder(3, "recompute", staged=False)
    released: list[pause_point.Release] = []
    thread = threading.Thread(target=lambda: released.append(point.park(5, between_batches=False)))
    thread.start()
    assert point.wait_parked(10) and point.parked
    assert ran.done.wait(10) and ran.result == 41, "calls queued before the park run on the parked thread"
    assert point.release(pause_point.Release(switch=order)) and not point.release(pause_point.Release())
    thread.join(10)
    assert released == [pause_point.Release(switch=order)] and not point.parked and not point.requested
    switch = point.backend_switch(order)
    assert (switch.version, switch.kv_cache_mode, switch.staged) == (3, "recompute", False)
    switch.done(base.Switched(recomputed_tokens=12, recompute_seconds=0.5))
    point.settle_switch()  # reported already: nothing more
    assert order.applied.is_set() and order.paused is not None
    assert (order.paused.kept, order.paused.recomputed_tokens, order.paused.recompute_seconds) == (5, 12, 0.5)
    assert (point.kept_sequences, point.recomputed_tokens) == (5, 12)
