"""Where a decode step of the megatron backend goes (kernels, graph replay, Python, host syncs):
steady-state decode steps at one batch size, through our backend (``backend``) or megatron-core's
engine alone (``direct``), measured three ways:

1. **phases, no profiler**: the wall time per step and the host time per step inside megatron's
   and our per-step functions (timers wrapped around them; nested phases are inclusive);
2. **GPU timeline** (``torch.profiler``, CUDA activity only, so the host is not slowed by op
   recording): per step, GPU busy (the union of kernel, copy and memset intervals) vs idle, the
   top kernels, CUDA-graph launches and the host's blocking calls (stream/event/device syncs and
   blocking copies) with their time;
3. **host ops** (``torch.profiler``, CPU and CUDA): the top operators by self host time.

Run alone (builds the backend) or from ``engine_megatron.py --profile-batches`` (same process,
same engine)::

    PYTHONPATH=engine:protocol python3 bench/profile_decode.py --batch 1 --out bench/results/profile-<machine>-<date>

writes ``<out>.txt`` (the summary) and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import benchkit

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaStreamIsCapturing",
)
"""Runtime calls that can block the host (``cudaMemcpyAsync`` blocks for pageable memory and
PyTorch's ``non_blocking=False`` copies follow it with a stream sync, listed separately)."""

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class Stepper:
    """One decode step per call on a running batch of ``batch`` greedy sequences: through our
    backend's generator or megatron's ``engine.step_modern()``; :meth:`close` ends the batch."""

    def __init__(self, backend: Any, path: str, prompt_ids: benchkit.Tokens, new_tokens: int) -> None:
        self.backend = backend
        self.path = path
        if path == "backend":
            self._generator = backend.generate(benchkit.greedy_requests(prompt_ids, new_tokens, prefix="p"))
        else:
            from megafleet_engine.backends import megatron

            sampling = megatron.megatron_core("inference.sampling_params")
            params = sampling.SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
            engine = backend.engine
            self._ids = [int(next(engine.request_counter)) for _ in prompt_ids]
            for request_id, prompt in zip(self._ids, prompt_ids, strict=True):
                engine.add_request(request_id, prompt, params)

    def step(self) -> None:
        if self.path == "backend":
            next(self._generator)
        else:
            self.backend.engine.step_modern()

    def close(self) -> None:
        if self.path == "backend":
            self._generator.close()
            return
        engine = self.backend.engine
        engine.stop_word_finished_request_ids.update(
            request_id for request_id in self._ids if request_id in engine.requests
        )
        while engine.has_unfinished_requests():
            engine.step_modern()


# -- 1. phases -------------------------------------------------------------------------------------


def phase_targets(backend: Any) -> list[tuple[str, Any, str]]:
    """``(label, object, method)`` of the per-step functions timed: megatron's engine step and its
    parts, its controller's, and our runner's."""
    engine = backend.engine
    controller = engine.controller
    runner = backend._batch  # the benchmark looks inside the backend it measures
    return [
        ("engine.async_forward", engine, "async_forward"),
        ("  controller.context_init (attention metadata, H2D)", controller, "_dynamic_step_context_init"),
        ("  controller.forward_logits (model forward launch)", controller, "_dynamic_step_forward_logits"),
        ("  controller.sample_logits (sampler)", controller, "_dynamic_step_sample_logits"),
        (
            "  controller.context_bookkeeping (D2H tokens, update_requests)",
            controller,
            "_dynamic_step_context_bookkeeping",
        ),
        ("  controller.async_sched_resolve", controller, "_run_async_sched_resolve"),
        ("  controller.async_sched_prepare", controller, "_run_async_sched_prepare"),
        ("engine.async_bookkeep", engine, "async_bookkeep"),
        ("  engine.post_process_requests (per-request records)", engine, "post_process_requests"),
        ("  engine.schedule_waiting_requests", engine, "schedule_waiting_requests"),
        ("runner.tick (ours: joins/leaves)", runner, "tick"),
        ("runner.collect (ours: token steps)", runner, "collect"),
    ]


@contextlib.contextmanager
def phase_timers(backend: Any) -> Iterator[dict[str, list[float]]]:
    """Wrap each :func:`phase_targets` method of the live objects with a wall-clock timer (an
    instance attribute shadowing the method; removed after). Yields label -> [seconds, calls]."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    wrapped: list[tuple[Any, str]] = []
    for label, owner, name in phase_targets(backend):
        original = getattr(owner, name, None)
        if original is None:
            continue
        if inspect.iscoroutinefunction(original):

            async def timed_async(*args: Any, _f: Any = original, _l: str = label, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await _f(*args, **kwargs)
                finally:
                    totals[_l][0] += time.perf_counter() - start
                    totals[_l][1] += 1

            setattr(owner, name, functools.wraps(original)(timed_async))
        else:

            def timed_sync(*args: Any, _f: Any = original, _l: str = label, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _f(*args, **kwargs)
                finally:
                    totals[_l][0] += time.perf_counter() - start
                    totals[_l][1] += 1

            setattr(owner, name, functools.wraps(original)(timed_sync))
        wrapped.append((owner, name))
    try:
        yield totals
    finally:
        for owner, name in wrapped:
            delattr(owner, name)


def measure_phases(stepper: Stepper, steps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Wall time per step over ``steps`` steps (no profiler), and host time per step per phase."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        stepper.step()
    sync()
    plain_ms = (time.perf_counter() - start) * 1000 / steps
    with phase_timers(stepper.backend) as totals:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            stepper.step()
        sync()
        timed_ms = (time.perf_counter() - start) * 1000 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": round(plain_ms, 3),
        "wall_ms_per_step_with_timers": round(timed_ms, 3),
        "host_ms_per_step": {
            label: {"ms": round(seconds * 1000 / steps, 3), "calls_per_step": round(calls / steps, 2)}
            for label, (seconds, calls) in totals.items()
        },
    }


# -- 2. GPU timeline -------------------------------------------------------------------------------


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def gpu_timeline(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Per step: GPU busy vs idle over the profiled window (first to last GPU or host event of the
    steps), the top kernels, graph launches and blocking host calls, from a Chrome trace."""
    events = [event for event in trace.get("traceEvents", []) if event.get("ph") == "X" and "dur" in event]
    gpu = [event for event in events if event.get("cat") in GPU_CATEGORIES]
    runtime = [event for event in events if event.get("cat") in ("cuda_runtime", "cuda_driver")]
    marks = [event for event in events if event.get("name") == "decode_steps"]
    if marks:
        window_start = marks[0]["ts"]
        window_end = max([marks[0]["ts"] + marks[0]["dur"], *(event["ts"] + event["dur"] for event in gpu)])
    else:
        everything = gpu + runtime or events
        window_start = min((event["ts"] for event in everything), default=0.0)
        window_end = max((event["ts"] + event["dur"] for event in everything), default=0.0)
    window = window_end - window_start
    busy = busy_union([(event["ts"], event["ts"] + event["dur"]) for event in gpu])
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in gpu:
        kernels[event["name"]][0] += event["dur"]
        kernels[event["name"]][1] += 1
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in runtime:
        calls[event["name"]][0] += event["dur"]
        calls[event["name"]][1] += 1
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:25]
    return {
        "steps": steps,
        "window_ms_per_step": round(window / 1000 / steps, 3),
        "gpu_busy_ms_per_step": round(busy / 1000 / steps, 3),
        "gpu_idle_ms_per_step": round((window - busy) / 1000 / steps, 3),
        "gpu_busy_fraction": round(busy / window, 3) if window else None,
        "kernels_per_step": round(sum(count for _, count in kernels.values()) / steps, 1),
        "top_kernels": [
            {"name": name[:140], "us_per_step": round(total / steps, 1), "calls_per_step": round(count / steps, 2)}
            for name, (total, count) in top
        ],
        "runtime_calls": {
            name: {"us_per_step": round(total / steps, 1), "calls_per_step": round(count / steps, 2)}
            for name, (total, count) in sorted(calls.items(), key=lambda item: -item[1][0])
        },
        "blocking_calls_per_step": {name: round(calls[name][1] / steps, 2) for name in SYNC_CALLS if name in calls},
        "blocking_ms_per_step": round(sum(calls[name][0] for name in SYNC_CALLS if name in calls) / 1000 / steps, 3),
    }


def profile_gpu(stepper: Stepper, steps: int, sync: Callable[[], None]) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sync()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    with profile(activities=activities, record_shapes=False) as prof, record_function("decode_steps"):
        for _ in range(steps):
            stepper.step()
        sync()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    timeline = gpu_timeline(trace, steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    return {"timeline": timeline, "host_ops_table": table}


def profile_gpu_only(stepper: Stepper, steps: int, sync: Callable[[], None]) -> dict[str, Any]:
    """The GPU timeline with CUDA activity only (no host-op recording slowing the host down)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: smoke test
    sync()
    with profile(activities=[activity], record_shapes=False) as prof:
        for _ in range(steps):
            stepper.step()
        sync()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return gpu_timeline(trace, steps)


def profile_decode(
    backend: Any, *, batch: int, path: str, prompt_tokens: int, steps: int = 32, warm_steps: int = 8
) -> dict[str, Any]:
    """Every measurement of the module's docstring for ``batch`` sequences on ``path``."""
    sync = benchkit.cuda_sync()
    prompt_ids = benchkit.prompts(backend.info.vocab_size, batch, prompt_tokens, seed=1)
    new_tokens = warm_steps + 4 * steps + 8
    if new_tokens > backend.info.max_sequence_length - prompt_tokens:
        raise ValueError(f"{new_tokens} decode steps do not fit in the model's sequence length: fewer --steps")
    stepper = Stepper(backend, path, prompt_ids, new_tokens)
    result: dict[str, Any] = {"batch": batch, "path": path, "options": backend.step_options()}
    try:
        for _ in range(warm_steps):  # prefill and the first decode steps
            stepper.step()
        result["phases"] = measure_phases(stepper, steps, sync)
        result["gpu_only"] = profile_gpu_only(stepper, steps, sync)
        both = profile_gpu(stepper, steps // 2, sync)
        result["with_host_ops"] = both["timeline"]
        result["host_ops_table"] = both["host_ops_table"]
    finally:
        stepper.close()
    return result


def summary(profiles: list[dict[str, Any]], header: str) -> str:
    """The text summary of several :func:`profile_decode` results."""
    lines = [header, ""]
    for item in profiles:
        options = ", ".join(f"{key}={value}" for key, value in item["options"].items())
        lines.append(f"== {item.get('variant', '')} batch {item['batch']}, path {item['path']} ({options})")
        phases = item.get("phases")
        if phases:
            lines.append(
                f"wall per step (no profiler): {phases['wall_ms_per_step']:.3f} ms"
                f" (with phase timers: {phases['wall_ms_per_step_with_timers']:.3f} ms)"
            )
            lines.append("host time per step inside (inclusive; indented = inside the line above):")
            for label, value in phases["host_ms_per_step"].items():
                lines.append(f"  {label:<66} {value['ms']:8.3f} ms  ({value['calls_per_step']} calls)")
        gpu = item.get("gpu_only")
        if gpu:
            lines.append(
                f"GPU (CUDA-only profile, {gpu['steps']} steps): window {gpu['window_ms_per_step']:.3f} ms/step,"
                f" busy {gpu['gpu_busy_ms_per_step']:.3f}, idle {gpu['gpu_idle_ms_per_step']:.3f}"
                f" ({100 * (gpu['gpu_busy_fraction'] or 0):.0f}% busy), {gpu['kernels_per_step']} kernels/step"
            )
            lines.append(
                f"blocking host calls per step: {gpu['blocking_calls_per_step']}"
                f" ({gpu['blocking_ms_per_step']:.3f} ms/step spent in them)"
            )
            lines.append("runtime calls per step (us, calls):")
            for name, value in list(gpu["runtime_calls"].items())[:12]:
                lines.append(f"  {name:<40} {value['us_per_step']:9.1f} us  {value['calls_per_step']:7.2f}")
            lines.append("top GPU kernels per step (us, calls):")
            for kernel in gpu["top_kernels"][:15]:
                lines.append(
                    f"  {kernel['us_per_step']:9.1f} us {kernel['calls_per_step']:6.2f}x  {kernel['name'][:100]}"
                )
        host = item.get("with_host_ops")
        if host:
            lines.append(
                f"with host-op recording ({host['steps']} steps): window {host['window_ms_per_step']:.3f} ms/step,"
                f" GPU busy {host['gpu_busy_ms_per_step']:.3f} (the recording slows the host)"
            )
        if item.get("host_ops_table"):
            lines.append("top host operators (self CPU time, profiled steps):")
            lines.extend("  " + line for line in item["host_ops_table"].splitlines())
        if item.get("error"):
            lines.append(f"error: {item['error']}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="random://llama-8b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--paths", default="backend,direct")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-sequence-length", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=float, default=20.0)
    parser.add_argument("--graph-scope", default="layer")
    parser.add_argument("--async-schedule", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.txt and OUT.json")
    args = parser.parse_args()
    backend = benchkit.load_megatron(
        args.source,
        max_sequence_length=args.max_sequence_length,
        max_batch_size=max(args.batch, 1),
        kv_cache_gib=args.kv_cache_gib,
        graph_scope=args.graph_scope,
        async_schedule=args.async_schedule,
    )
    profiles = [
        profile_decode(backend, batch=args.batch, path=path, prompt_tokens=args.prompt_tokens, steps=args.steps)
        for path in args.paths.split(",")
    ]
    machine = benchkit.machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"machine": machine, "profiles": profiles}, indent=2) + "\n")
    args.out.with_suffix(".txt").write_text(summary(profiles, f"decode profile, {args.source}, {machine}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
