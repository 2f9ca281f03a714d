"""The megatron backend's per-step fast paths, on the CPU: the sampler without host
synchronisation draws exactly what the per-bucket path draws, and the runner's step arrays give
exactly the token steps megatron's request records give.

megatron-core is not needed: the sampler reads only the context megatron hands it (faked here),
and the runner is driven by a fake engine that keeps megatron's step contract (one token per
running request per step in ``sample``; a request megatron finishes, by its termination id or its
token budget, is in ``finished_request_ids`` and in the step's finished records; a request put in
``stop_word_finished_request_ids`` finishes at the next step without a new token). The GPU test
``test_gpu_megatron.py::TestOnGpu::test_fast_step_paths_*`` checks the same on megatron itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import itertools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megafleet_engine.backends import base, megatron
from megafleet_engine.backends.megatron import batch_runner, lockstep, nemo_sampler
from megafleet_engine.backends.megatron import build as megatron_build
from megafleet_engine.backends.megatron.nemo_sampler import NemoSampling

VOCAB = 64
EOS = 2


def fake_context(knobs: list[tuple[float, int, float]]) -> Any:
    """What the sampler reads of megatron's context: per-request metadata on the host."""
    return types.SimpleNamespace(
        total_request_count=len(knobs),
        paused_request_count=0,
        request_ids=torch.arange(100, 100 + len(knobs)),
        active_request_metadata={
            "temperature": torch.tensor([knob[0] for knob in knobs]),
            "top_k": torch.tensor([knob[1] for knob in knobs]),
            "top_p": torch.tensor([knob[2] for knob in knobs]),
        },
    )


def draw(knobs: list[tuple[float, int, float]], sync_free: bool, logprobs: bool = False) -> torch.Tensor:
    logits = torch.randn(len(knobs) + 3, VOCAB, generator=torch.Generator().manual_seed(1))  # padded rows
    sampler = NemoSampling(torch.Generator().manual_seed(7), VOCAB)
    sampler.sync_free = sync_free
    context = fake_context(knobs)
    if logprobs:
        return sampler.log_probs_kernel(logits[: len(knobs)].float(), context)
    output = torch.full((len(knobs) + 3,), -5, dtype=torch.int64)
    sampler.sample_kernel(logits, len(knobs), context, no_top_k=False, no_top_p=False, output=output[: len(knobs)])
    return output


GREEDY = (1.0, 1, 0.0)
NUCLEUS = (0.7, 5, 0.9)


@pytest.mark.parametrize(
    "knobs",
    [[GREEDY], [GREEDY] * 5, [NUCLEUS] * 4, [GREEDY, NUCLEUS, GREEDY, (0.9, 0, 0.5)]],
    ids=["greedy-1", "greedy-5", "uniform-nucleus", "mixed"],
)
def test_the_sync_free_sampler_draws_what_the_bucket_path_draws(knobs: list[tuple[float, int, float]]) -> None:
    fast, slow = draw(knobs, True), draw(knobs, False)
    assert torch.equal(fast, slow)
    assert (fast[len(knobs) :] == -5).all(), "rows past the active ones are left alone"
    assert ((fast[: len(knobs)] >= 0) & (fast[: len(knobs)] < VOCAB)).all()
    assert torch.equal(draw(knobs, True, logprobs=True), draw(knobs, False, logprobs=True))


# -- the runner's step arrays ----------------------------------------------------------------------


class FakeRequest:
    def __init__(self, request_id: int, prompt: list[int], params: Any) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.generated_tokens: list[int] = []
        self.generated_log_probs: list[float] = []
        self.generated_top_n_logprobs: list[dict[int, float]] = []
        self.status = "active"


class FakeRecord:
    def __init__(self, request: FakeRequest) -> None:
        self.requests = [request]

    def merge(self) -> FakeRequest:
        return self.requests[-1]


class FakeEngine:
    """megatron's engine as the runner drives it; request ``i``'s token at position ``p`` is
    ``script(prompt, p)``."""

    def __init__(self) -> None:
        self.requests: dict[int, Any] = {}
        self.stop_word_finished_request_ids: set[int] = set()
        self.controller = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eod=EOS))
        self._order: list[int] = []

    @staticmethod
    def script(prompt: list[int], position: int) -> int:
        return (prompt[0] * 7 + position * 3) % VOCAB

    def add_request(self, request_id: int, prompt: list[int], params: Any) -> Any:
        self.requests[request_id] = types.SimpleNamespace(record=FakeRecord(FakeRequest(request_id, prompt, params)))
        self._order.append(request_id)
        return types.SimpleNamespace(done=lambda: False)

    def has_unfinished_requests(self) -> bool:
        return bool(self._order)

    # megatron's own driving (engine.generate / step_modern), as the benchmark's direct path uses it

    request_counter = itertools.count()
    _loop: asyncio.AbstractEventLoop  # set by the runner, as on megatron's engine

    def step_modern(self) -> dict[str, Any]:
        async def step() -> dict[str, Any]:
            return await self.async_bookkeep(*await self.async_forward())

        return self._loop.run_until_complete(step())

    def generate(self, prompts: list[list[int]], params: Any) -> list[FakeRecord]:
        records: list[FakeRecord] = []
        for prompt in prompts:
            self.add_request(int(next(self.request_counter)), prompt, params)
        while self.has_unfinished_requests():
            records.extend(self.step_modern()["finished_request_records"])
        return sorted(records, key=lambda record: record.requests[-1].request_id)

    async def async_forward(self) -> tuple[dict[str, Any] | None, dict[str, Any], float]:
        ids, tokens, finished = [], [], []
        for request_id in self._order:
            request = self.requests[request_id].record.requests[-1]
            token = self.script(request.prompt, len(request.generated_tokens))
            ids.append(request_id)
            tokens.append(token)
            params = request.params
            stopped = request_id in self.stop_word_finished_request_ids
            if (
                stopped
                or token == params.termination_id
                or len(request.generated_tokens) + 1 >= params.num_tokens_to_generate
            ):
                finished.append(request_id)
        output = {
            "active_request_ids": torch.tensor(ids, dtype=torch.int64),
            "sample": torch.tensor(tokens, dtype=torch.int64),
            "finished_request_ids": torch.tensor(finished, dtype=torch.int64),
        }
        return output, {}, 0.0

    async def async_bookkeep(self, output: dict[str, Any] | None, state: Any, step_time: float) -> dict[str, Any]:
        assert output is not None
        finished = set(output["finished_request_ids"].tolist())
        active, records = [], []
        for request_id, token in zip(output["active_request_ids"].tolist(), output["sample"].tolist(), strict=True):
            record = self.requests[request_id].record
            request = record.requests[-1]
            if request_id not in self.stop_word_finished_request_ids:
                request.generated_tokens.append(token)
                request.generated_log_probs.append(-0.25 * token)
                request.generated_top_n_logprobs.append({token: -0.25 * token, token + 1: -9.0})
            if request_id in finished:
                self.stop_word_finished_request_ids.discard(request_id)
                del self.requests[request_id]
                self._order.remove(request_id)
                records.append(record)
            else:
                active.append(request_id)
        return {"active_request_ids": active, "finished_request_records": records}


@pytest.fixture
def no_megatron(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The runner's megatron imports answered by plain stand-ins."""
    sampling_params = types.SimpleNamespace(SamplingParams=lambda **kwargs: types.SimpleNamespace(**kwargs))
    monkeypatch.setattr(megatron_build, "megatron_core", lambda module: sampling_params)
    monkeypatch.setattr(megatron, "megatron_core", lambda module: sampling_params)
    monkeypatch.setattr(nemo_sampler, "install", lambda controller: NemoSampling(torch.Generator(), VOCAB))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    yield


def run(batch: list[base.SequenceRequest], array_collect: bool) -> list[list[base.TokenStep]]:
    info = base.ModelInfo(name="fake", max_sequence_length=40, vocab_size=VOCAB, eos_token_id=EOS)
    runner = batch_runner.Runner(
        FakeEngine(),
        info,
        lockstep.Lockstep(None, leader=True, device=0),
        max_requests=8,
        other_eos=frozenset({3}),
    )
    runner.array_collect = array_collect
    try:
        return list(runner.lead(list(batch), None))
    finally:
        runner.close()


def by_request(steps: list[base.TokenStep]) -> dict[str, list[base.TokenStep]]:
    grouped: dict[str, list[base.TokenStep]] = {}
    for step in steps:
        grouped.setdefault(step.request_id, []).append(step)
    return grouped


def request(key: str, first: int, **params: Any) -> base.SequenceRequest:
    sampling = base.SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **params})
    return base.SequenceRequest(key, (first, 5, 6), sampling)


def test_step_arrays_give_the_records_token_steps(no_megatron: None) -> None:
    batch = [
        request("plain", 1, ignore_eos=True),
        request("budget", 4, max_tokens=60, ignore_eos=True),  # megatron's budget (max length) ends it
        request("stop", 9, stop_token_ids=(FakeEngine.script([9], 4),), ignore_eos=True),
        request("eos", 36),  # samples EOS (2) at position 2: megatron's termination id ends it
        request("logprobs", 1, logprobs=1, ignore_eos=True),
        request("other-eos", 0),  # samples 3 (another EOS id megatron does not know) at position 1
    ]
    with_arrays, from_records = run(batch, True), run(batch, False)

    # the same steps, each with the same tokens per sequence (the order across sequences within a
    # step may differ: plain sequences come first with arrays)
    assert [by_request(produced) for produced in with_arrays] == [by_request(produced) for produced in from_records]
    steps = [step for produced in with_arrays for step in produced]
    finishes = {step.request_id: step.finish_reason for step in steps if step.finish_reason}
    assert finishes == {
        "plain": "length",
        "budget": "length",
        "stop": "stop",
        "eos": "stop",
        "logprobs": "length",
        "other-eos": "stop",
    }
    counts = {key: sum(step.request_id == key for step in steps) for key in finishes}
    assert counts["plain"] == 12 and counts["budget"] == 40 - 3 and counts["stop"] == 5
    assert all(step.logprob is not None for step in steps if step.request_id == "logprobs")
    assert all(step.logprob is None for step in steps if step.request_id != "logprobs")


def test_the_runner_step_reads_arrays_only_with_array_collect(no_megatron: None) -> None:
    info = base.ModelInfo(name="fake", max_sequence_length=40, vocab_size=VOCAB, eos_token_id=EOS)
    engine = FakeEngine()
    runner = batch_runner.Runner(
        engine, info, lockstep.Lockstep(None, leader=True, device=0), max_requests=8, other_eos=frozenset()
    )
    try:
        runner.apply(lockstep.Tick(join=(request("a", 1),)))
        runner.step()
        assert runner._arrays is not None and runner._arrays[0] == [batch_runner._FIRST_REQUEST_ID]
        runner.array_collect = False
        runner.step()
        assert runner._arrays is None
    finally:
        runner.close()


# -- the benchmark's code path on the fake engine ----------------------------------------------------


@dataclasses.dataclass
class FakeShape:
    layers: int = 1


class FakeBackend:
    """What ``bench/engine_megatron.py`` and ``bench/profile_decode.py`` use of a megatron backend,
    over :class:`FakeEngine` and the real :class:`~.batch_runner.Runner`."""

    def __init__(self, graph_scope: str = "layer", **options: Any) -> None:
        self.info = base.ModelInfo(name="fake", max_sequence_length=64, vocab_size=VOCAB, eos_token_id=EOS)
        self.shape = FakeShape()
        self.engine = FakeEngine()
        self._batch = batch_runner.Runner(
            self.engine,
            self.info,
            lockstep.Lockstep(None, leader=True, device=0),
            max_requests=8,
            other_eos=frozenset(),
        )
        self.graph_scope = graph_scope
        self.async_schedule = False

    def generate(self, batch: list[base.SequenceRequest], admit: Any = None) -> Any:
        return self._batch.lead(list(batch), admit)

    def set_step_options(
        self,
        *,
        async_schedule: bool | None = None,
        sync_free_sampling: bool | None = None,
        array_collect: bool | None = None,
    ) -> None:
        self.async_schedule = self.async_schedule if async_schedule is None else async_schedule
        if sync_free_sampling is not None:
            self._batch.sampler.sync_free = sync_free_sampling
        if array_collect is not None:
            self._batch.array_collect = array_collect

    def close(self) -> None:
        self._batch.close()

    def step_options(self) -> dict[str, Any]:
        return {
            "async_schedule": self.async_schedule,
            "sync_free_sampling": self._batch.sampler.sync_free,
            "array_collect": self._batch.array_collect,
            "graph_scope": self.graph_scope,
        }


def test_the_engine_benchmark_runs_every_setting_path_and_profile(
    no_megatron: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``bench/engine_megatron.py`` end to end on the fake engine (CPU), so a broken script shows
    here rather than in the GPU machine's minutes: every setting and path at two batch sizes, the
    pruning of the larger one, token equality, the profile summary."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    benchkit = importlib.import_module("benchkit")
    engine_megatron = importlib.import_module("engine_megatron")

    monkeypatch.setattr(
        benchkit,
        "load_megatron",
        lambda source, **options: FakeBackend(**{key: value for key, value in options.items() if key == "graph_scope"}),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(benchkit, "cuda_sync", lambda: lambda: None)
    out = tmp_path / "engine.json"
    argv = ["engine_megatron.py", "--batches", "1,3", "--prune-above", "1", "--prompt-tokens", "4"]
    argv += ["--new-tokens", "6", "--max-sequence-length", "64", "--repeats", "2", "--out", str(out)]
    argv += ["--profile", "baseline:backend,baseline:direct,fast-async:backend", "--profile-steps", "8"]
    monkeypatch.setattr(sys, "argv", argv)

    assert engine_megatron.main() == 0

    import json

    result = json.loads(out.read_text())
    assert set(result["errors"]) <= {"write_weights"}, result["errors"]
    first = result["figures"]["batch_1"]
    assert set(first) == {"baseline", "fast", "fast-async", "block-fast-async"}
    for variant, row in first.items():
        assert row["direct"]["tokens"] == row["backend"]["tokens"] == 6, variant
        assert len(row["backend"]["runs_s"]) == 2 and row["backend"]["tokens_equal_direct"], variant
        assert row["backend"]["tokens_equal_baseline_direct"], variant
    assert first["fast"]["options"]["array_collect"] and not first["baseline"]["options"]["array_collect"]
    pruned = result["figures"]["batch_3"]
    assert list(pruned) == list(dict.fromkeys([engine_megatron.fastest(first), "baseline"]))  # the fastest first
    assert [(item["variant"], item["path"]) for item in result["profiles"]] == [
        ("baseline", "backend"),
        ("baseline", "direct"),
        ("fast-async", "backend"),
    ]
    text = (tmp_path / "engine-profile.txt").read_text()
    assert "runner.collect (ours: token steps)" in text and "wall per step" in text


def test_model_parallel_shards_keep_per_layer_graphs_and_the_ordinary_step_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Block graphs, asynchronous scheduling and the fused kernels (the defaults) are single-GPU
    only: a shard of several ranks falls back, with a log line."""
    defaults = megatron.EngineOptions()
    assert (defaults.graph_scope, defaults.async_schedule, defaults.fused_kernels) == ("block", True, "rope-swiglu")
    assert megatron_build.effective_options(defaults, 1) == defaults
    with caplog.at_level("INFO", logger=megatron_build.__name__):
        shard = megatron_build.effective_options(defaults, 2)
    assert (shard.graph_scope, shard.async_schedule, shard.fused_kernels) == ("layer", False, "off")
    assert dataclasses.replace(shard, graph_scope="block", async_schedule=True, fused_kernels="rope-swiglu") == defaults
    assert "single-GPU only" in caplog.text
