"""``bench/serving.py`` on CPU with the tiny model: the H200 serving benchmark's code path (direct,
the scheduler, HTTP through the engine core's API-server processes with clients in processes of
their own, streaming and not; TTFT/ITL; RSS of every process), so a broken script is found here
rather than on the GPU machine. No figure is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts API-server and client processes

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("direct", "engine", "http", "http_stream", "http_stream_httpx")


def test_serving_bench_cpu_smoke_run_writes_every_path(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    command = [sys.executable, str(ROOT / "bench" / "serving.py"), "--backend", "transformers"]
    command += ["--source", "tiny://llama", "--dtype", "float32", "--batches", "1,3", "--latency-batch", "3"]
    command += ["--prompt-tokens", "4", "--new-tokens", "4", "--max-sequence-length", "32"]
    command += ["--api-servers", "2", "--client-processes", "2", "--paths", ",".join(PATHS), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    for batch in ("batch_1", "batch_3"):
        row = result["figures"][batch]
        assert set(row) == set(PATHS)
        assert all(row[path]["tokens"] == int(batch.split("_")[1]) * 4 for path in PATHS)
        assert all(row[path]["tokens_equal_direct"] for path in PATHS[1:])  # greedy, float32: same tokens
    assert result["figures"]["batch_3"]["http_stream"]["itl"]["count"] == 3 * 3
    assert len(result["rss_mib"]["api_servers"]) == 2 and len(result["rss_mib"]["clients"]) == 2
    busy = result["figures"]["batch_3"]["http_stream"]["cpu_busy"]
    assert len(busy["core"]) == 1 and len(busy["api_servers"]) == 2 and len(busy["clients"]) == 2
    assert all(value is not None and value >= 0 for values in busy.values() for value in values)
    assert result["api_servers_load_torch"] == [False, False]


def test_serving_bench_synthetic_backend_runs_the_serving_path_alone(tmp_path: Path) -> None:
    """``--backend synthetic`` (no model, fixed step time): joins running batches like megatron's
    engine, and its tokens follow from the prompt, so every path returns the same ones."""
    out = tmp_path / "synthetic.json"
    paths = ("direct", "engine", "http_stream")
    command = [sys.executable, str(ROOT / "bench" / "serving.py"), "--backend", "synthetic", "--step-ms", "5"]
    command += ["--source", "tiny://llama", "--dtype", "float32", "--batches", "6", "--latency-batch", "6"]
    command += ["--prompt-tokens", "4", "--new-tokens", "5", "--max-sequence-length", "32", "--repeats", "1"]
    command += ["--api-servers", "1", "--client-processes", "2", "--paths", ",".join(paths), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}
    row = result["figures"]["batch_6"]
    assert all(row[path]["tokens"] == 6 * 5 for path in paths)
    assert row["engine"]["tokens_equal_direct"] and row["http_stream"]["tokens_equal_direct"]
    assert row["http_stream"]["itl"]["count"] == 6 * 4
