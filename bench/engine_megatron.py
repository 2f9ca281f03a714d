"""Generation throughput of the megatron backend: megatron-core's engine called directly vs through
our backend, our scheduler (:class:`megafleet_engine.engine.Engine`, continuous batching: requests
that arrive while a batch runs join it between steps) and the OpenAI HTTP frontend. One GPU, random
weights, greedy, every sequence generates exactly ``--new-tokens``.

Run on a GPU machine with megatron-core and a flash-attention kernel installed::

    PYTHONPATH=engine:protocol python3 bench/engine_megatron.py --out bench/results/engine-megatron.json

Each figure is output tokens per second, end to end (prefill included): batch x new tokens over the
wall time from submitting the batch to its last token, median of ``--repeats`` runs after one
warm-up run per path. ``overhead`` = direct tok/s / path tok/s (1.0 = no overhead).

Two HTTP paths: ``http`` runs the client in this process (its JSON and socket work shares the GIL
with the engine's thread and the server), ``http_client_process`` in a separate process, as an RL
job's client runs against a pod: the server and the engine share this process, as in a pod.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import multiprocessing
import multiprocessing.connection
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base, megatron, weight_maps


def versions() -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        smi = f"nvidia-smi failed: {error}"
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "nvidia_smi": smi,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": version("megatron-core"),
        "flash_attn_4": version("flash-attn-4"),
        "nvidia_cutlass_dsl": version("nvidia-cutlass-dsl"),
        "transformers": version("transformers"),
    }


def timed(fn: Callable[[], int], repeats: int) -> dict[str, Any]:
    """Run ``fn`` (returns tokens produced) once to warm up, then ``repeats`` times."""
    fn()
    runs = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        produced = fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start, produced))
    seconds = statistics.median(elapsed for elapsed, _ in runs)
    produced = runs[0][1]
    return {
        "tokens": produced,
        "seconds_median": round(seconds, 4),
        "tok_per_s": round(produced / seconds, 1),
        "runs_s": [round(elapsed, 4) for elapsed, _ in runs],
    }


def requests(prompts: list[list[int]], new_tokens: int) -> list[base.SequenceRequest]:
    params = base.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [base.SequenceRequest(f"r{index}", tuple(prompt), params) for index, prompt in enumerate(prompts)]


def direct(backend: megatron.MegatronBackend, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sampling = megatron.megatron_core("inference.sampling_params")
    params = sampling.SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
    records = backend.engine.generate(prompts, params)
    return [list(record.merge().generated_tokens) for record in records]


def through_backend(backend: megatron.MegatronBackend, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    produced: dict[str, list[int]] = {}
    for steps in backend.generate(requests(prompts, new_tokens)):
        for step in steps:
            produced.setdefault(step.request_id, []).append(step.token_id)
    return [produced[f"r{index}"] for index in range(len(prompts))]


def through_engine(scheduler: engine_module.Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    async def one(request: base.SequenceRequest) -> list[int]:
        return [step.token_id async for step in scheduler.submit(request)]

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(one(request) for request in requests(prompts, new_tokens))))

    return asyncio.run(run())


class HttpBench:
    """The OpenAI frontend on a local port, in a background event loop thread, and a client."""

    def __init__(self, scheduler: engine_module.Engine, backend: megatron.MegatronBackend) -> None:
        import threading

        from megafleet_engine import metrics, server

        self.loop = asyncio.new_event_loop()
        self.servers = server.EngineServers(
            scheduler,
            server.tokenizer_of(backend),
            metrics.Metrics(scheduler),
            host="127.0.0.1",
            frontend_port=0,
            agent_port=None,
            metrics_port=None,
        )
        self.url = f"http://{self.servers.address('frontend')}"
        self.model = backend.info.name
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.servers.serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.servers.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP frontend did not start in 30 s")
            time.sleep(0.05)

        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.client = context.Process(target=_client_process, args=(child, self.url, self.model), daemon=True)
        self.client.start()

    def run(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return asyncio.run(_completions(self.url, self.model, prompts, new_tokens))

    def run_in_client_process(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        self.pipe.send((prompts, new_tokens))
        answer: list[list[int]] | str = self.pipe.recv()
        if isinstance(answer, str):
            raise RuntimeError(f"the client process failed: {answer}")
        return answer

    def close(self) -> None:
        self.pipe.send(None)
        self.client.join(timeout=30)
        self.servers.stop()
        self.thread.join(timeout=30)


async def _completions(url: str, model: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Every prompt as one ``/v1/completions`` request, all at once; the completion token ids."""
    import httpx

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        token_ids = choice.get("token_ids")
        if token_ids is None:  # the frontend does not return ids: count from usage
            token_ids = [-1] * response.json()["usage"]["completion_tokens"]
        return list(token_ids)

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, prompt) for prompt in prompts)))


def _client_process(pipe: multiprocessing.connection.Connection, url: str, model: str) -> None:
    """The HTTP client in a process of its own: one batch per message until ``None``."""
    while (work := pipe.recv()) is not None:
        prompts, new_tokens = work
        try:
            pipe.send(asyncio.run(_completions(url, model, prompts, new_tokens)))
        except Exception as error:
            pipe.send(f"{type(error).__name__}: {error}")


def measure_batch(
    backend: megatron.MegatronBackend,
    scheduler: engine_module.Engine,
    http: HttpBench | None,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    errors: dict[str, str],
) -> dict[str, Any]:
    """Every path at one batch size; the overhead of each path over megatron's engine alone."""
    paths: dict[str, Callable[[], list[list[int]]]] = {
        "direct": lambda: direct(backend, prompts, new_tokens),
        "backend": lambda: through_backend(backend, prompts, new_tokens),
        "engine": lambda: through_engine(scheduler, prompts, new_tokens),
    }
    if http is not None:
        paths["http"] = lambda: http.run(prompts, new_tokens)
        paths["http_client_process"] = lambda: http.run_in_client_process(prompts, new_tokens)
    row: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for path, fn in paths.items():

        def produce(fn: Callable[[], list[list[int]]] = fn, path: str = path) -> int:
            produced = fn()
            outputs[path] = produced
            return sum(len(tokens) for tokens in produced)

        batches_before = len(scheduler.batch_sizes)
        admitted_before, admissions_before = scheduler.admitted, scheduler.admissions
        try:
            row[path] = timed(produce, repeats)
        except Exception as error:
            errors[f"{path}_b{len(prompts)}"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
            continue
        if path in ("engine", "http", "http_client_process"):
            row[path]["scheduler_batch_sizes"] = scheduler.batch_sizes[batches_before:]
            row[path]["scheduler_admitted"] = scheduler.admitted - admitted_before
            row[path]["scheduler_admission_steps"] = scheduler.admissions - admissions_before
    for path in ("backend", "engine", "http", "http_client_process"):
        if path in row and "direct" in row:
            row[path]["overhead_vs_direct"] = round(row["direct"]["tok_per_s"] / row[path]["tok_per_s"], 3)
            ids = outputs.get(path)
            if ids and ids[0] and ids[0][0] != -1:
                row[path]["tokens_equal_direct"] = ids == outputs["direct"]
    return row


def measure_write(backend: megatron.MegatronBackend, result: dict[str, Any]) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="random://llama-8b")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-sequence-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    batches = [int(batch) for batch in args.batches.split(",")]
    result: dict[str, Any] = {
        "benchmark": "engine-megatron",
        "machine": versions(),
        "config": {
            "source": args.source,
            "dtype": "bfloat16",
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "max_sequence_length": args.max_sequence_length,
            "cuda_graphs": not args.no_cuda_graphs,
            "sampling": "greedy, ignore_eos",
            "repeats": args.repeats,
            "scheduler": "continuous batching (admission between decode steps)",
        },
        "errors": {},
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    start = time.perf_counter()
    backend = megatron.load(
        args.source,
        name="bench",
        max_sequence_length=args.max_sequence_length,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        options=megatron.EngineOptions(max_batch_size=max(batches), cuda_graphs=not args.no_cuda_graphs),
    )
    result["build_s"] = round(time.perf_counter() - start, 2)
    result["shape"] = dataclasses.asdict(backend.shape)
    result["gpu_memory_allocated_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    save()

    generator = torch.Generator().manual_seed(0)
    vocab = backend.info.vocab_size
    all_prompts = torch.randint(0, vocab, (max(batches), args.prompt_tokens), generator=generator).tolist()
    scheduler = engine_module.Engine(backend, max_batch_size=max(batches))
    http: HttpBench | None = None
    if not args.no_http:
        try:
            http = HttpBench(scheduler, backend)
        except Exception as error:
            result["errors"]["http_start"] = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"
    figures: dict[str, dict[str, Any]] = {}
    result["figures"] = figures
    for batch in batches:
        figures[f"batch_{batch}"] = measure_batch(
            backend, scheduler, http, all_prompts[:batch], args.new_tokens, args.repeats, result["errors"]
        )
        save()

    measure_write(backend, result)
    save()
    if http is not None:
        http.close()
    scheduler.close()
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
