"""How fast the decode GEMMs of a Llama shape read their weights at a few rows (batch-1 decode): cuBLAS
(``torch.nn.functional.linear``, what megatron runs) against :func:`fused.gemv` in several
:class:`fused.GemvConfig`s, each alone in a CUDA graph over distinct copies of the weight (so none
is read from L2), then the layers' chain (norm, qkv, proj, add+norm, fc1, SwiGLU, fc2; 32 layers
of distinct weights in one graph) with cuBLAS, with the GEMV, with the GEMV's SwiGLU prologue and
with programmatic dependent launches (:data:`fused.PDL`). Needs only torch and Triton::

    PYTHONPATH=engine:protocol python3 bench/gemv_probe.py --out bench/results/gemv-probe-<machine>.json

``engine_megatron.py --kernel-probe`` measures the rest of the step's kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megafleet_engine.backends.megatron import fused

SHAPE = {"hidden": 4096, "ffn": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256, "layers": 32}
"""Llama-3.1-8B."""

CONFIGS = [
    fused.GemvConfig(block_n=block_n, block_k=block_k, warps=warps)
    for block_n, block_k, warps in itertools.product((2, 4, 8), (256, 512, 1024), (4, 8))
    if 8 <= block_n * block_k // (warps * 32) <= 64
]
"""The configurations swept (a thread holds 8 to 64 weight values per tile)."""


def gemms(shape: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each decode linear layer's weight ``(n, k)``."""
    hidden, ffn, dim = shape["hidden"], shape["ffn"], shape["hidden"] // shape["heads"]
    return {
        "qkv": ((shape["heads"] + 2 * shape["kv_heads"]) * dim, hidden),
        "proj": (hidden, shape["heads"] * dim),
        "fc1": (2 * ffn, hidden),
        "fc2": (hidden, ffn),
        "output": (shape["vocab"], hidden),
    }


def graph_us(calls: list[Callable[[], Any]], replays: int = 15) -> float:
    """Microseconds of one replay of a CUDA graph of ``calls`` in order (the median of ``replays``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    del graph
    return statistics.median(times)


def one_gemm(n: int, k: int, rows: int, configs: list[fused.GemvConfig]) -> dict[str, Any]:
    """cuBLAS and each GEMV config on ``rows`` rows against distinct weights (~0.4 GB in all)."""
    size = n * k * 2
    copies = max(2, min(12, -(-400_000_000 // size)))
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    weights = [
        torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=generator)
        for _ in range(copies)
    ]
    x = torch.randn(rows, 1, k, device="cuda", generator=generator).to(torch.bfloat16)
    result: dict[str, Any] = {"bytes": size, "rows": rows}

    def rate(us: float) -> dict[str, float]:
        return {"us": round(us / copies, 2), "tb_per_s": round(size * copies / us / 1e6, 3)}

    result["cublas"] = rate(graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in weights]))
    expected = torch.nn.functional.linear(x.double(), weights[0].double())
    cublas_error = float((torch.nn.functional.linear(x, weights[0]).double() - expected).abs().max())
    result["cublas_max_abs_error"] = cublas_error
    result["gemv"] = {}
    for config in configs:
        name = f"n{config.block_n}_k{config.block_k}_w{config.warps}"
        try:
            timed = rate(graph_us([lambda w=w, c=config: fused.gemv(x, w, config=c) for w in weights]))
            error = float((fused.gemv(x, weights[0], config=config).double() - expected).abs().max())
            result["gemv"][name] = {**timed, "max_abs_error": error}
        except Exception as failure:  # a config the compiler refuses: the others stand
            result["gemv"][name] = {"error": f"{type(failure).__name__}: {failure}"[:300]}
    del weights
    torch.cuda.empty_cache()
    return result


def best(result: dict[str, Any]) -> fused.GemvConfig:
    timed = {name: entry["us"] for name, entry in result["gemv"].items() if "us" in entry}
    name = min(timed, key=lambda key: timed[key])
    block_n, block_k, warps = (int(part[1:]) for part in name.split("_"))
    return fused.GemvConfig(block_n=block_n, block_k=block_k, warps=warps)


CHAIN_VARIANTS: dict[str, tuple[frozenset[str], bool, bool]] = {
    "cublas": (frozenset(), False, False),
    "gemv": (frozenset({"qkv", "proj", "fc1", "fc2"}), False, False),
    "gemv-pdl": (frozenset({"qkv", "proj", "fc1", "fc2"}), False, True),
    "gemv-gated": (frozenset({"qkv", "proj", "fc1", "fc2"}), True, False),
    "gemv-gated-pdl": (frozenset({"qkv", "proj", "fc1", "fc2"}), True, True),
    "gemv-cublas-fc1-pdl": (frozenset({"qkv", "proj", "fc2"}), False, True),
}
"""Chain variant -> (the GEMMs through :func:`fused.gemv`, fc1 with its SwiGLU in the GEMV, the
fused kernels as programmatic dependent launches)."""


def chain(shape: dict[str, int], configs: dict[str, fused.GemvConfig | None]) -> dict[str, Any]:
    """One batch-1 decode step's layers (without attention and the output layer), 32 layers of
    distinct weights in one graph, ms per step, in each of :data:`CHAIN_VARIANTS`."""
    hidden = shape["hidden"]
    sizes = gemms(shape)
    generator = torch.Generator(device="cuda").manual_seed(7)

    def weight(name: str) -> torch.Tensor:
        n, k = sizes[name]
        return torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=generator)

    layers = [{name: weight(name) for name in ("qkv", "proj", "fc1", "fc2")} for _ in range(shape["layers"])]
    norm = torch.empty(hidden, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5, generator=generator)
    start = torch.randn(1, 1, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    results: dict[str, Any] = {}
    for variant, (through, gated, pdl) in CHAIN_VARIANTS.items():

        def linear(
            x: torch.Tensor, w: torch.Tensor, name: str, through: frozenset[str] = through, pdl: bool = pdl
        ) -> Any:
            if name in through:
                return fused.gemv(x, w, config=configs.get(name), pdl=pdl)
            return torch.nn.functional.linear(x, w)

        def step(gated: bool = gated, pdl: bool = pdl, linear: Callable[..., torch.Tensor] = linear) -> torch.Tensor:
            h = start.clone()
            for layer in layers:
                normed = fused.rms_norm(h, norm, 1e-5, pdl=pdl)
                assert isinstance(normed, torch.Tensor)
                linear(normed, layer["qkv"], "qkv")
                attended = linear(normed, layer["proj"], "proj")  # stands in for attention + proj
                normed, h = fused.rms_norm(attended, norm, 1e-5, residual=h, pdl=pdl)  # type: ignore[misc]
                if gated:
                    act = fused.gemv(normed, layer["fc1"], gated=True, config=configs.get("fc1-gated"), pdl=pdl)
                else:
                    act = fused.swiglu(linear(normed, layer["fc1"], "fc1"), pdl=pdl)
                h = linear(act, layer["fc2"], "fc2") + h
            return h

        try:
            us = graph_us([step], replays=10)
            results[variant] = {"ms_per_step": round(us / 1000, 4), "out": step()}
        except Exception as failure:
            results[variant] = {"error": f"{type(failure).__name__}: {failure}"[:400]}
    reference = results.get("cublas", {}).get("out")
    for entry in results.values():
        out = entry.pop("out", None)
        if out is not None and reference is not None:
            entry["max_abs_vs_cublas"] = float((out.float() - reference.float()).abs().max())
    results["weights_gb"] = round(sum(w.numel() * 2 for layer in layers for w in layer.values()) / 1e9, 3)
    return results


def gated_fc1(shape: dict[str, int], configs: list[fused.GemvConfig]) -> dict[str, Any]:
    """fc1 with its SwiGLU in one GEMV (``gated``) in each config against the plain GEMV + SwiGLU
    (the module's table) and cuBLAS + SwiGLU, in a graph over distinct weights."""
    n, k = gemms(shape)["fc1"]
    generator = torch.Generator(device="cuda").manual_seed(9)
    weights = [
        torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=generator)
        for _ in range(4)
    ]
    x = torch.randn(1, 1, k, device="cuda", generator=generator).to(torch.bfloat16)
    per = len(weights)
    result: dict[str, Any] = {
        "cublas_swiglu_us": round(
            graph_us([lambda w=w: fused.swiglu(torch.nn.functional.linear(x, w)) for w in weights]) / per, 2
        ),
        "gemv_swiglu_us": round(graph_us([lambda w=w: fused.swiglu(fused.gemv(x, w)) for w in weights]) / per, 2),
    }
    for config in configs:
        name = f"n{config.block_n}_k{config.block_k}_w{config.warps}"
        try:
            result[name] = round(
                graph_us([lambda w=w, c=config: fused.gemv(x, w, gated=True, config=c) for w in weights]) / per, 2
            )
        except Exception as failure:
            result[name] = f"{type(failure).__name__}: {failure}"[:200]
    del weights
    torch.cuda.empty_cache()
    return result


TUNE_CANDIDATES: dict[str, list[tuple[int, int, int]]] = {
    "qkv": [(4, 256, 4), (8, 256, 4), (8, 256, 8), (2, 1024, 4)],
    "proj": [(4, 512, 4), (8, 512, 8), (8, 512, 4), (2, 1024, 4)],
    "fc2": [(8, 512, 8), (4, 512, 4), (2, 1024, 4), (4, 1024, 8)],
    "fc1-gated": [(1, 512, 4), (1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 256, 4)],
}
"""(block_n, block_k, warps) tried per weight by :func:`tune` (each with 1 and 2 tiles ahead): the
fastest four of the 2026-12-02 sweep of each shape (``results/gemv-probe-h200-2026-12-02.json``)."""


def tune(shape: dict[str, int]) -> tuple[dict[tuple[int, int, bool], fused.GemvConfig], dict[str, Any]]:
    """The fastest :data:`TUNE_CANDIDATES` config of each decode weight as it runs in a batch-1 step:
    after a small kernel (an RMSNorm), both programmatic dependent launches, over distinct weights in
    one graph. Returns the configs by ``(n, k, gated)`` (:data:`fused.GEMV_CONFIGS`) and the times."""
    sizes = gemms(shape)
    generator = torch.Generator(device="cuda").manual_seed(13)
    hidden = shape["hidden"]
    norm = torch.empty(hidden, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5, generator=generator)
    chosen: dict[tuple[int, int, bool], fused.GemvConfig] = {}
    report: dict[str, Any] = {}
    for name, candidates in TUNE_CANDIDATES.items():
        gated = name == "fc1-gated"
        n, k = sizes["fc1" if gated else name]
        copies = max(2, min(12, -(-400_000_000 // (n * k * 2))))
        weights = [
            torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=generator)
            for _ in range(copies)
        ]
        x = torch.randn(1, 1, k, device="cuda", generator=generator).to(torch.bfloat16)
        before = torch.randn(1, 1, hidden, device="cuda", generator=generator).to(torch.bfloat16)
        times: dict[str, float] = {}
        for (block_n, block_k, warps), ahead in itertools.product(candidates, (1, 2)):
            config = fused.GemvConfig(block_n=block_n, block_k=block_k, warps=warps, ahead=ahead)

            def pair(
                w: torch.Tensor,
                c: fused.GemvConfig = config,
                x: torch.Tensor = x,
                before: torch.Tensor = before,
                gated: bool = gated,
            ) -> None:
                fused.rms_norm(before, norm, 1e-5, pdl=True)
                fused.gemv(x, w, gated=gated, config=c, pdl=True)

            key = f"n{block_n}_k{block_k}_w{warps}_a{ahead}"
            try:
                times[key] = round(graph_us([lambda w=w: pair(w) for w in weights]) / copies, 2)
            except Exception as failure:
                report[f"{name}_{key}_error"] = f"{type(failure).__name__}: {failure}"[:200]
        if times:
            best_key = min(times, key=lambda key: times[key])
            block_n, block_k, warps, ahead = (int(part[1:]) for part in best_key.split("_"))
            chosen[(n, k, gated)] = fused.GemvConfig(block_n=block_n, block_k=block_k, warps=warps, ahead=ahead)
            report[name] = {"bytes": n * k * 2, "us_with_norm_before": times, "best": best_key}
        del weights
        torch.cuda.empty_cache()
    return chosen, report


def save_configs(configs: dict[tuple[int, int, bool], fused.GemvConfig]) -> list[dict[str, Any]]:
    """:data:`fused.GEMV_CONFIGS` as JSON (:func:`load_configs` reads it back)."""
    return [{"n": n, "k": k, "gated": gated, **vars(config)} for (n, k, gated), config in configs.items()]


def load_configs(saved: list[dict[str, Any]]) -> dict[tuple[int, int, bool], fused.GemvConfig]:
    return {
        (entry["n"], entry["k"], entry["gated"]): fused.GemvConfig(
            block_n=entry["block_n"], block_k=entry["block_k"], warps=entry["warps"], ahead=entry["ahead"]
        )
        for entry in saved
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1", help="rows of the single-GEMM sweep (none: no sweep)")
    parser.add_argument(
        "--table", action="store_true", help="the chain with fused.gemv_config's table, not the sweep's best"
    )
    parser.add_argument("--tune", action="store_true", help="first tune() the configs the chain then uses")
    parser.add_argument("--save-configs", type=Path, help="write the tuned configs (engine_megatron.py --gemv-configs)")
    args = parser.parse_args()
    began = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "gemv_probe",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": SHAPE,
        "single": {},
    }
    chosen: dict[str, fused.GemvConfig | None] = {}
    if args.tune:
        tuned, report["tune"] = tune(SHAPE)
        fused.GEMV_CONFIGS.update(tuned)
        report["tuned"] = save_configs(tuned)
        if args.save_configs:
            args.save_configs.write_text(json.dumps(report["tuned"]))
        print(json.dumps(report["tuned"]), flush=True)
    for rows in (int(part) for part in args.rows.split(",") if part):
        for name, (n, k) in gemms(SHAPE).items():
            others = [c for c in CONFIGS if c.block_n <= 4 and c != chosen.get(name)][:3]
            configs = CONFIGS if rows == 1 else [chosen[name], *others]
            result = one_gemm(n, k, rows, configs)
            report["single"][f"{name}_rows{rows}"] = result
            if rows == 1 and not args.table:
                chosen[name] = best(result)
            Path(args.out).write_text(json.dumps(report, indent=1))
            print(name, rows, result["cublas"], chosen.get(name), flush=True)
    report["chosen_rows1"] = {name: vars(config) for name, config in chosen.items() if config is not None}
    gated = [fused.GemvConfig(block_n, block_k, 4) for block_n in (1, 2, 4) for block_k in (512, 1024)]
    report["fc1_gated_us"] = gated_fc1(SHAPE, gated)
    timed = {
        key: value for key, value in report["fc1_gated_us"].items() if key.startswith("n") and isinstance(value, float)
    }
    if timed and not args.tune:
        block_n, block_k, warps = (int(part[1:]) for part in min(timed, key=lambda key: timed[key]).split("_"))
        chosen["fc1-gated"] = fused.GemvConfig(block_n=block_n, block_k=block_k, warps=warps)
    try:
        report["chain"] = chain(SHAPE, chosen)
    except Exception as failure:
        report["chain_error"] = f"{type(failure).__name__}: {failure}"
    report["wall_s"] = round(time.monotonic() - began, 1)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report.get("chain"), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
