"""What the GPU benchmarks share (``engine_megatron.py``, ``serving.py``, ``profile_decode.py``): the
machine's details, building the backend, the prompts, megatron-core's engine called directly, and
timing with repeats (median and spread).

Imported by those scripts from their own folder (``python3 bench/<script>.py`` puts ``bench/`` on
the path). Imports torch lazily where the CPU smoke run of ``serving.py`` does not need CUDA.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megafleet_engine.backends import base

Tokens = list[list[int]]

PACKAGES = (
    "megatron-core",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "transformers",
    "pyzmq",
    "msgspec",
    "uvicorn",
)


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine and library versions a result was measured with."""
    import torch

    from megafleet_protocol import engine_settings as settings

    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        smi = f"none ({type(error).__name__})"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
        "usable_cpus": settings.usable_cpus(),
        "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "nvidia_smi": smi,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name.replace("-", "_"): version(name) for name in PACKAGES},
    }


def load_megatron(
    source: str,
    *,
    max_sequence_length: int,
    max_batch_size: int,
    kv_cache_gib: float,
    cuda_graphs: bool = True,
    dtype: str = "bfloat16",
    **options: Any,
) -> Any:
    """The megatron backend on this process's GPU, random (or checkpoint) weights loaded;
    ``options`` are further :class:`~megafleet_engine.backends.megatron.EngineOptions` fields."""
    from megafleet_engine.backends import megatron

    return megatron.load(
        source,
        name="bench",
        max_sequence_length=max_sequence_length,
        dtype=dtype,
        device="cuda",
        load_weights=True,
        options=megatron.EngineOptions(
            max_batch_size=max_batch_size, kv_buffer_gb=kv_cache_gib, cuda_graphs=cuda_graphs, **options
        ),
    )


def prompts(vocab: int, batch: int, prompt_tokens: int, seed: int = 0) -> Tokens:
    """``batch`` random prompts of ``prompt_tokens`` ids (the same for every path and run)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    drawn: Tokens = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).tolist()
    return drawn


def greedy_requests(prompt_ids: Tokens, new_tokens: int, *, prefix: str = "r") -> list[base.SequenceRequest]:
    """Greedy requests that generate exactly ``new_tokens`` each (``ignore_eos``)."""
    params = base.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [base.SequenceRequest(f"{prefix}{index}", tuple(prompt), params) for index, prompt in enumerate(prompt_ids)]


def direct(backend: Any, prompt_ids: Tokens, new_tokens: int) -> Tokens:
    """megatron-core's ``engine.generate()`` alone (greedy, exactly ``new_tokens``); a backend
    without megatron's engine (the transformers backend on CPU) through its own ``generate()``."""
    if hasattr(backend, "engine") and hasattr(backend.engine, "generate"):
        from megafleet_engine.backends import megatron

        sampling = megatron.megatron_core("inference.sampling_params")
        params = sampling.SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
        return [list(record.merge().generated_tokens) for record in backend.engine.generate(prompt_ids, params)]
    return through_backend(backend, prompt_ids, new_tokens)


def through_backend(backend: Any, prompt_ids: Tokens, new_tokens: int) -> Tokens:
    """The backend's ``generate()`` (our request mapping and per-step token loop), one batch."""
    produced: dict[str, list[int]] = {}
    for steps in backend.generate(greedy_requests(prompt_ids, new_tokens)):
        for step in steps:
            produced.setdefault(step.request_id, []).append(step.token_id)
    return [produced[f"r{index}"] for index in range(len(prompt_ids))]


def cuda_sync() -> Callable[[], None]:
    """``torch.cuda.synchronize`` where CUDA is up, else a no-op."""
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def timed(
    fn: Callable[[], Tokens], repeats: int, sync: Callable[[], None], *, warmup: bool = True
) -> tuple[dict[str, Any], Tokens]:
    """``fn`` (one batch; returns its tokens) once to warm up (unless ``warmup`` is false), then
    ``repeats`` timed runs: tok/s of the median run, and the spread (slowest minus fastest over the
    median, as a fraction) and every run's seconds."""
    if warmup:
        fn()
    runs: list[float] = []
    produced: Tokens = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        produced = fn()
        sync()
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)
    count = sum(len(tokens) for tokens in produced)
    figure: dict[str, Any] = {
        "tokens": count,
        "seconds_median": round(seconds, 4),
        "tok_per_s": round(count / seconds, 1),
        "tok_per_s_min": round(count / max(runs), 1),
        "tok_per_s_max": round(count / min(runs), 1),
        "spread": round((max(runs) - min(runs)) / seconds, 4),
        "runs_s": [round(run, 4) for run in runs],
    }
    return figure, produced


def saver(path: Path, result: dict[str, Any]) -> Callable[[], None]:
    """A function that (re)writes ``result`` as JSON to ``path`` (called after every figure, so a
    run cut short keeps what it measured)."""

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")

    return save
