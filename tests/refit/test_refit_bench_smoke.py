"""``bench/refit_nccl.py --cpu`` end to end: the GPU refit benchmark's code path (engine processes
through the CLI, the broadcast baseline's helper, prepare + WeightSender + status polling, the
checks, the result file) on CPU with gloo and the tiny model, one refit per engine, so a broken
script is found here rather than on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
        "1",
        "--tiny-repeats",
        "1",
        "--bucket-sizes-mib",
        "1",
        "--max-seconds",
        str(TIMEOUT_SECONDS - 10),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    assert result["verification"] == {"refits": 2, "failed_refits": 0, "passed": True, "failed_checks": {}}
    (main_run,) = result["refits"]["bucket_1_mib"]["runs"]
    assert main_run["version"] == 1 and main_run["bytes_received"] == main_run["payload_bytes"] > 0
    assert set(main_run["engine"]["phases_s"]) == {"suspend", "join", "receive", "apply", "resume"}
    assert result["nccl_broadcast"]["before"][0]["gb_per_s"] > 0
    assert result["headline"]["ratio_to_nccl_broadcast"]["end_to_end"] > 0
    assert result["zero_byte"]["tiny_refits"]["runs"][0]["checks"]["completion_weight_version"]
