"""``bench/rollout.py``'s pure parts: the GRPO-shaped workload (siblings share their prompt, every
prompt starts with the system prefix, lengths within their ranges, the same draw every run), the
tail and throughput figures, and the bound from FLOPs and bytes; plus the Engine path on the tiny
model, whose siblings are prefilled once."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from megafleet_engine import backends
from megafleet_engine.backends import base

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def rollout() -> Iterator[ModuleType]:
    """The script as a module (it imports its neighbour ``benchkit``)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("rollout", BENCH / "rollout.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


def settings(**changed: object) -> argparse.Namespace:
    fields: dict[str, object] = {
        "prompts": 6,
        "samples": 4,
        "prompt_min": 30,
        "prompt_max": 60,
        "system_tokens": 10,
        "median_output": 8,
        "output_sigma": 1.0,
        "max_output": 20,
        "seed": 0,
    }
    fields.update(changed)
    return argparse.Namespace(**fields)


def test_the_workload_is_grpo_shaped_and_the_same_every_run(rollout: ModuleType) -> None:
    requests = rollout.workload(settings(), vocab=500)
    assert len(requests) == 24
    assert requests == rollout.workload(settings(), vocab=500)
    assert requests != rollout.workload(settings(seed=1), vocab=500)
    system = requests[0].prompt_token_ids[:10]
    for prompt_index in range(6):
        siblings = requests[4 * prompt_index : 4 * prompt_index + 4]
        assert len({request.prompt_token_ids for request in siblings}) == 1
        assert siblings[0].prompt_token_ids[:10] == system and 30 <= len(siblings[0].prompt_token_ids) <= 60
        assert len({request.params.seed for request in siblings}) == 4
    lengths = [request.params.max_tokens for request in requests]
    assert all(1 <= length <= 20 for length in lengths) and len(set(lengths)) > 4
    assert all(request.params.ignore_eos and request.params.temperature == 1.0 for request in requests)


def test_figures_give_the_tail_from_the_90th_percentile_finish(rollout: ModuleType) -> None:
    requests = rollout.workload(settings(prompts=5, samples=2), vocab=500)
    finishes = [100.0 + second for second in (1, 2, 3, 4, 5, 6, 7, 8, 9, 20)]
    found = rollout.figures(requests, 100.0, finishes, {})
    assert (found["wall_s"], found["p90_finish_s"], found["tail_s"]) == (20.0, 9.0, 11.0)
    assert found["output_tok_per_s"] == round(sum(r.params.max_tokens for r in requests) / 20, 1)


@pytest.mark.slow  # runs the tiny model
def test_the_bound_and_the_engine_path_on_the_tiny_model(rollout: ModuleType) -> None:
    backend = backends.load_backend("transformers", "tiny://llama", name="tiny", max_sequence_length=128)
    requests = rollout.workload(settings(), vocab=backend.info.vocab_size)
    speed = {"matmul_flop_per_s": 1e12, "memory_bytes_per_s": 1e11}
    found = rollout.bound(requests, rollout.dimensions(backend), 32, speed)
    assert found["bound_s"] > 0 and found["decode_steps"] == max(r.params.max_tokens for r in requests)
    ran = rollout.through_engine(backend, requests, 32)
    prompt_tokens = sum(len(request.prompt_token_ids) for request in requests)
    assert ran["prefilled_prompt_tokens"] == prompt_tokens
    assert ran["cache_hit_rate"] == 0.75  # four samples per prompt, one batch: three of four skip their prefill
    assert ran["output_tokens"] == sum(request.params.max_tokens for request in requests)
    assert isinstance(backend, base.CachesPrefixes)
