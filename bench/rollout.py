"""A GRPO-shaped rollout, in one run: megatron-core direct (GPU), our Engine, and the SDK over HTTP to
a fleet's frontends.

::

    # one GPU, the Llama-3.1-8B shape (random weights), megatron-core direct and the Engine:
    PYTHONPATH=engine:protocol:operator python3 bench/rollout.py --paths direct,engine \\
        --out bench/results/rollout-<machine>-<date>.json
    # through a running fleet's frontends (the SDK's routing; its engines' metrics for the hit rate):
    ... --paths http --frontends http://10.0.0.5:8000/v1,http://10.0.0.6:8000/v1 \\
        --metrics http://10.0.0.5:9090/metrics,http://10.0.0.6:9090/metrics
    # the CPU version with scaled-down sizes: the tiny model, two local engine processes for http
    ... --tiny --out bench/results/rollout-cpu2-<date>.json

The workload (fixed seeds, the same for every path): ``--prompts`` prompts (default 128) of lengths
drawn uniformly from ``--prompt-min``..``--prompt-max`` tokens (256-2,048), all starting with the same
``--system-tokens`` (200) system prefix; each sent ``--samples`` times (8: GRPO's samples of one
prompt), every sample with its own ``max_tokens`` drawn log-normally with median ``--median-output``
(512) and sigma ``--output-sigma`` (1.0), capped at ``--max-output`` (4,096), forced with
``ignore_eos``; sampled at temperature 1 with a seed per sample.

Reported per path: output and total (prompt + output) tokens per second over the batch's wall time,
the wall time, the tail (from the 90th-percentile sequence's finish to the last one's), peak KV use
(the fraction of the KV cache in use at its highest: megatron's allocated blocks; on the transformers
backend the engine's reserved tokens over its capacity; over HTTP the engines' own
``megafleet_kv_cache_usage_ratio``), and the prefix cache's hit rate (prompt tokens served from the
cache or a sibling's prefill, over all prompt tokens: the backend's counters, or over HTTP the
engines' ``megafleet_prefix_cache_*`` metrics). ``bound``: the time this workload needs at least on
this device, from its FLOPs (2 x parameters per prompt and output token, plus attention) at the
matmul throughput measured in the same run, and its bytes (the weights read once per decode step,
the KV read once per output token) at the memory bandwidth measured in the same run; ``of_bound`` =
bound / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import benchkit
import httpx
import torch

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base
from megafleet_engine.openai import engine_client

LLAMA_8B = "random://llama?hidden=4096&layers=32&heads=32&kv_heads=8&intermediate=14336&vocab=128256"
TINY = "tiny://llama"


# -- the workload ---------------------------------------------------------------------------------


def workload(args: argparse.Namespace, vocab: int) -> list[base.SequenceRequest]:
    """Every sample of every prompt, siblings next to each other (fixed seeds)."""
    generator = torch.Generator().manual_seed(args.seed)
    system = torch.randint(3, vocab, (args.system_tokens,), generator=generator).tolist()
    requests = []
    for prompt_index in range(args.prompts):
        length = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=generator))
        own = torch.randint(3, vocab, (max(length - args.system_tokens, 1),), generator=generator).tolist()
        prompt = tuple(system + own)
        for sample in range(args.samples):
            draw = float(torch.randn(1, generator=generator)) * args.output_sigma
            max_tokens = max(1, min(args.max_output, round(args.median_output * math.exp(draw))))
            params = base.SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=args.seed * 100_003 + len(requests), ignore_eos=True
            )
            requests.append(base.SequenceRequest(f"p{prompt_index}s{sample}", prompt, params))
    return requests


def figures(
    requests: Sequence[base.SequenceRequest], started: float, finishes: Sequence[float], extra: dict[str, Any]
) -> dict[str, Any]:
    """Throughput, wall time and tail from every sequence's finish time (``perf_counter`` seconds)."""
    wall = max(finishes) - started
    output = sum(request.params.max_tokens for request in requests)
    prompt = sum(len(request.prompt_token_ids) for request in requests)
    ends = sorted(finish - started for finish in finishes)
    p90 = ends[max(0, math.ceil(0.9 * len(ends)) - 1)]
    return {
        "sequences": len(requests),
        "output_tokens": output,
        "prompt_tokens": prompt,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(output / wall, 1),
        "total_tok_per_s": round((output + prompt) / wall, 1),
        "p90_finish_s": round(p90, 3),
        "tail_s": round(ends[-1] - p90, 3),
        "tail_fraction": round((ends[-1] - p90) / wall, 4),
        **extra,
    }


class Peak:
    """Samples ``read()`` every ``interval`` seconds on a thread; :attr:`value` is the highest."""

    def __init__(self, read: Callable[[], float | None], interval: float = 0.05) -> None:
        self.value = 0.0
        self._read, self._interval = read, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                value = self._read()
            except Exception:  # a scrape that failed: the next one counts
                continue
            if value is not None:
                self.value = max(self.value, value)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.value, 4)


def hit_rate(before: base.PrefixCacheCounters, after: base.PrefixCacheCounters) -> dict[str, Any]:
    prompt = after.prompt_tokens - before.prompt_tokens
    hits = after.hit_tokens - before.hit_tokens
    rate = round(hits / prompt, 4) if prompt else 0.0  # megatron counts nothing with caching off
    return {"prefilled_prompt_tokens": prompt, "cache_hit_tokens": hits, "cache_hit_rate": rate}


def counters(backend: Any) -> base.PrefixCacheCounters:
    if isinstance(backend, base.CachesPrefixes):
        found = backend.prefix_cache
        return base.PrefixCacheCounters(found.prompt_tokens, found.hit_tokens)
    return base.PrefixCacheCounters()


def kv_use(backend: Any, core: engine_module.Engine | None) -> Callable[[], float | None]:
    """The KV cache's use now: megatron's allocated blocks, else the engine's reserved tokens."""
    context = getattr(getattr(backend, "engine", None), "context", None)
    if context is not None:
        allocator = context.kv_block_allocator
        return lambda: allocator.get_total_used() / max(allocator.total_count - 1, 1)
    if core is not None:
        capacity = core.max_batch_size * backend.info.max_sequence_length
        return lambda: core.reserved_tokens() / capacity
    return lambda: None


# -- the paths ------------------------------------------------------------------------------------


def direct(backend: Any, requests: Sequence[base.SequenceRequest]) -> dict[str, Any]:
    """megatron-core's engine alone: every sample added with its own sampling, stepped to the end."""
    from megafleet_engine.backends import megatron

    engine = backend.engine
    sampling = megatron.megatron_core("inference.sampling_params")
    peak = Peak(kv_use(backend, None))
    before = counters(backend)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for index, request in enumerate(requests):
        params = sampling.SamplingParams(
            temperature=request.params.temperature,
            top_k=0,
            top_p=0.0,
            num_tokens_to_generate=request.params.max_tokens,
            termination_id=-1,
        )
        engine.add_request(10_000_000 + index, list(request.prompt_token_ids), params)
    finishes = []
    while engine.has_unfinished_requests():
        result = engine.step_modern()
        now = time.perf_counter()
        finishes.extend(now for _ in result["finished_request_records"])
    torch.cuda.synchronize()
    return figures(requests, started, finishes, {"peak_kv_use": peak.stop(), **hit_rate(before, counters(backend))})


def through_engine(backend: Any, requests: Sequence[base.SequenceRequest], max_batch_size: int) -> dict[str, Any]:
    """Our scheduler in this process, every sample submitted at once."""
    core = engine_module.Engine(backend, max_batch_size=max_batch_size)
    try:
        peak = Peak(kv_use(backend, core))
        before = counters(backend)

        async def run() -> tuple[float, list[float]]:
            started = time.perf_counter()
            batch = await engine_client.LocalClient(core).submit(list(requests))
            finishes: list[float] = []
            while (steps := await batch.next()) is not None:
                now = time.perf_counter()
                finishes.extend(now for _, step in steps if step.finish_reason is not None)
            return started, finishes

        started, finishes = asyncio.run(run())
        return figures(requests, started, finishes, {"peak_kv_use": peak.stop(), **hit_rate(before, counters(backend))})
    finally:
        core.close()


def scrape(urls: Sequence[str], names: Sequence[str]) -> dict[str, list[float]]:
    """Each named sample's value from every engine's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {name: [] for name in names}
    for url in urls:
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name].append(sample.value)
    return found


def over_http(
    frontends: Sequence[str], metrics: Sequence[str], requests: Sequence[base.SequenceRequest], model: str
) -> dict[str, Any]:
    """The SDK's :class:`~megafleet.sdk.generation.Generator` over the frontends (its sibling-aware
    routing), one request per sample (each has its own ``max_tokens``), all in flight at once."""
    from megafleet.sdk import generation, routing

    names = ("megafleet_prefix_cache_prompt_tokens_total", "megafleet_prefix_cache_hit_tokens_total")
    before = scrape(metrics, names) if metrics else None
    peak = Peak(
        lambda: max(scrape(metrics, ["megafleet_kv_cache_usage_ratio"])["megafleet_kv_cache_usage_ratio"] or [0.0]),
        interval=0.25,
    )

    async def run() -> tuple[float, list[float], dict[int, int]]:
        router = routing.Router([routing.Frontend(index, url, None) for index, url in enumerate(frontends)])
        async with generation.Generator(router, model=model) as generator:
            samplings = [
                generation.Sampling(
                    max_tokens=request.params.max_tokens,
                    temperature=1.0,
                    seed=request.params.seed,
                    ignore_eos=True,
                    logprobs=False,
                    text=False,
                )
                for request in requests
            ]
            prompts = [list(request.prompt_token_ids) for request in requests]
            started = time.perf_counter()
            finishes: list[float] = []
            shards: dict[int, int] = {}

            async def one(members: list[int], pending: Any) -> None:
                answers = await pending
                finishes.extend(time.perf_counter() for _ in answers)
                for answer in answers:
                    shards[answer.shard] = shards.get(answer.shard, 0) + 1

            await asyncio.gather(
                *(one(members, work) for members, work in generator.batch_requests(prompts, samplings))
            )
            return started, finishes, shards

    started, finishes, shards = asyncio.run(run())
    extra: dict[str, Any] = {"peak_kv_use": peak.stop(), "sequences_per_shard": dict(sorted(shards.items()))}
    if before is not None:
        after = scrape(metrics, names)
        prompt = sum(after[names[0]]) - sum(before[names[0]])
        hits = sum(after[names[1]]) - sum(before[names[1]])
        extra.update(
            prefilled_prompt_tokens=int(prompt), cache_hit_tokens=int(hits), cache_hit_rate=round(hits / prompt, 4)
        )
    return figures(requests, started, finishes, extra)


# -- the bound ------------------------------------------------------------------------------------


def device_speed(device: str) -> dict[str, float]:
    """Matmul throughput (FLOP/s, the model's dtype) and memory bandwidth (bytes/s: a large copy
    reads and writes each byte) measured on ``device`` now."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    size = 8192 if device == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = benchkit.cuda_sync()
    flops = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        flops.append(2 * size**3 / (time.perf_counter() - start))
    source = torch.empty(2**28 if device == "cuda" else 2**26, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    bandwidth = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        target.copy_(source)
        sync()
        bandwidth.append(2 * source.numel() / (time.perf_counter() - start))
    return {"matmul_flop_per_s": max(flops), "memory_bytes_per_s": max(bandwidth)}


def dimensions(backend: Any) -> dict[str, int]:
    """What the bound needs of the model: layers, heads, KV heads, head size, parameters and their bytes."""
    parameters = list(backend.model.parameters())
    count, width = sum(p.numel() for p in parameters), parameters[0].element_size()
    shape = getattr(backend, "shape", None)
    if shape is not None:  # megatron: this rank's part of the model is the whole model at TP=1
        head_dim = shape.head_dim or shape.hidden // shape.heads
        return {"layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": head_dim,
                "parameters": count, "bytes_per_value": width}  # fmt: skip
    config = backend.model.config
    heads = config.num_attention_heads
    return {
        "layers": config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "parameters": count,
        "bytes_per_value": width,
    }


def source_dimensions(source: str) -> dict[str, int]:
    """:func:`dimensions` of a megatron source from its shape alone (the http path on a GPU, whose
    model lives in the engine process): parameters counted as a Llama of that shape holds them, bf16."""
    from megafleet_engine.backends.megatron import model_sources

    shape = model_sources.parse_source(source).shape
    head_dim = shape.head_dim or shape.hidden // shape.heads
    attention = shape.hidden * head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    layer = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    return {"layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": head_dim,
            "parameters": shape.layers * layer + embeddings + shape.hidden, "bytes_per_value": 2}  # fmt: skip


def model_vocab(source: str) -> int:
    from megafleet_engine.backends.megatron import model_sources

    return model_sources.parse_source(source).shape.vocab


def bound(
    requests: Sequence[base.SequenceRequest], model: dict[str, int], max_batch_size: int, speed: dict[str, float]
) -> dict[str, Any]:
    """The least time this workload takes on this device: FLOPs at the matmul rate, or bytes at the
    memory bandwidth, whichever is longer (with a perfect prefix cache: each distinct prompt once)."""
    params, width = model["parameters"], model["bytes_per_value"]
    kv_per_token = 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * width  # K and V
    unique = {request.prompt_token_ids for request in requests}
    prompt_tokens = sum(len(prompt) for prompt in unique)
    lengths = [(len(request.prompt_token_ids), request.params.max_tokens) for request in requests]
    output_tokens = sum(out for _, out in lengths)
    context = sum(out * prompt + out * (out + 1) // 2 for prompt, out in lengths)  # KV positions read
    attention = 4 * model["layers"] * model["heads"] * model["head_dim"] * context
    flop = 2 * params * (prompt_tokens + output_tokens) + attention
    steps = max(max(out for _, out in lengths), math.ceil(output_tokens / max_batch_size))
    moved = width * params * steps + kv_per_token * context
    seconds = max(flop / speed["matmul_flop_per_s"], moved / speed["memory_bytes_per_s"])
    return {"model": model, "flop": flop, "bytes": moved, "decode_steps": steps, "bound_s": round(seconds, 4), **speed}


# -- the run --------------------------------------------------------------------------------------


def local_engines(shards: int, args: argparse.Namespace, device: str) -> tuple[list[Any], list[str], list[str]]:
    """``shards`` engine processes on loopback serving ``--source``: on CPU (the CPU run's fleet) one
    torch thread each (measured on the 2-core machine: a 16-token request took 2.5-3.0 s with
    torch's default threads under load, 0.6-1.0 s with one); on GPUs one megatron engine per GPU
    (bf16, ``--kv-cache-gib``): a single-GPU machine's one-shard fleet."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import engine_command

    token = engine_command.token_file(Path(args.out).parent)
    gpu = {
        "MEGAFLEET_BACKEND": "megatron",
        "MEGAFLEET_DTYPE": "bfloat16",
        "MEGAFLEET_LOCAL_GPUS": "1",
        "MEGAFLEET_KV_CACHE_GIB": str(int(args.kv_cache_gib)),
    }
    cpu = {"OMP_NUM_THREADS": "1"}  # several engines share this machine's cores
    if device == "cuda":
        shards = torch.cuda.device_count()
    processes = [
        engine_command.EngineCommand(
            {
                "MEGAFLEET_MODEL_SOURCE": args.source,
                "MEGAFLEET_SERVED_MODEL_NAME": args.model,
                "MEGAFLEET_DTYPE": "float32",  # the GPU's engine: bf16, below
                "MEGAFLEET_MAX_SEQUENCE_LENGTH": str(args.max_sequence_length),
                "MEGAFLEET_MAX_BATCH_SIZE": str(args.max_batch_size),
                "MEGAFLEET_HOST": f"127.0.77.{shard + 1}",
                "MEGAFLEET_FRONTEND_PORT": "0",
                "MEGAFLEET_AGENT_PORT": "0",
                "MEGAFLEET_METRICS_PORT": "0",
                "MEGAFLEET_AGENT_TOKEN_FILE": str(token),
                "MEGAFLEET_API_SERVERS": "0",
                "MEGAFLEET_PREFIX_CACHING": "true" if args.prefix_caching else "false",
            }
            | (gpu | {"CUDA_VISIBLE_DEVICES": str(shard)} if device == "cuda" else cpu)
        )
        for shard in range(shards)
    ]
    try:
        addresses = [process.wait_serving("frontend", "metrics", timeout=600) for process in processes]
    except BaseException:
        for process in processes:
            process.stop()
        raise
    finally:
        token.unlink()
    return (
        processes,
        [f"http://{found['frontend']}/v1" for found in addresses],
        [f"http://{found['metrics']}/metrics" for found in addresses],
    )


def load(args: argparse.Namespace, device: str) -> Any:
    """The backend the direct and engine paths share: megatron on a GPU, else transformers (CPU)."""
    if device == "cuda":
        return benchkit.load_megatron(
            args.source,
            max_sequence_length=args.max_sequence_length,
            max_batch_size=args.max_batch_size,
            kv_cache_gib=args.kv_cache_gib,
            prefix_caching=args.prefix_caching,
        )
    from megafleet_engine import backends

    return backends.load_backend(
        "transformers",
        args.source,
        name="tiny",
        max_sequence_length=args.max_sequence_length,
        prefix_caching=args.prefix_caching,
    )


def http_path(args: argparse.Namespace, requests: Sequence[base.SequenceRequest], device: str) -> dict[str, Any]:
    """The http path over ``--frontends`` (with ``--metrics``), else over local engine processes."""
    processes: list[Any] = []
    frontends = [url for url in args.frontends.split(",") if url]
    metrics = [url for url in args.metrics.split(",") if url]
    if not frontends:
        processes, frontends, metrics = local_engines(args.shards, args, device)
    try:
        return {"shards": len(frontends), **over_http(frontends, metrics, requests, args.model)}
    finally:
        for process in processes:
            process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU: the tiny model and scaled-down sizes")
    parser.add_argument("--paths", default=None, help="direct,engine,http (default: engine,http with --tiny)")
    parser.add_argument("--source", default=None)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=256)
    parser.add_argument("--prompt-max", type=int, default=2048)
    parser.add_argument("--system-tokens", type=int, default=200)
    parser.add_argument("--median-output", type=int, default=512)
    parser.add_argument("--output-sigma", type=float, default=1.0)
    parser.add_argument("--max-output", type=int, default=4096)
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--max-sequence-length", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=60.0)
    parser.add_argument("--prefix-caching", default="true", choices=("true", "false"))
    parser.add_argument("--shards", type=int, default=2, help="http, CPU: local engines (GPUs: one each)")
    parser.add_argument("--frontends", default="", help="http: the fleet's OpenAI base URLs, comma-separated")
    parser.add_argument("--metrics", default="", help="http: the engines' /metrics URLs, comma-separated")
    parser.add_argument("--model", default="tiny", help="http: the served model name")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.tiny:
        scaled = {"prompts": 8, "samples": 4, "prompt_min": 24, "prompt_max": 96, "system_tokens": 16}
        scaled |= {"median_output": 16, "max_output": 64, "max_batch_size": 32, "max_sequence_length": 256}
        for name, value in scaled.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.prefix_caching = args.prefix_caching == "true"
    source = args.source or (TINY if args.tiny else LLAMA_8B)
    args.source = source
    paths = (args.paths or ("engine,http" if args.tiny else "direct,engine")).split(",")
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"

    result: dict[str, Any] = {
        "benchmark": "rollout",
        "machine": benchkit.machine(),
        "load_average": os.getloadavg(),
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "paths": {},
    }
    save = benchkit.saver(Path(args.out), result)
    backend = load(args, device) if {"direct", "engine"} & set(paths) else None
    model = dimensions(backend) if backend is not None else None
    if model is None and device == "cuda":  # http alone: the engine process holds the model
        model = source_dimensions(source)
    vocab = backend.info.vocab_size if backend is not None else (model_vocab(source) if device == "cuda" else 32000)
    requests = workload(args, vocab)
    result["workload"] = {
        "sequences": len(requests),
        "distinct_prompts": len({request.prompt_token_ids for request in requests}),
        "prompt_tokens": sum(len(request.prompt_token_ids) for request in requests),
        "output_tokens": sum(request.params.max_tokens for request in requests),
        "output_median": statistics.median(request.params.max_tokens for request in requests),
        "output_max": max(request.params.max_tokens for request in requests),
    }
    if model is not None:
        result["bound"] = bound(requests, model, args.max_batch_size, device_speed(device))
    save()
    for path in paths:
        print(f"rollout: {path}, {len(requests)} sequences", file=sys.stderr)
        if path == "direct":
            if device != "cuda":
                result["paths"][path] = {"skipped": "megatron-core direct needs a GPU"}
                continue
            result["paths"][path] = direct(backend, requests)
        elif path == "engine":
            result["paths"][path] = through_engine(backend, requests, args.max_batch_size)
        elif path == "http":
            result["paths"][path] = http_path(args, requests, device)
        if "bound" in result and "wall_s" in result["paths"][path]:
            result["paths"][path]["of_bound"] = round(result["bound"]["bound_s"] / result["paths"][path]["wall_s"], 4)
        save()
        print(f"rollout: {path}: {result['paths'][path]}", file=sys.stderr)


if __name__ == "__main__":
    main()
