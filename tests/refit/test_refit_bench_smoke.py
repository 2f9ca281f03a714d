"""``bench/refit_nccl.py --cpu`` end to end: the GPU refit benchmark's code path (engine processes
through the CLI, the broadcast baseline's helper, prepare + WeightSender + status polling, the
checks, the result file) on CPU with gloo and the tiny model, two refits per engine over one sender
(the first builds the transfer group, the second keeps it: the headline), so a broken script is
found here rather than on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_SECONDS = 120  # about 15 s on two cores; engine start-up dominates


def test_refit_bench_cpu_smoke_run_passes_and_writes_its_result(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "refit_nccl.py"),
        "--cpu",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        "--repeats",
        "2",
        "--tiny-repeats",
        "2",
        "--bucket-sizes-mib",
        "1",
        "--max-seconds",
        str(TIMEOUT_SECONDS - 10),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert result["verification"] == {"refits": 4, "failed_refits": 0, "passed": True, "failed_checks": {}}
    first, second = result["refits"]["bucket_1_mib"]["runs"]
    assert [first["version"], second["version"]] == [1, 2]
    assert (first["group"], first["engine_reused"], second["group"], second["engine_reused"]) == (
        "fresh",
        False,
        "reused",
        True,
    )
    for run in (first, second):
        assert run["bytes_received"] == run["payload_bytes"] > 0
        assert set(run["engine"]["phases_s"]) == {"suspend", "join", "receive", "apply", "resume"}
    assert result["nccl_broadcast"]["before"][0]["gb_per_s"] > 0
    headline = result["headline"]
    assert headline["group"] == "reused" and headline["ratio_to_nccl_broadcast"]["end_to_end"] > 0
    assert headline["first_refit"]["end_to_end_ms"] > 0
    assert result["refits"]["bucket_1_mib"]["median"]["runs"] == 1
    assert [run["group"] for run in result["zero_byte"]["tiny_refits"]["runs"]] == ["fresh", "reused"]
    assert result["zero_byte"]["tiny_refits"]["runs"][1]["checks"]["completion_weight_version"]


def test_refit_bench_alternates_integrities_and_reports_the_cost_of_digests(tmp_path: Path) -> None:
    """``--integrity none,checksum``: the refits of a series alternate (ABAB), every checksum refit is
    sealed by the trainer and verified by the engine, and the cost of digests is reported."""
    out = tmp_path / "result.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "refit_nccl.py"),
        "--cpu",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
        "--repeats",
        "3",
        "--no-tiny",
        "--bucket-sizes-mib",
        "1",
        "--integrity",
        "none,checksum",
        "--max-seconds",
        str(TIMEOUT_SECONDS - 10),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["verification"]["passed"], result["verification"]
    series = result["refits"]["bucket_1_mib"]
    runs = series["runs"]
    assert [(run["integrity"], run["group"], run["verified"]) for run in runs] == [
        ("none", "fresh", False),
        ("checksum", "reused", True),
        ("none", "reused", False),
    ]
    assert runs[1]["verification"]["method"] == "trainerDigest" and runs[1]["verification"]["buckets"] > 0
    assert all(run["checks"]["verified_as_asked"] for run in runs)
    assert series["median"]["runs"] == 1, "the median (and headline) are the first integrity's reused refits"
    assert set(series["by_integrity"]) == {"none", "checksum"}
    assert set(series["integrity_cost"]["checksum"]) == {"transfer_sender", "end_to_end", "receive_apply_engine"}
    assert result["headline"]["integrity"] == series["integrity_cost"]
