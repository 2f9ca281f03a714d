"""``bench/inflight_refit.py``: the in-flight refit benchmark's checks as pure functions (the span
check, the pause figures, the verdict, the modes' request fields), and its CPU smoke run end to end
(the engine and trainer processes, the closed loop, refits in drain and abort, a mode the engine
refuses with 409 reported as unsupported, the baseline run first and last), so a broken script is
found here rather than on the GPU machine. No figure is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TIMEOUT_SECONDS = 240  # under a minute on two idle cores; the engine's start-up dominates


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """The script as a module (it imports its neighbours ``benchkit`` and ``refit_nccl``)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("inflight_refit", BENCH / "inflight_refit.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def answer(bench: ModuleType, chunks: list[tuple[float, int, int]], spans: list[tuple[int, int]], **fields: Any) -> Any:
    """A completed probe with ``chunks`` ``(arrival, tokens, version)`` and the spans its last chunk carried."""
    tokens = sum(count for _, count, _ in chunks)
    defaults: dict[str, Any] = {"response_version": spans[0][1], "finish_reason": "length", "error": None}
    defaults.update(fields)
    return bench.Answer(
        "probe",
        0.0,
        10.0,
        tokens,
        defaults["finish_reason"],
        defaults["error"],
        spans,
        defaults["response_version"],
        chunks=chunks,
    )


def versions(bench: ModuleType, prepared: dict[int, float]) -> Any:
    return bench.Versions(initial=0, current=max(prepared), prepared_at=prepared, succeeded=set(prepared))


@pytest.mark.parametrize(
    ("name", "in_flight", "kv", "staged"),
    [
        ("none", None, None, False),
        ("drain", "drain", None, False),
        ("abort-staged", "abort", None, True),
        ("keep-persist", "keep", "persist", False),
        ("keep-recompute-staged", "keep", "recompute", True),
        ("keep-offload", "keep", "offload", False),
    ],
)
def test_modes_parse_into_their_refit_choices(
    bench: ModuleType, name: str, in_flight: str | None, kv: str | None, staged: bool
) -> None:
    mode = bench.parse_mode(name)
    assert (mode.name, mode.in_flight, mode.kv_cache_mode, mode.staged) == (name, in_flight, kv, staged)


@pytest.mark.parametrize("name", ["keep", "keep-staged", "none-staged", "drain-persist", "keep-persist-extra", "hold"])
def test_unknown_modes_are_refused(bench: ModuleType, name: str) -> None:
    with pytest.raises(Exception, match="unknown mode"):
        bench.parse_mode(name)


def test_request_fields_follow_the_agent_api(bench: ModuleType) -> None:
    keep = bench.parse_mode("keep-persist-staged").request_fields("auto", "checksum")
    assert keep == {"suspendMode": "keep", "kvCacheMode": "persist", "staging": "auto", "integrity": "checksum"}
    drain = bench.parse_mode("drain").request_fields("auto", "none")
    assert drain == {"suspendMode": "drain", "staging": "off", "integrity": "none"}


def test_the_engine_gets_the_variables_it_reads_for_the_modes_listed(bench: ModuleType) -> None:
    args = bench.parse_args(["--backend", "transformers", "--batch", "8", "--modes", "none,keep-recompute-staged"])
    assert [mode.name for mode in args.modes] == ["none", "keep-recompute-staged", "none"]  # the baseline last too
    passed, not_read = bench.engine_env(args)
    assert passed["MEGAFLEET_KV_CACHE_MODE"] == "recompute" and passed["MEGAFLEET_MAX_BATCH_SIZE"] == "8"
    assert passed["MEGAFLEET_MAX_SEQUENCE_LENGTH"] == str(128 + 2048)
    assert ("MEGAFLEET_REFIT_STAGING" in passed) != ("MEGAFLEET_REFIT_STAGING" in not_read)
    assert (args.span_probes, args.probe_request_size, args.stagger_s) == (8, 8, 0.0)  # one stream: static batches


def test_integrity_goes_to_the_sender_that_takes_it(bench: ModuleType) -> None:
    class Sealing:
        def __init__(self, port: int, integrity: str = "checksum") -> None: ...

    class Plain:
        def __init__(self, port: int) -> None: ...

    assert bench.sender_integrity(Sealing, "none") == {"init": {"integrity": "none"}, "send": {}, "passed": True}
    assert bench.sender_integrity(Sealing, "checksum")["init"] == {"integrity": "checksum"}
    assert bench.sender_integrity(Plain, "checksum") == {"init": {}, "send": {}, "passed": False}
    assert bench.sender_integrity(Plain, "none")["passed"]


def test_a_kept_probe_with_two_spans_passes_only_under_keep(bench: ModuleType) -> None:
    served = versions(bench, {1: 1.0, 2: 5.0})
    probe = answer(bench, [(2.0, 3, 1), (3.0, 2, 1), (6.0, 4, 2)], [(0, 1), (5, 2)])
    assert bench.span_problems(probe, bench.parse_mode("keep-persist"), served) == []
    assert bench.span_problems(probe, bench.parse_mode("drain"), served) == [
        "2 spans under drain: a sequence spanned a refit"
    ]


@pytest.mark.parametrize(
    ("chunks", "spans", "fields", "problem"),
    [
        ([(2.0, 3, 1), (6.0, 2, 2)], [(0, 1), (4, 2)], {}, "differ from the chunks' versions"),
        ([(2.0, 3, 1), (4.0, 2, 2)], [(0, 1), (3, 2)], {}, "arrived before its refit was prepared"),
        ([(2.0, 3, 2), (6.0, 2, 1)], [(0, 2), (3, 1)], {}, "not strictly increasing"),
        ([(2.0, 3, 1), (6.0, 2, 7)], [(0, 1), (3, 7)], {}, "outside the versions served"),
        ([(2.0, 3, 1)], [(0, 1)], {"response_version": 2}, "is not the first span's"),
        ([(2.0, 3, 1)], [(1, 1)], {}, "span starts"),
        ([(2.0, 3, 1)], [], {}, "no weight_version_spans"),
    ],
)
def test_span_check_names_what_is_wrong(
    bench: ModuleType, chunks: list[tuple[float, int, int]], spans: list[tuple[int, int]], fields: Any, problem: str
) -> None:
    probe = answer(bench, chunks, spans or [(0, 1)], **fields)
    probe.spans = spans
    problems = bench.span_problems(probe, bench.parse_mode("keep-recompute"), versions(bench, {1: 1.0, 2: 5.0}))
    assert any(problem in found for found in problems), problems


def test_a_batched_requests_weight_version_is_its_earliest_choices(bench: ModuleType) -> None:
    served = versions(bench, {1: 1.0, 2: 5.0})
    late = bench.Answer("bulk", 0.0, 9.0, 4, "length", None, [(0, 2)], 1, request_first=1)
    assert bench.span_problems(late, bench.parse_mode("keep-persist"), served) == []
    wrong = bench.Answer("bulk", 0.0, 9.0, 4, "length", None, [(0, 2)], 2, request_first=1)
    assert bench.span_problems(wrong, bench.parse_mode("keep-persist"), served) == [
        "weight_version 2 is not the first span's 1"
    ]


def test_failed_answers_are_not_span_checked(bench: ModuleType) -> None:
    aborted = answer(bench, [(2.0, 3, 1)], [(0, 1)], finish_reason=None, error="stream error: aborted")
    aborted.spans = None
    assert bench.span_problems(aborted, bench.parse_mode("abort"), versions(bench, {1: 1.0})) == []


def test_probe_gap_is_the_longest_gap_overlapping_the_refit(bench: ModuleType) -> None:
    arrivals = [0.0, 0.01, 0.02, 0.5, 0.51, 2.0]
    assert bench.probe_gap_ms(arrivals, 0.015, 0.3) == 480.0
    assert bench.probe_gap_ms(arrivals, 0.505, 0.506) == 10.0
    assert bench.probe_gap_ms([1.0], 0.0, 2.0) is None


def test_switch_skew_compares_the_probes_last_old_and_first_new_chunks(bench: ModuleType) -> None:
    first = answer(bench, [(1.0, 1, 1), (2.0, 1, 1), (3.0, 1, 2)], [(0, 1), (2, 2)])
    second = answer(bench, [(1.5, 1, 1), (3.1, 1, 2)], [(0, 1), (1, 2)])
    assert bench.switch_skew_ms([first, second], 2) == -1000.0
    assert bench.switch_skew_ms([first, second], 3) is None


def refit_record(**fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"version": 2, "outcome": "succeeded", "_prepared": 0.1, "_ended": 0.4}
    record.update(duration_ms=300, phases_ms={"suspend": 200, "receive": 40, "apply": 10}, pause=None)
    record.update(fields)
    return record


def test_pause_figures_prefer_the_agents_pause_report(bench: ModuleType) -> None:
    pause = {"stallMilliseconds": 11.0, "gateClosedMilliseconds": 12.0, "switchMilliseconds": 9.0}
    record = refit_record(pause=pause | {"recomputeMilliseconds": 0.0})
    bench.pause_figures(record, [0.0, 0.2, 0.3], [], bench.parse_mode("keep-persist-staged"))
    assert (record["stall_ms"], record["gate_closed_ms"], record["switch_ms"]) == (11.0, 12.0, 9.0)
    assert record["stall_ms_source"] == "agent pause" and record["engine_transfer_ms"] == 50


def test_pause_figures_without_a_report_come_from_the_probes_and_the_attempt(bench: ModuleType) -> None:
    record = refit_record()
    bench.pause_figures(record, [0.0, 0.05, 0.35, 0.36], [], bench.parse_mode("drain"))
    assert (record["stall_ms"], record["stall_ms_source"]) == (300.0, "probes' longest gap")
    assert (record["gate_closed_ms"], record["gate_closed_ms_source"]) == (300, "attempt duration")
    keep = refit_record()
    bench.pause_figures(keep, [0.0, 0.05, 0.35, 0.36], [], bench.parse_mode("keep-persist"))
    assert "gate_closed_ms" not in keep  # keep without a pause report: no figure stands in for it


def test_percentiles_are_nearest_rank(bench: ModuleType) -> None:
    figure = bench.percentiles([float(value) for value in range(1, 201)])
    assert (figure["count"], figure["p50"], figure["p99"], figure["max"]) == (200, 100.5, 198.0, 200.0)
    assert bench.percentiles([])["p99"] is None


def test_failed_sequences_fail_every_mode_but_abort(bench: ModuleType) -> None:
    def row(in_flight: str) -> dict[str, Any]:
        return {
            "in_flight": in_flight,
            "refits": {"failed": []},
            "spans": {"passed": True, "examples": []},
            "sequences": {"failed": 3, "failures": {"HTTP 503": 3}},
        }

    assert bench.verdict(row("abort")) == {"passed": True, "why": []}
    assert not bench.verdict(row("drain"))["passed"]


@pytest.mark.slow  # starts an engine process and a trainer process
def test_inflight_bench_cpu_smoke_run_reports_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    command = [sys.executable, str(BENCH / "inflight_refit.py"), "--backend", "transformers", "--batch", "4"]
    command += ["--span-probes", "2", "--bulk-request-size", "2", "--prompt-tokens", "8", "--new-tokens", "24"]
    command += ["--refit-every", "0.5", "--warmup", "0.5", "--duration", "2", "--bucket-mib", "1"]
    command += ["--modes", "none,drain,abort,keep-persist", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    command += ["--max-seconds", str(TIMEOUT_SECONDS - 20)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["passed"]
    rows = {index: row for index, row in enumerate(result["modes"])}
    assert [row["mode"] for row in rows.values()] == ["none", "drain", "abort", "keep-persist", "none"]
    for row in (rows[0], rows[4]):  # the baseline, first and last
        assert row["supported"] and row["refits"]["count"] == 0 and row["window"]["tok_per_s"] > 0
        assert row["sequences"]["failed"] == 0 and row["sequences"]["thrown_away_tokens"] == 0
        assert row["spans"]["passed"] and row["spans"]["checked"] > 0 and row["spans"]["probes_checked"] > 0
    assert result["baseline"]["tok_per_s"] > 0 and len(result["baseline"]["runs"]) == 2
    drain, abort, keep = rows[1], rows[2], rows[3]
    assert drain["preflight_refit"]["outcome"] == "succeeded"
    assert drain["refits"]["succeeded"] >= 1 and drain["refits"]["failed"] == []
    assert drain["refits"]["gate_closed_ms"]["count"] == drain["refits"]["succeeded"]
    assert drain["sequences"]["failed"] == 0 and drain["sequences"]["thrown_away_tokens"] == 0
    assert drain["spans"]["passed"] and drain["ratio_to_baseline"] > 0
    assert abort["refits"]["succeeded"] >= 1 and abort["spans"]["passed"]
    assert abort["sequences"]["thrown_away_tokens"] >= 0
    runs = [run for row in (drain, abort) for run in row["refits"]["runs"]]
    assert all(run["trainer"]["ok"] and run["trainer"]["reused"] for run in runs)  # the preflight built the group
    versions = [run["version"] for run in runs]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    if keep["supported"]:  # once the engine keeps sequences across a refit
        assert keep["verdict"]["passed"] and keep["refits"]["succeeded"] >= 1
        assert keep["sequences"]["thrown_away_tokens"] == 0
    else:  # before: the agent's 409 refit_mode_unsupported, reported, the run goes on
        assert keep["unsupported_reason"] and keep["preflight_refit"]["prepare_http"] == 409
    assert [row["mode"] for row in result["headline"]] == [row["mode"] for row in result["modes"]]
