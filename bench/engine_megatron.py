"""Generation throughput of the megatron backend, megatron-core's engine called directly vs through
our backend (and optionally our scheduler), under several settings of the per-step path compared in
the same run (to find where a decode step goes beyond the GPU's work), with a decode-step profile
(``profile_decode.py``) of chosen settings. One GPU, random weights, greedy, every sequence
generates exactly ``--new-tokens``.

Run on a GPU machine with megatron-core and a flash-attention kernel installed::

    PYTHONPATH=engine:protocol python3 bench/engine_megatron.py --out bench/results/engine-megatron-<machine>.json

Settings (``--variants``; each is a graph scope, fixed when a model is built, and per-step options
switched between batches on the same engine, :meth:`MegatronBackend.set_step_options`):

* ``baseline``: per-layer decode graphs, megatron's ordinary step order, the sampler's per-bucket
  index tensors (a blocking copy per step), tokens read from megatron's request records (the
  backend as it was before the per-step work was cut: bench/HISTORY.md, ``engine_megatron.py``);
* ``fast``: the sampler without host synchronisation and the step arrays;
* ``fast-async``: ``fast`` with megatron's asynchronous scheduling (step N+1's forward is launched
  before step N's tokens are read back);
* ``block-fast``, ``block-fast-async``: the same with one decode graph for the whole transformer
  block (a second model, same weights);
* ``fused-block-fast-async``: ``block-fast-async`` on a model with the default fused kernels
  (``EngineOptions.fused_kernels="rope-swiglu"``: RoPE, SwiGLU, the RMSNorms in torch's order, the
  qkv fold), ``fusedrs-block-fast-async`` with RoPE and SwiGLU only (``"rope-swiglu-only"``, the
  2026-12-02 default), ``fusednorm-block-fast-async`` with the RMSNorms too (``"rope-swiglu-norm"``),
  ``fusedqkv-block-fast-async`` with the qkv fold too (``"rope-swiglu-norm-qkv"``; the default adds
  the residual adds into the norms),
  ``fusedall-block-fast-async`` (``"all"``: the GEMV and the decode attention kernel too, not
  bitwise), ``fusedgemv-block-fast-async`` (``"gemv"``: the default's kernels, the one-token steps'
  linear layers through a Triton GEMV, programmatic dependent launches; not bitwise) and
  ``fusedgemvnopdl-block-fast-async`` (the GEMV without the dependent launches),
  ``fusedallprefill-block-fast-async`` and ``fusedgemvprefill-block-fast-async`` (``all``, ``gemv``
  with megatron's CUDA graphs for prefill steps too, ``EngineOptions.prefill_graphs``); one model
  each.

``--kernel-probe`` first measures, on the bare GPU, which summation order of the RMSNorm matches
torch's bit for bit, single kernels' times inside a CUDA graph (torch's RMSNorm and the fused one,
the qkv fold against megatron's four ops) and what bounds the GEMMs: each decode GEMM of the model's
shape at batch 1 against reading the same bytes (a sum) and copying them.

Paths: ``direct`` (megatron-core's ``engine.generate()``: the same engine, the same sampler and
scheduling mode, none of our per-step code), ``backend`` (``MegatronBackend.generate()``),
``engine`` (:class:`megafleet_engine.engine.Engine`, the batch submitted at once). Each figure is
output tokens per second end to end (prefill included): batch x new tokens over the wall time from
submitting the batch to its last token; the median of ``--repeats`` runs (and the slowest, the
fastest and the spread), after one warm-up run (the first setting measured at a batch size only:
the others run the same kernels). ``vs_direct`` = path tok/s / direct tok/s of the same setting;
``vs_baseline_direct`` = path tok/s / the baseline's direct tok/s (the baseline: the ``--reference``
setting, ``baseline`` unless told). Batches above ``--prune-above``
run only the fastest setting (backend path) of the previous batch size, then the baseline; batches
above ``--warmup-max-batch`` get no warm-up run (their decode graphs were captured at build time
and their kernels compiled at the smaller batches).
``--deadline-s``: no new measurement starts after that many seconds (the JSON says what was skipped).
``--gemv-configs F``: build the models with the GEMV configs ``gemv_probe.py --tune --save-configs F``
measured on this GPU (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchkit
import gemv_probe
import profile_decode
import torch

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base, weight_maps

FAST = {"sync_free_sampling": True, "array_collect": True}
VARIANTS: dict[str, tuple[str, dict[str, bool]]] = {
    "baseline": ("layer", {"async_schedule": False, "sync_free_sampling": False, "array_collect": False}),
    "fast": ("layer", {"async_schedule": False, **FAST}),
    "fast-async": ("layer", {"async_schedule": True, **FAST}),
    "block-fast": ("block", {"async_schedule": False, **FAST}),
    "block-fast-async": ("block", {"async_schedule": True, **FAST}),
    "fusedrs-block-fast-async": ("block+rope-swiglu-only", {"async_schedule": True, **FAST}),
    "fusednorm-block-fast-async": ("block+rope-swiglu-norm", {"async_schedule": True, **FAST}),
    "fusedqkv-block-fast-async": ("block+rope-swiglu-norm-qkv", {"async_schedule": True, **FAST}),
    "fused-block-fast-async": ("block+rope-swiglu", {"async_schedule": True, **FAST}),
    "fusedall-block-fast-async": ("block+all", {"async_schedule": True, **FAST}),
    "fusedgemv-block-fast-async": ("block+gemv", {"async_schedule": True, **FAST}),
    "fusedgemvnopdl-block-fast-async": ("block+gemv-no-pdl", {"async_schedule": True, **FAST}),
    "fusedallprefill-block-fast-async": ("block+all+prefill", {"async_schedule": True, **FAST}),
    "fusedgemvprefill-block-fast-async": ("block+gemv+prefill", {"async_schedule": True, **FAST}),
}
"""Setting name -> (model, per-step options). A model is a graph scope, ``+`` the fused kernels
built into it (``EngineOptions.fused_kernels``; none: ``off``), ``+prefill``: with CUDA graphs for
prefill steps too (``EngineOptions.prefill_graphs``)."""


PROBE_SHAPE = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}
"""The Llama-3.1-8B shape ``--kernel-probe`` measures (``random://llama-8b``)."""


def through_engine(scheduler: engine_module.Engine, prompt_ids: benchkit.Tokens, new_tokens: int) -> benchkit.Tokens:
    async def one(request: base.SequenceRequest) -> list[int]:
        return [step.token_id async for step in scheduler.submit(request)]

    async def run() -> benchkit.Tokens:
        return list(
            await asyncio.gather(*(one(request) for request in benchkit.greedy_requests(prompt_ids, new_tokens)))
        )

    return asyncio.run(run())


class Backends:
    """One backend per model (graph scope and fused kernels), built on first use; a scheduler per backend when asked."""

    def __init__(self, args: argparse.Namespace, max_batch: int, result: dict[str, Any]) -> None:
        self.args = args
        self.max_batch = max_batch
        self.result = result
        self.built: dict[str, Any] = {}
        self.schedulers: dict[str, engine_module.Engine] = {}

    def get(self, model: str) -> Any:
        """The backend of ``model`` (``VARIANTS``' first field: ``scope[+fused_kernels]``)."""
        if model not in self.built:
            scope, _, rest = model.partition("+")
            kernels, _, extra = rest.partition("+")
            start = time.perf_counter()
            self.built[model] = benchkit.load_megatron(
                self.args.source,
                max_sequence_length=self.args.max_sequence_length,
                max_batch_size=self.max_batch,
                kv_cache_gib=self.args.kv_cache_gib,
                cuda_graphs=not self.args.no_cuda_graphs,
                graph_scope=scope,
                fused_kernels=kernels or "off",
                **({"prefill_graphs": True} if extra == "prefill" else {}),
            )
            self.result.setdefault("build_s", {})[model] = round(time.perf_counter() - start, 2)
            self.result.setdefault("gpu_memory_allocated_gb", {})[model] = round(
                torch.cuda.memory_allocated() / 2**30, 2
            )
        return self.built[model]

    def scheduler(self, scope: str) -> engine_module.Engine:
        if scope not in self.schedulers:
            self.schedulers[scope] = engine_module.Engine(self.get(scope), max_batch_size=self.max_batch)
        return self.schedulers[scope]

    def close(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.close()
        for backend in self.built.values():
            backend.close()


def measure_variant(
    backends: Backends,
    variant: str,
    prompt_ids: benchkit.Tokens,
    paths: list[str],
    *,
    warmup: bool,
    deadline: float,
    errors: dict[str, str],
    row: dict[str, Any],
    save: Callable[[], None],
) -> dict[str, benchkit.Tokens]:
    """Every path of one setting at one batch size, into ``row`` (saved after each path)."""
    args = backends.args
    scope, options = VARIANTS[variant]
    outputs: dict[str, benchkit.Tokens] = {}
    try:
        backend = backends.get(scope)
        backend.set_step_options(**options)
    except Exception as error:
        errors[f"{variant}_b{len(prompt_ids)}"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
        return outputs
    row["options"] = backend.step_options()
    runs: dict[str, Callable[[], benchkit.Tokens]] = {
        "direct": lambda: benchkit.direct(backend, prompt_ids, args.new_tokens),
        "backend": lambda: benchkit.through_backend(backend, prompt_ids, args.new_tokens),
        "engine": lambda: through_engine(backends.scheduler(scope), prompt_ids, args.new_tokens),
    }
    for path in paths:
        if time.monotonic() > deadline:
            row[path] = {"skipped": "deadline"}
            continue
        try:
            row[path], outputs[path] = benchkit.timed(runs[path], args.repeats, torch.cuda.synchronize, warmup=warmup)
        except Exception as error:
            errors[f"{variant}_{path}_b{len(prompt_ids)}"] = (
                f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
            )
        save()
    return outputs


def compare(
    rows: dict[str, dict[str, Any]], outputs: dict[str, dict[str, benchkit.Tokens]], base: str = "baseline"
) -> None:
    """``vs_direct``, ``vs_baseline_direct`` and token equality, in place (the baseline: the
    ``base`` setting's direct run)."""
    baseline = rows.get(base, {}).get("direct", {}).get("tok_per_s")
    reference = outputs.get(base, {}).get("direct")
    for variant, row in rows.items():
        direct = row.get("direct", {}).get("tok_per_s")
        for path, figure in row.items():
            if not isinstance(figure, dict) or "tok_per_s" not in figure:
                continue
            if direct and path != "direct":
                figure["vs_direct"] = round(figure["tok_per_s"] / direct, 3)
                figure["tokens_equal_direct"] = outputs[variant][path] == outputs[variant].get("direct")
            if baseline:
                figure["vs_baseline_direct"] = round(figure["tok_per_s"] / baseline, 3)
            if reference is not None:
                figure["tokens_equal_baseline_direct"] = outputs[variant][path] == reference
                figure["tokens_agreed_baseline_direct"] = agreed(outputs[variant][path], reference)


def agreed(produced: benchkit.Tokens, reference: benchkit.Tokens) -> float:
    """The fraction of tokens before each sequence's first difference from ``reference`` (1.0:
    equal; greedy sequences that part at a bf16 near-tie differ everywhere after it)."""
    total = kept = 0
    for row, expected in zip(produced, reference, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(row, expected, strict=False)) if a != b), min(len(row), len(expected))
        )
        kept += same
        total += len(expected)
    return round(kept / total, 4) if total else 1.0


def fastest(row: dict[str, dict[str, Any]]) -> str | None:
    """The setting whose backend path was fastest at one batch size."""
    speeds = {
        variant: figures["backend"]["tok_per_s"]
        for variant, figures in row.items()
        if "tok_per_s" in figures.get("backend", {})
    }
    return max(speeds, key=lambda variant: speeds[variant]) if speeds else None


def measure_write(backend: Any, result: dict[str, Any]) -> None:
    """In-place refit of every parameter from HF-named GPU tensors, through the weight maps."""
    try:
        live = {name: parameter.data for name, parameter in backend.model.named_parameters()}
        hf = weight_maps.megatron_to_hf([live], backend.shape)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            backend.write_weights(hf)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        size = sum(tensor.numel() * tensor.element_size() for tensor in hf.values())
        result["write_weights"] = {
            "bytes": size,
            "tensors": len(hf),
            "seconds_median": round(statistics.median(times), 5),
            "gb_per_s": round(size / statistics.median(times) / 1e9, 1),
        }
        del hf
    except Exception as error:
        result["errors"]["write_weights"] = f"{type(error).__name__}: {error}"


def wait_for(path: Path | None, timeout: float, result: dict[str, Any]) -> None:
    """Wait (up to ``timeout`` s) for ``path`` to exist: another GPU job of the same machine
    (the GPU tests) ends before anything is timed."""
    if path is None:
        return
    start = time.monotonic()
    while not path.exists() and time.monotonic() - start < timeout:
        time.sleep(0.5)  # polling a file another process writes, with a deadline
    result["waited_for_other_job_s"] = round(time.monotonic() - start, 1)


def run_profiles(backends: Backends, targets: list[str], batches: list[int], result: dict[str, Any], out: Path) -> None:
    """``variant:path`` targets at each of ``batches``; text summary next to the JSON."""
    profiles: list[dict[str, Any]] = []
    for batch in batches:
        for target in targets:
            variant, _, path = target.partition(":")
            scope, options = VARIANTS[variant]
            try:
                backend = backends.get(scope)
                backend.set_step_options(**options)
                profiled = profile_decode.profile_decode(
                    backend,
                    batch=batch,
                    path=path or "backend",
                    prompt_tokens=backends.args.prompt_tokens,
                    steps=backends.args.profile_steps,
                )
            except Exception as error:
                profiled = {"batch": batch, "path": path, "options": {}, "error": f"{type(error).__name__}: {error}"}
                result["errors"][f"profile_{target}_b{batch}"] = traceback.format_exc(limit=8)
            profiled["variant"] = variant
            profiles.append(profiled)
            result["profiles"] = [{k: v for k, v in item.items() if k != "host_ops_table"} for item in profiles]
            header = (
                f"decode profile: {backends.args.source}, prompt {backends.args.prompt_tokens}; {result['machine']}"
            )
            out.with_name(out.stem + "-profile.txt").write_text(profile_decode.summary(profiles, header))


def graph_time_us(fn: Callable[[], Any], calls: int = 20, replays: int = 20) -> float:
    """Microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph (as in the decode
    graph: no launch overhead, the kernels back to back), the median of ``replays`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return round(statistics.median(times), 2)


def attention_probe(heads: int, groups: int, dim: int) -> dict[str, float]:
    """One decode step's attention of one layer (1 and 8 requests, 256 keys each, megatron's 256-token
    blocks): FA4 as megatron calls it against :func:`fused.decode_attention`, in a CUDA graph."""
    from flash_attn.cute import flash_attn_varlen_func  # type: ignore[import-not-found]

    from megafleet_engine.backends.megatron import fused

    times: dict[str, float] = {}
    caches = [torch.randn(64, 256, groups, dim, device="cuda").to(torch.bfloat16) for _ in range(2)]
    for requests in (1, 8):
        q = torch.randn(requests, 1, heads, dim, device="cuda").to(torch.bfloat16)
        table = torch.arange(2 * requests, dtype=torch.int32, device="cuda").view(requests, 2)
        lengths = torch.full((requests,), 256, dtype=torch.int32, device="cuda")
        cu_q = torch.arange(requests + 1, dtype=torch.int32, device="cuda")

        def fa4(
            q: torch.Tensor = q, table: torch.Tensor = table, lengths: torch.Tensor = lengths, cu_q: torch.Tensor = cu_q
        ) -> Any:
            return flash_attn_varlen_func(
                q.view(-1, heads, dim),
                caches[0],
                caches[1],
                cu_seqlens_q=cu_q,
                max_seqlen_q=1,
                max_seqlen_k=512,
                seqused_k=lengths,
                page_table=table,
                softmax_scale=dim**-0.5,
                causal=True,
            )

        times[f"fa4_attention_b{requests}_256keys"] = graph_time_us(fa4)
        times[f"decode_attention_b{requests}_256keys"] = graph_time_us(
            lambda q=q, table=table, lengths=lengths: fused.decode_attention(
                q, caches[0], caches[1], table, lengths, dim**-0.5
            )  # type: ignore[misc]
        )
    return times


def kernel_probe(shape: dict[str, int]) -> dict[str, Any]:
    """The ``--kernel-probe`` measurements (module docstring) for a Llama ``shape``."""
    from megafleet_engine.backends.megatron import fused

    probe: dict[str, Any] = {}
    hidden, ffn = shape["hidden"], shape["ffn"]
    heads, groups, dim = shape["heads"], shape["kv_heads"], shape["hidden"] // shape["heads"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.empty(hidden, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5, generator=generator)
    rows = torch.cat(
        [torch.randn(1024, 1, hidden, device="cuda", generator=generator) * scale for scale in (0.02, 1.0, 3.0, 300.0)]
    ).to(torch.bfloat16)
    expected = torch.nn.functional.rms_norm(rows, (hidden,), weight, 1e-5)
    orders: dict[str, int] = {}
    for threads in (128, 256):
        for fma in (True, False):
            fused.TORCH_NORM_THREADS, fused.TORCH_NORM_FMA = threads, fma
            produced = fused.rms_norm(rows, weight, 1e-5)
            assert isinstance(produced, torch.Tensor)
            orders[f"threads{threads}_fma{int(fma)}"] = int((produced != expected).sum())
    fused.TORCH_NORM_THREADS, fused.TORCH_NORM_FMA = 128, True
    probe["rms_norm_mismatches_vs_torch"] = {"elements": rows.numel(), **orders}
    one = rows[:1].clone()
    other = rows[1:2].clone()
    probe["us_per_call_in_graph"] = {
        "torch_rms_norm_b1": graph_time_us(lambda: torch.nn.functional.rms_norm(one, (hidden,), weight, 1e-5)),
        "fused_rms_norm_b1": graph_time_us(lambda: fused.rms_norm(one, weight, 1e-5)),
        "fused_add_rms_norm_b1": graph_time_us(lambda: fused.rms_norm(one, weight, 1e-5, residual=other)),
        "torch_add_b1": graph_time_us(lambda: one + other),
    }
    qkv = torch.randn(1, 1, groups * (heads // groups + 2) * dim, device="cuda").to(torch.bfloat16)
    grouped = qkv.view(1, 1, groups, -1)
    source, key, value = torch.split(grouped, [heads // groups * dim, dim, dim], dim=3)
    freqs = torch.rand(512, 1, 1, dim, device="cuda")
    positions = torch.zeros(1, dtype=torch.int64, device="cuda")
    cache = torch.zeros(2, 64, 256, groups, dim, device="cuda", dtype=torch.bfloat16)
    blocks = torch.zeros(1, dtype=torch.int32, device="cuda")
    query = torch.empty(1, 1, heads, dim, device="cuda", dtype=torch.bfloat16)

    def megatron_four() -> None:
        q = source.reshape(1, 1, heads, dim)
        fused.rope_(q, freqs, positions)
        k = fused.rope_(key, freqs, positions)
        cache[0, blocks.long(), positions] = k.squeeze(1)
        cache[1, blocks.long(), positions] = value.squeeze(1)

    probe["us_per_call_in_graph"]["qkv_fold_b1"] = graph_time_us(
        lambda: fused.qkv_rope_append(
            (query, source), (key, value, cache[0], cache[1], blocks, positions), freqs, positions, positions, 1
        )
    )
    probe["us_per_call_in_graph"]["copy_rope_rope_index_put_b1"] = graph_time_us(megatron_four)
    try:
        probe["us_per_call_in_graph"].update(attention_probe(heads, groups, dim))
    except Exception as error:  # FA4 missing or failing: the rest of the probe stands
        probe["attention_error"] = f"{type(error).__name__}: {error}"
    gemms = {
        "qkv": (hidden, (heads + 2 * groups) * dim),
        "proj": (heads * dim, hidden),
        "fc1": (hidden, 2 * ffn),
        "fc2": (ffn, hidden),
        "output": (hidden, shape["vocab"]),
    }
    bound: dict[str, Any] = {}
    for name, (k, n) in gemms.items():
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.01, 0.01, generator=generator)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        copy = torch.empty_like(w)
        size = w.numel() * w.element_size()
        gemv = graph_time_us(lambda w=w, x=x: torch.nn.functional.linear(x, w), calls=8)  # type: ignore[misc]
        read = graph_time_us(lambda w=w: w.view(-1).sum(dtype=torch.float32), calls=8)  # type: ignore[misc]
        copied = graph_time_us(lambda w=w, copy=copy: copy.copy_(w), calls=8)  # type: ignore[misc]
        bound[name] = {
            "bytes": size,
            "gemv_us": gemv,
            "gemv_tb_per_s": round(size / gemv / 1e6, 2),
            "sum_us": read,
            "sum_read_tb_per_s": round(size / read / 1e6, 2),
            "copy_us": copied,
            "copy_read_write_tb_per_s": round(2 * size / copied / 1e6, 2),
        }
        del w, copy
    probe["gemm_bound_b1"] = bound
    return probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="random://llama-8b")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-sequence-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="baseline,fast,fast-async,block-fast-async")
    parser.add_argument("--paths", default="direct,backend")
    parser.add_argument("--prune-above", type=int, default=64)
    parser.add_argument(
        "--reference",
        default="baseline",
        help="the setting whose direct run the others' tokens and speeds are compared to",
    )
    parser.add_argument("--warmup-max-batch", type=int, default=1 << 30, help="larger batches: no warm-up run")
    parser.add_argument("--kv-cache-gib", type=float, default=24.0)
    parser.add_argument("--profile-batches", default="1", help="empty: no profile")
    parser.add_argument(
        "--profile", default="baseline:backend,baseline:direct,fast-async:backend,block-fast-async:backend"
    )
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--deadline-s", type=float, default=1e9)
    parser.add_argument("--wait-for", type=Path, default=None)
    parser.add_argument("--wait-timeout", type=float, default=120.0)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--kernel-probe", action="store_true", help="first: the kernel measurements (docstring)")
    parser.add_argument(
        "--gemv-configs", type=Path, help="GEMV configs tuned on this GPU (gemv_probe.py --tune --save-configs)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.deadline_s
    batches = [int(batch) for batch in args.batches.split(",")]
    variants = args.variants.split(",")
    paths = args.paths.split(",")
    result: dict[str, Any] = {
        "benchmark": "engine-megatron",
        "machine": benchkit.machine(),
        "config": {
            **{key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "dtype": "bfloat16",
            "sampling": "greedy, ignore_eos",
            "variants_defined": {name: {"model": scope, **options} for name, (scope, options) in VARIANTS.items()},
        },
        "figures": {},
        "errors": {},
    }
    save = benchkit.saver(args.out, result)
    if args.gemv_configs is not None:  # before any model is built: the decode graphs capture them
        from megafleet_engine.backends.megatron import fused

        saved = json.loads(args.gemv_configs.read_text())
        fused.GEMV_CONFIGS.update(gemv_probe.load_configs(saved))
        result["gemv_configs"] = saved
    backends = Backends(args, max(batches), result)
    try:
        for scope in dict.fromkeys(VARIANTS[variant][0] for variant in variants):  # build every model first
            try:
                backends.get(scope)
            except Exception as error:
                result["errors"][f"build_{scope}"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
        result["shape"] = dataclasses.asdict(backends.get(VARIANTS[variants[0]][0]).shape)
        save()
        wait_for(args.wait_for, args.wait_timeout, result)
        if args.kernel_probe:  # alone on the GPU (after the other job), beside the built models
            try:
                result["kernel_probe"] = kernel_probe(PROBE_SHAPE)
            except Exception as error:
                result["errors"]["kernel_probe"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=8)}"
            save()
        if args.profile_batches:
            targets = [target for target in args.profile.split(",") if target.split(":")[0] in variants]
            run_profiles(backends, targets, [int(b) for b in args.profile_batches.split(",")], result, args.out)
            save()
        previous: dict[str, dict[str, Any]] = {}
        warmed: set[tuple[str, int]] = set()  # (graph scope, batch): one warm-up run per model and batch
        for batch in batches:
            prompt_ids = benchkit.prompts(
                backends.get(VARIANTS[variants[0]][0]).info.vocab_size, batch, args.prompt_tokens
            )
            chosen = variants
            if batch > args.prune_above and previous:
                best = fastest(previous)  # first: if the deadline cuts the batch short, the baseline goes
                chosen = list(dict.fromkeys(variant for variant in (best, args.reference) if variant in variants))
            rows: dict[str, dict[str, Any]] = {}
            outputs: dict[str, dict[str, benchkit.Tokens]] = {}
            result["figures"][f"batch_{batch}"] = rows
            for variant in chosen:
                scope = VARIANTS[variant][0]
                rows[variant] = {}
                outputs[variant] = measure_variant(
                    backends,
                    variant,
                    prompt_ids,
                    paths,
                    warmup=(scope, batch) not in warmed and batch <= args.warmup_max_batch,
                    deadline=deadline,
                    errors=result["errors"],
                    row=rows[variant],
                    save=save,
                )
                warmed.add((scope, batch))
                compare(rows, outputs, args.reference)
                save()
            previous = rows
        if time.monotonic() < deadline:
            measure_write(backends.get(VARIANTS[variants[0]][0]), result)
    finally:
        result["wall_s"] = round(time.monotonic() - started, 1)
        save()
        backends.close()
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "profiles"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    import os

    os._exit(code)  # the JSON is written: skip interpreter teardown (process groups, CUDA) that can hang
