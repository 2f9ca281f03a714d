"""The megatron backend: source parsing and sampling maps (anywhere), generation, continuous
batching, in-place weight writes, refits in each KV-cache mode and a TP=2 shard on megatron-core's
dynamic engine (NVIDIA GPUs with megatron-core and flash-attention).

The GPU tests skip cleanly here (no GPU, no megatron-core: it needs Python >= 3.12). On the GPU
machine they build one tiny Llama (bf16, decode CUDA graphs on) whose attention and output
weights are scaled up, so attention is peaked and wrong head layouts would show in the outputs.

Run as a script under ``torchrun --nproc-per-node 2`` this file is the TP=2 worker of
:class:`TestTensorParallel` (``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/gpu/test_gpu_megatron.py OUT.json``). With ``MEGAFLEET_GPU_REPORT=FILE`` set, the tests append
what they measured to ``FILE`` (JSON lines).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import faulthandler
import json
import math
import os
import subprocess
import sys
import threading
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import fused_reference, gpu
from megafleet_engine import cli
from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base, megatron, weight_maps
from megafleet_engine.backends.megatron import fused
from megafleet_engine.models import tiny
from megafleet_protocol import engine_settings as settings
from megafleet_protocol import env, vocabulary

TIE = 0.1
"""Log-probability gap of the best two tokens under which two bf16 computations of one greedy step
(other reduction order: TP=2, another batch) may pick different tokens."""
ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu.GPU_SKIP is not None, reason=gpu.GPU_SKIP or ""),
    # megatron-core, the cutlass DSL and flash-attention-4 warn (deprecations, optional packages,
    # JIT notes) in ways this project does not control; show those warnings, don't fail on them.
    pytest.mark.filterwarnings("default"),
]


# -- anywhere --------------------------------------------------------------------------------------


def test_random_source_takes_a_preset_and_overrides() -> None:
    parsed = megatron.parse_source("random://llama-8b?layers=2&seed=7")
    assert parsed.kind == "random"
    assert parsed.seed == 7
    assert (parsed.shape.layers, parsed.shape.hidden, parsed.shape.kv_heads, parsed.shape.vocab) == (2, 4096, 8, 128256)
    assert parsed.shape.rope_scaling_factor == 8.0
    smaller = megatron.parse_source("random://llama-8b?hidden=1024&heads=8&kv_heads=2")
    assert smaller.shape.head_dim == 128


def test_tiny_source_has_the_transformers_backend_shape() -> None:
    parsed = megatron.parse_source("tiny://llama?layers=3")
    model, tokenizer = tiny.build_tiny("tiny://llama?layers=3")
    assert parsed.shape.layers == 3
    assert parsed.shape.vocab == model.config.vocab_size == len(tokenizer)
    assert set(weight_maps.hf_shapes(parsed.shape)) == {name for name, _ in model.named_parameters()}
    assert parsed.eos_token_ids == (tokenizer.eos_token_id,)


@pytest.mark.parametrize(
    "source",
    ["random://gpt-9", "random://llama-8b?depth=3", "s3://bucket/model", "/nonexistent/checkpoint"],
)
def test_bad_sources_are_refused(source: str) -> None:
    with pytest.raises(ValueError):
        megatron.parse_source(source)


def test_sampling_maps_onto_megatron_parameters() -> None:
    greedy = megatron.to_megatron_sampling(
        base.SamplingParams(max_tokens=100, temperature=0.0, logprobs=2), budget=40, termination_id=2
    )
    assert greedy["top_k"] == 1 and greedy["temperature"] == 1.0 and greedy["top_p"] == 0.0
    assert greedy["num_tokens_to_generate"] == 40
    assert greedy["return_log_probs"] and greedy["top_n_logprobs"] == 2 and greedy["termination_id"] == 2
    nucleus = megatron.to_megatron_sampling(
        base.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, ignore_eos=True), budget=40, termination_id=2
    )
    assert (nucleus["temperature"], nucleus["top_k"], nucleus["top_p"]) == (0.7, 0, 0.9)
    assert nucleus["termination_id"] == -1 and not nucleus["return_log_probs"]
    both = megatron.to_megatron_sampling(
        base.SamplingParams(max_tokens=5, top_k=5, top_p=0.5), budget=10, termination_id=2
    )
    assert (both["top_k"], both["top_p"]) == (5, 0.5), "NeMo's filter takes top-k with top-p"


@pytest.mark.parametrize(("dtype", "device"), [("float32", "cuda"), ("bfloat16", "cpu")])
def test_load_refuses_what_megatron_cannot_run(dtype: str, device: str) -> None:
    with pytest.raises(ValueError, match="megatron backend"):
        megatron.load(gpu.SOURCE, name="t", max_sequence_length=64, dtype=dtype, device=device, load_weights=True)


# -- on the GPU ------------------------------------------------------------------------------------


def build(
    kv_cache_mode: vocabulary.KvCacheMode = "persist",
    parallel: base.Parallel | None = None,
    *,
    name: str = "tiny",
    **options: Any,
) -> megatron.MegatronBackend:
    """The tiny model on this process's GPU (graphs on, 1 GB of KV cache) with the scaled weights;
    ``options`` override the other ``EngineOptions`` (step settings, fused kernels)."""
    loaded = megatron.load(
        gpu.SOURCE,
        name=name,
        max_sequence_length=gpu.MAX_SEQUENCE_LENGTH,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        parallel=parallel,
        options=megatron.EngineOptions(
            max_batch_size=8, kv_buffer_gb=1.0, max_step_tokens=2048, kv_cache_mode=kv_cache_mode, **options
        ),
    )
    loaded.write_weights(gpu.scaled_reference_weights())
    return loaded


@pytest.fixture(scope="module")
def backend() -> Iterator[megatron.MegatronBackend]:
    loaded = build()
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def prompts(backend: megatron.MegatronBackend) -> list[list[int]]:
    return [backend.tokenizer.encode(text) for text in gpu.TEXTS]


def greedy_requests(prompts: list[list[int]], **extra: object) -> list[base.SequenceRequest]:
    params = base.SamplingParams(max_tokens=gpu.NEW_TOKENS, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]
    return [base.SequenceRequest(str(index), tuple(prompt), params) for index, prompt in enumerate(prompts)]


def run(backend: base.Backend, requests: list[base.SequenceRequest]) -> dict[str, list[base.TokenStep]]:
    steps: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in requests}
    for batch in backend.generate(requests):
        for step in batch:
            steps[step.request_id].append(step)
    return steps


def tokens(steps: dict[str, list[base.TokenStep]]) -> dict[str, list[int]]:
    return {request_id: [step.token_id for step in produced] for request_id, produced in steps.items()}


def agreed_prefix(reference: list[base.TokenStep], produced: list[int]) -> int:
    """How many leading tokens of ``produced`` equal the reference's greedy tokens. They may differ
    only where the reference's best two log-probabilities are within :data:`TIE` (the reference must
    carry ``logprobs >= 2``); after a difference the sequences are different and not compared."""
    assert len(produced) == len(reference), (len(produced), len(reference))
    for position, step in enumerate(reference):
        if produced[position] != step.token_id:
            margin = step.top_logprobs[0][1] - step.top_logprobs[1][1]
            assert margin < TIE, (
                f"token {position}: {produced[position]} != {step.token_id}, reference margin {margin:.3f}"
            )
            return position
    return len(reference)


def nemo_logprobs(logits: torch.Tensor, mode: base.LogprobsMode) -> torch.Tensor:
    """NeMo RL's trainer-side processed log-probabilities at T=0.7, top_k=5, top_p=0.9 of float32
    ``logits`` ``[rows, vocab]`` (temperature, top-k keeping ties, top-p with an ascending
    cumulative sum keeping ``> 1 - top_p`` and the largest; written here, not imported from the
    engine), or ``log_softmax`` of the logits for ``raw``."""
    if mode == "raw":
        return torch.log_softmax(logits, dim=-1)
    values, index = (logits / 0.7).sort(dim=-1, descending=False)
    values.masked_fill_(values < values[..., -5:-4], -float("inf"))
    mass = torch.cumsum(values.softmax(dim=-1), dim=-1)
    kept = mass > 1 - 0.9
    kept[..., -1] = True
    values.masked_fill_(~kept, -float("inf"))
    return torch.log_softmax(values.scatter(dim=-1, index=index, src=values), dim=-1)


def assert_a_persist_refit_is_followed(
    backend: megatron.MegatronBackend, prompts: list[list[int]], produced: dict[str, list[int]]
) -> None:
    """A ``persist`` refit to other weights changes the greedy tokens of ``prompts`` (the graphs
    read the weights the refit wrote, no recapture); writing the reference weights back restores
    ``produced``, what the backend made before."""
    backend.begin_weight_update("persist")
    backend.write_weights(gpu.scaled_reference_weights(seed=1))
    backend.finish_weight_update("persist")
    changed = tokens(run(backend, greedy_requests(prompts)))
    backend.begin_weight_update("persist")
    backend.write_weights(gpu.scaled_reference_weights())
    backend.finish_weight_update("persist")
    assert sum(changed[key] != produced[key] for key in produced) >= 3
    assert tokens(run(backend, greedy_requests(prompts))) == produced


async def gather_tokens(scheduler: engine_module.Engine, request: base.SequenceRequest) -> list[int]:
    return [step.token_id async for step in scheduler.submit(request)]


def staggered(
    backend: megatron.MegatronBackend, requests: list[base.SequenceRequest]
) -> tuple[list[list[int]], engine_module.Engine]:
    """Through the scheduler: the first request alone, the others once its first token arrived."""
    scheduler = engine_module.Engine(backend, max_batch_size=8)

    async def scenario() -> list[list[int]]:
        stream = scheduler.submit(requests[0])
        first = [(await anext(stream)).token_id]
        later = [asyncio.ensure_future(gather_tokens(scheduler, request)) for request in requests[1:]]
        rest = [step.token_id async for step in stream]
        return [first + rest] + [await task for task in later]

    try:
        return asyncio.run(scenario()), scheduler
    finally:
        scheduler.close()


async def together(scheduler: engine_module.Engine, requests: list[base.SequenceRequest]) -> dict[str, list[int]]:
    """Through the scheduler, all in one batch: hold the backend thread until every request waits."""
    release = threading.Event()
    blocker = asyncio.ensure_future(scheduler.run_exclusive(release.wait))
    tasks = [asyncio.ensure_future(gather_tokens(scheduler, request)) for request in requests]
    while scheduler.queue_depth < len(requests):
        await asyncio.sleep(0.001)
    release.set()
    await blocker
    return {request.request_id: await task for request, task in zip(requests, tasks, strict=True)}


class TestOnGpu:
    """One tiny model (bf16, CUDA graphs), shared by every test of the class."""

    pytestmark = ON_GPU

    def test_live_parameters_hold_exactly_the_mapped_hf_weights(self, backend: megatron.MegatronBackend) -> None:
        live = {name: parameter.data for name, parameter in backend.model.named_parameters()}
        back = weight_maps.megatron_to_hf([live], backend.shape)
        expected = gpu.scaled_reference_weights()
        assert sorted(back) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(back[name].cpu(), tensor), name
        views = backend.parameters()
        assert set(views) == set(expected)
        assert all(view.is_cuda and view.dtype == torch.bfloat16 for view in views.values())

    def test_greedy_equals_megatron_engine_called_directly(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        sampling = megatron.megatron_core("inference.sampling_params")
        direct = backend.engine.generate(
            prompts, sampling.SamplingParams(top_k=1, num_tokens_to_generate=gpu.NEW_TOKENS, termination_id=-1)
        )
        expected = {str(index): list(record.merge().generated_tokens) for index, record in enumerate(direct)}

        produced = run(backend, greedy_requests(prompts))

        assert tokens(produced) == expected
        for steps in produced.values():
            assert len(steps) == gpu.NEW_TOKENS
            assert [step.finish_reason for step in steps] == [None] * (gpu.NEW_TOKENS - 1) + ["length"]

    def test_logprobs_match_the_hf_reference_model(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """Teacher-force megatron's greedy output through the HF model (fp32, the same bf16 weights)."""
        reference, _ = tiny.build_tiny(gpu.SOURCE)
        reference.load_state_dict({name: tensor.float() for name, tensor in gpu.scaled_reference_weights().items()})
        reference.cuda()
        produced = run(backend, greedy_requests(prompts, logprobs=3))
        worst = 0.0
        for index, prompt in enumerate(prompts):
            steps = produced[str(index)]
            sequence = torch.tensor([prompt + [step.token_id for step in steps]], device="cuda")
            with torch.no_grad():
                logprobs = torch.log_softmax(reference(sequence).logits[0].float(), dim=-1)
            for position, step in enumerate(steps):
                row = logprobs[len(prompt) - 1 + position]
                assert step.logprob is not None
                assert len(step.top_logprobs) == 3 and step.top_logprobs[0][0] == step.token_id
                worst = max(worst, abs(step.logprob - float(row[step.token_id])))
                assert float(row[step.token_id]) >= float(row.max()) - 0.25, (index, position)
        assert worst < 0.25, worst

    @pytest.mark.parametrize("mode", ["processed", "raw"])
    def test_sampled_logprobs_follow_nemos_convention(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]], mode: base.LogprobsMode
    ) -> None:
        """NeMo's processed-logprob convention on megatron: T=0.7, top_k=5, top_p=0.9. Exact part: every reported
        log-probability equals NeMo's processed one (raw mode: ``log_softmax``) of the very logits
        row megatron sampled from (recorded at the sampler), within 1e-4, and is finite. Model part:
        it equals the HF fp32 model's (the same bf16 weights) within :data:`TIE`-like bf16 noise
        (0.25, as the greedy test: bf16 activations, logits scaled up tenfold and by 1/T), where
        both keep the same tokens (a bf16 difference may move a token across the top-p boundary).
        One request at a time, so each recorded row belongs to the next token."""
        sampler = backend.engine.controller._sampling
        rows: list[torch.Tensor] = []
        kernel = sampler.log_probs_kernel

        def recording(logits: torch.Tensor, context: Any, **kwargs: Any) -> torch.Tensor:
            assert logits.shape[0] == 1, "one request at a time"
            rows.append(logits[0].detach().float().clone())
            result: torch.Tensor = kernel(logits, context, **kwargs)
            return result

        reference, _ = tiny.build_tiny(gpu.SOURCE)
        reference.load_state_dict({name: tensor.float() for name, tensor in gpu.scaled_reference_weights().items()})
        reference.cuda()
        params = base.SamplingParams(
            max_tokens=gpu.NEW_TOKENS,
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            ignore_eos=True,
            logprobs=5,
            logprobs_mode=mode,
        )
        worst_exact, worst_model, compared, total, kept_sizes = 0.0, 0.0, 0, 0, set()
        sampler.log_probs_kernel = recording
        try:
            for index, prompt in enumerate(prompts):
                rows.clear()
                steps = run(backend, [base.SequenceRequest(str(index), tuple(prompt), params)])[str(index)]
                assert len(steps) == gpu.NEW_TOKENS and len(rows) == gpu.NEW_TOKENS, (len(steps), len(rows))
                sequence = torch.tensor([prompt + [step.token_id for step in steps]], device="cuda")
                with torch.no_grad():
                    hf_logits = (
                        reference(sequence).logits[0].float()[len(prompt) - 1 : len(prompt) - 1 + gpu.NEW_TOKENS]
                    )
                hf = nemo_logprobs(hf_logits, mode)
                for position, step in enumerate(steps):
                    own = nemo_logprobs(rows[position].unsqueeze(0), mode)[0]
                    assert step.logprob is not None and math.isfinite(step.logprob), (index, position, step)
                    worst_exact = max(worst_exact, abs(step.logprob - float(own[step.token_id])))
                    for token, value in step.top_logprobs:
                        assert value == float(own[token]) or abs(value - float(own[token])) < 1e-4
                    kept = torch.isfinite(own)
                    kept_sizes.add(int(kept.sum()))
                    total += 1
                    if torch.equal(kept, torch.isfinite(hf[position])):
                        compared += 1
                        worst_model = max(worst_model, abs(step.logprob - float(hf[position, step.token_id])))
        finally:
            del sampler.log_probs_kernel
        gpu.report(
            f"sampled_logprobs_{mode}", worst_exact=worst_exact, worst_model=worst_model, compared=compared, total=total
        )
        assert worst_exact < 1e-4, worst_exact
        assert worst_model < 0.25 and compared >= total // 2, (worst_model, compared, total)
        if mode == "processed":
            assert max(kept_sizes) <= 8 and min(kept_sizes) < 5, kept_sizes  # top-k (ties kept) and top-p cut

    def test_in_place_weight_writes_change_outputs_and_restoring_restores_them(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        requests = greedy_requests(prompts)
        before = tokens(run(backend, requests))
        views = backend.parameters()
        saved = {name: view.clone() for name, view in views.items()}
        pointers = {name: parameter.data_ptr() for name, parameter in backend.model.named_parameters()}

        backend.write_weights(gpu.scaled_reference_weights(seed=1))
        backend.finish_weight_update("persist")
        changed = tokens(run(backend, requests))

        for name, view in backend.parameters().items():  # restore through the aliasing views
            view.copy_(saved[name])
        backend.finish_weight_update("persist")
        restored = tokens(run(backend, requests))

        assert {name: parameter.data_ptr() for name, parameter in backend.model.named_parameters()} == pointers
        assert sum(changed[key] != before[key] for key in before) >= 3
        assert restored == before

    def test_sliced_writes_equal_whole_writes(self, backend: megatron.MegatronBackend) -> None:
        whole = gpu.scaled_reference_weights()
        before = {name: view.clone() for name, view in backend.parameters().items()}
        sliced = []
        for spec in backend.shard_map().specs.values():
            for piece in spec.pieces:
                dim, start, stop = piece.hf_range
                sliced.append((piece.hf_name, whole[piece.hf_name].narrow(dim, start, stop - start).clone()))
        backend.write_weights(sliced, sliced=True)
        after = backend.parameters()
        assert all(torch.equal(after[name], before[name]) for name in before)

    def test_stop_tokens_end_a_sequence_at_their_first_occurrence(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        free = tokens(run(backend, greedy_requests(prompts[:1])))["0"]
        stop = free[5]
        stopped = run(backend, greedy_requests(prompts[:1], stop_token_ids=(stop,)))["0"]
        assert [step.token_id for step in stopped] == free[: free.index(stop) + 1]
        assert stopped[-1].finish_reason == "stop"

    def test_the_engine_scheduler_streams_the_backends_tokens(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        request = greedy_requests(prompts[1:2])[0]
        expected = tokens(run(backend, [request]))[request.request_id]
        scheduler = engine_module.Engine(backend, max_batch_size=8)

        async def collect() -> list[int]:
            return [step.token_id async for step in scheduler.submit(request)]

        try:
            assert asyncio.run(collect()) == expected
        finally:
            scheduler.close()

    def test_sequences_join_a_running_batch(self, backend: megatron.MegatronBackend, prompts: list[list[int]]) -> None:
        """Continuous batching: three requests submitted after the first one's first token join its
        batch between two steps, and each produces its solo greedy tokens (up to a bf16 near-tie,
        since the batch they run in differs)."""
        solo = [run(backend, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]

        produced, scheduler = staggered(backend, greedy_requests(prompts))

        assert (scheduler.batches, scheduler.admitted, scheduler.batch_sizes) == (1, 3, [4])
        agreed = [agreed_prefix(reference, row) for reference, row in zip(solo, produced, strict=True)]
        gpu.report("join_tp1", agreed=agreed, of=gpu.NEW_TOKENS)
        assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed

    def test_a_cancelled_sequence_leaves_megatrons_batch(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """A client that leaves after 2 tokens: its megatron request ends at once (megatron's own
        early-finish path) while the other sequence of the batch runs to its end."""
        finished: dict[int, int] = {}
        original = backend._batch.step

        def recording() -> dict[str, Any]:
            result = original()
            for record in result["finished_request_records"]:
                merged = record.merge()
                finished[len(merged.prompt_tokens)] = len(merged.generated_tokens)
            return result

        params = base.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        long = base.SequenceRequest("long", tuple(prompts[1]), params)
        short = dataclasses.replace(greedy_requests(prompts[2:3])[0], request_id="short")
        scheduler = engine_module.Engine(backend, max_batch_size=8)

        async def scenario() -> list[int]:
            stream = scheduler.submit(long)
            await anext(stream)
            await anext(stream)
            other = asyncio.ensure_future(gather_tokens(scheduler, short))
            await stream.aclose()
            return await other

        backend._batch.step = recording  # type: ignore[method-assign]
        try:
            other = asyncio.run(scenario())
        finally:
            del backend._batch.step
            scheduler.close()
        assert other == tokens(run(backend, greedy_requests(prompts[2:3])))["0"]
        assert not backend.engine.has_unfinished_requests()
        gpu.report("cancel_tp1", generated_by_the_cancelled=finished.get(len(prompts[1])))
        assert finished[len(prompts[1])] < gpu.NEW_TOKENS, finished


def direct_tokens(backend: megatron.MegatronBackend, prompts: list[list[int]]) -> dict[str, list[int]]:
    """megatron-core's ``engine.generate()`` alone, greedy, :data:`gpu.NEW_TOKENS` each."""
    sampling = megatron.megatron_core("inference.sampling_params")
    params = sampling.SamplingParams(top_k=1, num_tokens_to_generate=gpu.NEW_TOKENS, termination_id=-1)
    return {
        str(index): list(record.merge().generated_tokens)
        for index, record in enumerate(backend.engine.generate(prompts, params))
    }


class TestStepPaths:
    """The backend's per-step settings (``set_step_options``) on megatron itself: the sampler
    without host synchronisation, the step arrays, asynchronous scheduling and one decode graph for
    the whole block keep greedy tokens, continuous batching and in-place refits as they were."""

    pytestmark = ON_GPU

    @pytest.mark.parametrize(
        ("sync_free", "arrays", "asynchronous"),
        [(False, False, False), (True, True, False), (True, True, True)],
        ids=["baseline", "fast", "fast-async"],
    )
    def test_settings_keep_greedy_tokens_equal_to_direct(
        self,
        backend: megatron.MegatronBackend,
        prompts: list[list[int]],
        sync_free: bool,
        arrays: bool,
        asynchronous: bool,
    ) -> None:
        reference = tokens(run(backend, greedy_requests(prompts)))  # the build's settings
        built = backend.step_options()
        backend.set_step_options(async_schedule=asynchronous, sync_free_sampling=sync_free, array_collect=arrays)
        try:
            produced = run(backend, greedy_requests(prompts))
            direct = direct_tokens(backend, prompts)
            with_logprobs = run(backend, greedy_requests(prompts, logprobs=2))
        finally:
            backend.set_step_options(
                async_schedule=built["async_schedule"],
                sync_free_sampling=built["sync_free_sampling"],
                array_collect=built["array_collect"],
            )
        assert tokens(produced) == direct == reference
        assert tokens(with_logprobs) == reference  # sequences with log-probabilities read their records
        for steps in produced.values():
            assert [step.finish_reason for step in steps] == [None] * (gpu.NEW_TOKENS - 1) + ["length"]
        assert all(
            step.logprob is not None and len(step.top_logprobs) == 2
            for steps in with_logprobs.values()
            for step in steps
        )

    def test_the_greedy_sampler_does_not_synchronise_the_host(self, backend: megatron.MegatronBackend) -> None:
        """CUDA's sync-debug mode raises on any host synchronisation: the fast path passes, the
        old per-bucket path (a blocking index copy) trips it, which shows the check works."""
        sampler = backend.engine.controller._sampling
        context = types.SimpleNamespace(
            total_request_count=3,
            paused_request_count=0,
            active_request_metadata={
                "temperature": torch.ones(3).pin_memory(),
                "top_k": torch.ones(3, dtype=torch.int32).pin_memory(),
                "top_p": torch.zeros(3).pin_memory(),
            },
        )
        logits = torch.randn(8, backend.info.vocab_size, device="cuda")
        output = torch.empty(8, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sampler.sync_free = True
            sampler.sample_kernel(logits, 3, context, no_top_k=False, no_top_p=True, output=output[:3])
            sampler.sync_free = False
            with pytest.raises(RuntimeError, match="synchroniz"):
                sampler.sample_kernel(logits, 3, context, no_top_k=False, no_top_p=True, output=output[:3])
        finally:
            torch.cuda.set_sync_debug_mode("default")
            sampler.sync_free = True
        assert torch.equal(output[:3], logits[:3].argmax(dim=-1))

    def test_layer_and_block_graphs_agree(self, backend: megatron.MegatronBackend, prompts: list[list[int]]) -> None:
        """The module's backend (the defaults: one decode graph for the whole block, megatron's
        asynchronous scheduling) against a second model of the same weights with per-layer graphs
        and the ordinary step order: greedy tokens agree (up to a bf16 near-tie) and equal each
        one's own direct run; on the block model, sequences join a running batch and a persist
        refit (in place, no recapture) changes the tokens, and restoring the weights restores them."""
        options = backend.step_options()
        assert options["async_schedule"] and "block" in options["graph_scope"]
        layer = build(name="tiny-layer", graph_scope="layer", async_schedule=False)
        try:
            assert "layer" in layer.step_options()["graph_scope"] and not layer.step_options()["async_schedule"]
            reference = [run(layer, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]
            assert tokens(run(layer, greedy_requests(prompts))) == direct_tokens(layer, prompts)
        finally:
            layer.close()
        produced = tokens(run(backend, greedy_requests(prompts)))
        assert produced == direct_tokens(backend, prompts)
        agreed = [agreed_prefix(ref, produced[str(i)]) for i, ref in enumerate(reference)]
        gpu.report("block_async_vs_layer", agreed=agreed, of=gpu.NEW_TOKENS)
        assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed

        joined, scheduler = staggered(backend, greedy_requests(prompts))
        assert (scheduler.batches, scheduler.admitted, scheduler.batch_sizes) == (1, 3, [4])
        agreed = [agreed_prefix(ref, row) for ref, row in zip(reference, joined, strict=True)]
        assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed

        assert_a_persist_refit_is_followed(backend, prompts, produced)


class TestPrefillGraphs:
    """``MEGAFLEET_PREFILL_GRAPHS`` (docs/operations.md#decode-settings-of-the-megatron-backend), as
    a pod reads it from ``spec.engine.env``: megatron's CUDA graphs for prefill and mixed steps keep
    the greedy tokens of a model with decode graphs only."""

    pytestmark = ON_GPU

    def test_the_setting_adds_prefill_graphs_and_keeps_greedy_tokens(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """Read by the engine's settings and built by the CLI's loader, the setting makes megatron
        capture graphs for steps with prefills (the module's model, built without it, has decode
        graphs only). With the same weights, the greedy tokens equal the module's model's up to
        bf16 near-ties: each prompt alone (its prefill one graph replay), all four at once and
        joining a running batch (mixed steps); and they equal the model's own direct run."""
        read = settings.from_env(
            {
                env.MODEL_SOURCE: gpu.SOURCE,
                env.BACKEND: "megatron",
                env.DTYPE: "bfloat16",
                env.MAX_SEQUENCE_LENGTH: str(gpu.MAX_SEQUENCE_LENGTH),
                env.MAX_BATCH_SIZE: "8",
                env.KV_CACHE_GIB: "1",
                env.PREFILL_GRAPHS: "true",
            }
        )
        loaded = cli._load_backend(read, 0, 0, device="cuda", deferred=False)
        assert isinstance(loaded, megatron.MegatronBackend)
        try:
            loaded.write_weights(gpu.scaled_reference_weights())

            def prefill_graphs(model: megatron.MegatronBackend) -> list[Any]:
                dimensions = model.engine.context.cuda_graph_batch_dimensions_list
                return [dims for dims in dimensions if dims.prefill_req_count > 0]

            assert loaded.engine.context.use_cuda_graphs_for_non_decode_steps
            captured = len(prefill_graphs(loaded))
            assert captured and not prefill_graphs(backend)
            reference = [run(backend, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]
            single = [tokens(run(loaded, greedy_requests([prompt])))["0"] for prompt in prompts]
            batched = tokens(run(loaded, greedy_requests(prompts)))
            joined, _ = staggered(loaded, greedy_requests(prompts))
            assert batched == direct_tokens(loaded, prompts)
        finally:
            loaded.close()
        agreed = {
            path: [agreed_prefix(ref, row) for ref, row in zip(reference, rows, strict=True)]
            for path, rows in (("single", single), ("batched", list(batched.values())), ("joined", joined))
        }
        gpu.report("prefill_graphs_vs_decode_only", agreed=agreed, of=gpu.NEW_TOKENS, prefill_graphs=captured)
        for path, counts in agreed.items():
            assert sum(counts) >= 0.75 * gpu.NEW_TOKENS * len(prompts), (path, counts)


class TestFusedKernels:
    """The fused Triton kernels (``backends/megatron/fused.py``) on the GPU: each equals the
    unfused PyTorch ops megatron's ``local`` layer runs (RoPE and SwiGLU bitwise, RMSNorm within a
    bf16 step), and a model built with them decodes megatron's greedy tokens (the unfused model's,
    bitwise, with ``rope-swiglu``, the default: the module's backend has them), takes joining
    sequences and follows a persist refit in place (the decode graphs are not recaptured: they read
    the weights the refit writes; ``TestRefitKvModes`` recaptures them in the other modes)."""

    pytestmark = ON_GPU

    def test_the_kernels_equal_megatrons_unfused_ops(self) -> None:
        for heads in (2, 8, 32):
            rows, freqs, positions = fused_reference.rope_inputs(heads, rows=9, dim=128, device="cuda")
            freqs = freqs * 7.9  # angles up to ~500 rad, as at the end of a 512-token sequence
            expected = fused_reference.rope_reference(rows.clone(), freqs, positions, 1.0)
            assert fused.rope_(rows, freqs, positions) is rows
            assert torch.equal(rows, expected), heads
        generator = torch.Generator(device="cuda").manual_seed(3)
        wide = (torch.randn(5, 1, 2 * 14336, device="cuda", generator=generator) * 4).to(torch.bfloat16)
        assert torch.equal(fused.swiglu(wide), fused_reference.swiglu_reference(wide))
        for width, count, scale in ((4096, 2048, 3.0), (4096, 64, 300.0), (256, 512, 1.0), (4100, 32, 3.0)):
            hidden = (torch.randn(count, 1, width, device="cuda", generator=generator) * scale).to(torch.bfloat16)
            residual = (torch.randn(count, 1, width, device="cuda", generator=generator) * scale).to(torch.bfloat16)
            norm = torch.nn.RMSNorm(width, eps=1e-5, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5, generator=generator)
                expected = norm(hidden)
                produced = fused.FusedRMSNorm(norm)(hidden)
                assert torch.equal(produced, expected), (width, count, int((produced != expected).sum()))
                with_residual = fused.rms_norm(hidden, norm.weight, 1e-5, residual=residual)
                assert isinstance(with_residual, tuple)
                assert torch.equal(with_residual[1], hidden + residual)
                assert torch.equal(with_residual[0], norm(hidden + residual)), width
        self.the_qkv_fold_equals_megatrons_four_ops()

    def test_the_decode_attention_agrees_with_flash_attention_4(self) -> None:
        """:func:`fused.decode_attention` against FA4 as megatron calls it in a decode step (varlen,
        one query token per request, paged KV with megatron's block size), within bf16 rounding."""
        from flash_attn.cute import flash_attn_varlen_func  # type: ignore[import-not-found]

        generator = torch.Generator(device="cuda").manual_seed(5)
        heads, kv_heads, dim, block_size, blocks = 32, 8, 128, 256, 24
        lengths = torch.tensor([1, 129, 384, 300, 17, 256, 257, 200], dtype=torch.int32, device="cuda")
        caches = [
            (torch.randn(blocks, block_size, kv_heads, dim, device="cuda", generator=generator) * 2).to(torch.bfloat16)
            for _ in range(2)
        ]
        table = torch.randperm(blocks, device="cuda", generator=generator)[:16].view(8, 2).to(torch.int32)
        q = (torch.randn(8, 1, heads, dim, device="cuda", generator=generator) * 2).to(torch.bfloat16)
        cu_q = torch.arange(9, dtype=torch.int32, device="cuda")
        expected, _ = flash_attn_varlen_func(
            q.view(8, heads, dim),
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
        for requests in (1, 8):
            produced = fused.decode_attention(
                q[:requests], caches[0], caches[1], table[:requests], lengths[:requests], dim**-0.5
            )
            torch.testing.assert_close(produced.view(requests, heads, dim), expected[:requests], rtol=2**-7, atol=2**-7)
            gpu.report(
                "decode_attention_vs_fa4",
                requests=requests,
                max_abs=float((produced.view(requests, heads, dim).float() - expected[:requests].float()).abs().max()),
            )

    @staticmethod
    def the_qkv_fold_equals_megatrons_four_ops() -> None:
        """The query's reshape copy, RoPE on q and on k and the KV append (megatron's ops, written
        out) against :func:`fused.qkv_rope_append`, bitwise, on the 8B model's head shape."""
        groups, per_group, dim, rows, n = 8, 4, 128, 6, 5
        generator = torch.Generator(device="cuda").manual_seed(4)
        mixed = (torch.randn(rows, 1, groups * (per_group + 2) * dim, device="cuda", generator=generator) * 4).to(
            torch.bfloat16
        )
        grouped = mixed.view(rows, 1, groups, (per_group + 2) * dim)
        source, key, value = torch.split(grouped, [per_group * dim, dim, dim], dim=3)
        _, freqs, _ = fused_reference.rope_inputs(1, dim=dim, device="cuda")
        freqs = (freqs * 7.9).contiguous()
        q_positions = torch.randint(0, 64, (n,), device="cuda", generator=generator)
        k_positions = torch.randint(0, 64, (n,), device="cuda", generator=generator)
        blocks = torch.randperm(16, device="cuda", generator=generator)[:n].to(torch.int32)
        slots = torch.randint(0, 8, (n,), device="cuda", generator=generator)
        expected_q = source.reshape(rows, 1, groups * per_group, dim)  # megatron's copy
        expected_q[:n] = fused_reference.rope_reference(expected_q[:n], freqs, q_positions, 1.0)
        expected_cache = torch.zeros(2, 16, 8, groups, dim, device="cuda", dtype=torch.bfloat16)
        rotated_k = fused_reference.rope_reference(key[:n], freqs, k_positions, 1.0)
        expected_cache[0, blocks.long(), slots] = rotated_k.squeeze(1)
        expected_cache[1, blocks.long(), slots] = value[:n].squeeze(1)
        query = torch.empty(rows, 1, groups * per_group, dim, device="cuda", dtype=torch.bfloat16)
        cache = torch.zeros_like(expected_cache)
        fused.qkv_rope_append(
            (query, source), (key, value, cache[0], cache[1], blocks, slots), freqs, q_positions, k_positions, n
        )
        assert torch.equal(query, expected_q)
        assert torch.equal(cache, expected_cache)

    @pytest.fixture(scope="class")
    def unfused_backend(self) -> Iterator[megatron.MegatronBackend]:
        """The module's model without the fused kernels (megatron's own ops), same weights."""
        loaded = build(name="tiny-unfused", fused_kernels="off")
        yield loaded
        loaded.close()

    def test_rope_swiglu_decodes_the_unfused_models_tokens_and_follows_refits(
        self,
        backend: megatron.MegatronBackend,
        unfused_backend: megatron.MegatronBackend,
        prompts: list[list[int]],
    ) -> None:
        """The module's backend has the default fused kernels (``rope-swiglu``)."""
        layers = backend.shape.layers
        assert backend.step_options()["fused_kernels"] == {
            "rope": 1,
            "swiglu": layers,
            "rms_norm": 2 * layers + 1,
            "qkv": layers,
            "residual_add": 2 * layers - 1,  # block graphs: every add but the last layer's MLP one
            "attention": 0,  # only with "all"
            "gemv": 0,  # only with "gemv" and "all"
        }
        assert unfused_backend.step_options()["fused_kernels"] == {}
        unfused = tokens(run(unfused_backend, greedy_requests(prompts)))  # same weights, graphs and step settings
        produced = tokens(run(backend, greedy_requests(prompts)))
        assert produced == unfused == direct_tokens(backend, prompts)
        with_logprobs = run(backend, greedy_requests(prompts, logprobs=2))
        reference = run(unfused_backend, greedy_requests(prompts, logprobs=2))
        for key, steps in with_logprobs.items():
            assert [step.token_id for step in steps] == unfused[key]
            assert [step.logprob for step in steps] == [step.logprob for step in reference[key]]

        joined, scheduler = staggered(backend, greedy_requests(prompts))
        assert (scheduler.batches, scheduler.admitted, scheduler.batch_sizes) == (1, 3, [4])
        agreed = [agreed_prefix(reference[str(i)], row) for i, row in enumerate(joined)]  # other batch sizes
        assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed

        assert_a_persist_refit_is_followed(backend, prompts, produced)

    def test_each_step_of_the_fusions_decodes_the_unfused_models_tokens(
        self, unfused_backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """The benchmark's intermediate steps (RoPE and SwiGLU only; with the RMSNorms; with the qkv
        fold) are bitwise too: the same greedy tokens and log-probabilities as the unfused model."""
        reference = run(unfused_backend, greedy_requests(prompts, logprobs=2))
        all_norms = 2 * unfused_backend.shape.layers + 1
        for choice, norms in (
            ("rope-swiglu-only", 0),
            ("rope-swiglu-norm", all_norms),
            ("rope-swiglu-norm-qkv", all_norms),
        ):
            loaded = build(name=f"tiny-{choice}", fused_kernels=choice)
            try:
                assert loaded.step_options()["fused_kernels"]["rms_norm"] == norms
                produced = run(loaded, greedy_requests(prompts, logprobs=2))
            finally:
                loaded.close()
            for key, steps in produced.items():
                assert [(step.token_id, step.logprob) for step in steps] == [
                    (step.token_id, step.logprob) for step in reference[key]
                ], choice

    def test_the_gemv_equals_the_product_within_rounding_and_its_launches_agree(self) -> None:
        """:func:`fused.gemv` on the 8B model's decode shapes at one row against cuBLAS (within a
        bf16 rounding of the float64 product, as cuBLAS is); ``gated`` is bitwise the SwiGLU of the
        plain GEMV; in a CUDA graph with programmatic dependent launches the results are bitwise
        those of ordinary launches."""
        generator = torch.Generator(device="cuda").manual_seed(6)
        hidden = 4096
        for n, k in ((6144, hidden), (hidden, hidden), (2 * 14336, hidden), (hidden, 14336), (128256, hidden)):
            weight = (torch.randn(n, k, device="cuda", generator=generator) / 64).to(torch.bfloat16)
            x = torch.randn(1, 1, k, device="cuda", generator=generator).to(torch.bfloat16)
            exact = x.double() @ weight.double().T
            produced, cublas = fused.gemv(x, weight), torch.nn.functional.linear(x, weight)
            bound = float((cublas.double() - exact).abs().max()) + float(exact.abs().max()) * 2**-8
            assert float((produced.double() - exact).abs().max()) <= bound, (n, k)
            gpu.report(
                "gemv_vs_float64",
                n=n,
                k=k,
                gemv=float((produced.double() - exact).abs().max()),
                cublas=float((cublas.double() - exact).abs().max()),
            )
            if n == 2 * 14336:  # the same tiles (the sums' order depends on them)
                config = fused.gemv_config(n, k, 1, gated=True)
                gated = fused.gemv(x, weight, gated=True, config=config)
                assert torch.equal(gated, fused.swiglu(fused.gemv(x, weight, config=config)))
        weights = [
            (torch.randn(n, hidden, device="cuda", generator=generator) / 64).to(torch.bfloat16)
            for n in (hidden, 2 * hidden, hidden)
        ]
        norm = torch.rand(hidden, device="cuda", generator=generator).to(torch.bfloat16) + 0.5
        start = torch.randn(1, 1, hidden, device="cuda", generator=generator).to(torch.bfloat16)

        def chain(pdl: bool) -> torch.Tensor:
            normed = fused.rms_norm(start, norm, 1e-5, pdl=pdl)
            assert isinstance(normed, torch.Tensor)
            up = fused.gemv(normed, weights[1], gated=True, pdl=pdl)
            down = fused.gemv(fused.swiglu(fused.gemv(normed, weights[1], pdl=pdl), pdl=pdl), weights[2], pdl=pdl)
            return fused.gemv(up, weights[0], pdl=pdl) + down

        results = []
        for pdl in (False, True):
            chain(pdl)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(pdl)
            graph.replay()
            torch.cuda.synchronize()
            results.append(out.clone())
        assert torch.equal(results[0], results[1])
        assert torch.equal(results[0], chain(False))

    @pytest.mark.parametrize("choice", ["gemv", "all"])
    def test_gemv_agrees_with_the_unfused_model_and_follows_refits(
        self, unfused_backend: megatron.MegatronBackend, prompts: list[list[int]], choice: str
    ) -> None:
        """``gemv``: the linear layers of one-token steps through the Triton GEMV (fc1 with the
        SwiGLU), every fused kernel a programmatic dependent launch (``all``: the one-request decode
        attention kernel too). At batch 1 (one token per decode step: the GEMV's and the attention
        kernel's steps) the greedy tokens agree with the unfused model's up to bf16 near-ties, the
        log-probabilities within bf16 rounding where they agree, and equal the model's own direct
        run; the batch-1 decode graph follows a persist refit in place."""
        loaded = build(name=f"tiny-{choice}", fused_kernels=choice)
        try:
            layers = loaded.shape.layers
            swapped = loaded.step_options()["fused_kernels"]
            assert swapped["gemv"] == 4 * layers + 1  # qkv, proj, fc1, fc2; the output layer
            assert swapped["attention"] == (layers if choice == "all" else 0)
            single = [run(loaded, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]
            produced = [[step.token_id for step in steps] for steps in single]
            reference = [run(unfused_backend, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]
            agreed = [agreed_prefix(ref, row) for ref, row in zip(reference, produced, strict=True)]
            gap = max(
                abs(float(ours.logprob or 0.0) - float(theirs.logprob or 0.0))
                for ref, steps, count in zip(reference, single, agreed, strict=True)
                for ours, theirs in zip(steps[:count], ref[:count], strict=True)
            )
            gpu.report(f"{choice}_vs_unfused", agreed=agreed, of=gpu.NEW_TOKENS, max_logprob_gap=gap)
            assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed
            assert gap < TIE, gap
            assert [direct_tokens(loaded, [prompt])["0"] for prompt in prompts] == produced

            def batch_one() -> list[list[int]]:
                return [tokens(run(loaded, greedy_requests([prompt])))["0"] for prompt in prompts]

            loaded.begin_weight_update("persist")
            loaded.write_weights(gpu.scaled_reference_weights(seed=1))
            loaded.finish_weight_update("persist")
            changed = batch_one()
            loaded.begin_weight_update("persist")
            loaded.write_weights(gpu.scaled_reference_weights())
            loaded.finish_weight_update("persist")
            assert sum(row != before for row, before in zip(changed, produced, strict=True)) >= 3
            assert batch_one() == produced
        finally:
            loaded.close()

    def test_all_kernels_agree_with_the_unfused_model(
        self, unfused_backend: megatron.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """With the decode attention too (``all``), the tokens agree with the unfused model's up to a
        bf16 near-tie (another summation order than FlashAttention's) and equal the model's own
        direct run; the decode graphs follow a persist refit in place."""
        loaded = build(name="tiny-fused-all", fused_kernels="all")
        try:
            layers = loaded.shape.layers
            assert loaded.step_options()["fused_kernels"]["attention"] == layers
            produced = tokens(run(loaded, greedy_requests(prompts)))
            assert produced == direct_tokens(loaded, prompts)
            reference = [run(unfused_backend, greedy_requests([prompt], logprobs=2))["0"] for prompt in prompts]
            agreed = [agreed_prefix(ref, produced[str(i)]) for i, ref in enumerate(reference)]
            gpu.report("fused_all_vs_unfused", agreed=agreed, of=gpu.NEW_TOKENS)
            assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed
            assert_a_persist_refit_is_followed(loaded, prompts, produced)
        finally:
            loaded.close()


class TestTensorParallel:
    """A TP=2 shard (two processes, NCCL) of the same model and weights: greedy tokens equal TP=1's
    up to bf16 near-ties (a TP=2 all-reduce sums in another order), log-probabilities agree within
    0.1, continuous batching works across the ranks, and a refit suspend/resume reaches both."""

    pytestmark = [
        *ON_GPU,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    ]

    def test_tp2_shard_matches_tp1(
        self, backend: megatron.MegatronBackend, prompts: list[list[int]], tmp_path: Path
    ) -> None:
        reference = run(backend, greedy_requests(prompts, logprobs=2))
        out = tmp_path / "tp2.json"
        engine_dir = Path(base.__file__).resolve().parents[2]
        env = {**os.environ, **gpu.NCCL_SAFE}
        protocol_dir = Path(vocabulary.__file__).resolve().parents[1]
        tests_dir = Path(__file__).resolve().parents[1]  # the worker imports helpers.gpu
        env["PYTHONPATH"] = os.pathsep.join(
            [str(engine_dir), str(protocol_dir), str(tests_dir), env.get("PYTHONPATH", "")]
        )
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        log = tmp_path / "tp2.log"
        with log.open("w") as output:
            try:
                code = subprocess.run(
                    [*command, __file__, str(out)], env=env, stdout=output, stderr=subprocess.STDOUT, timeout=115
                ).returncode
            except subprocess.TimeoutExpired:
                code = None
        report_log = os.environ.get("MEGAFLEET_GPU_REPORT")
        if report_log:  # keep the workers' output next to the gpu.report
            Path(report_log).with_name("tp2-workers.log").write_text(log.read_text())
        assert out.exists(), f"TP=2 workers: exit {code}, no result\n{log.read_text()[-8000:]}"
        shard = json.loads(out.read_text())
        gpu.report("tp2_workers", exit_code=code)
        if report_log:
            Path(report_log).with_name("tp2-result.json").write_text(out.read_text())
        assert "error" not in shard, shard["error"]

        direct = {
            key: [base.TokenStep(key, token, logprob, tuple(map(tuple, top))) for token, logprob, top in rows]
            for key, rows in shard["direct"].items()
        }
        agreed = [agreed_prefix(reference[key], [step.token_id for step in direct[key]]) for key in reference]
        gaps = [
            abs((step.logprob or 0.0) - (ref.logprob or 0.0))
            for key, count in zip(reference, agreed, strict=True)
            for step, ref in zip(direct[key][:count], reference[key][:count], strict=True)
        ]
        joined_agreed = [agreed_prefix(direct[str(index)], row) for index, row in enumerate(shard["joined"])]
        gpu.report(
            "tp2",
            agreed_with_tp1=agreed,
            of=gpu.NEW_TOKENS,
            max_logprob_gap=max(gaps),
            joined_agreed_with_tp2=joined_agreed,
            joined_batches=shard["batches"],
        )
        assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), agreed
        assert max(gaps) < 0.1, max(gaps)
        assert (shard["batches"], shard["admitted"]) == (1, 3)
        assert sum(joined_agreed) >= 0.75 * gpu.NEW_TOKENS * len(prompts), joined_agreed
        assert shard["after_refit"] == {key: [step.token_id for step in steps] for key, steps in direct.items()}


class TestRefitKvModes:
    """A refit through the scheduler (suspend drain, weight write, resume) in each KV-cache mode:
    afterwards the engine serves exactly what a fresh engine built with the new weights serves,
    and the KV cache and CUDA graphs were kept (persist) or freed during the refit and rebuilt
    (offload: megatron's OFFLOAD when built for it, else its RECOMPUTE freeing; recompute). Megatron's
    prefix caching is off, so no KV block can outlive its request in any mode."""

    pytestmark = ON_GPU

    @pytest.fixture(scope="class")
    def fresh(self, prompts: list[list[int]]) -> dict[str, list[int]]:
        fresh = build()
        try:
            fresh.write_weights(gpu.scaled_reference_weights(seed=1))
            scheduler = engine_module.Engine(fresh, max_batch_size=8)
            try:
                return asyncio.run(together(scheduler, greedy_requests(prompts)))
            finally:
                scheduler.close()
        finally:
            fresh.close()

    @pytest.mark.parametrize(
        ("mode", "built"),
        [
            ("persist", "persist"),
            ("offload", "offload"),
            ("recompute", "recompute"),
            ("offload", "persist"),
            ("recompute", "persist"),
        ],
        ids=["persist", "offload", "recompute", "offload-on-persist-build", "recompute-on-persist-build"],
    )
    def test_a_refit_serves_what_a_fresh_engine_serves(
        self,
        mode: vocabulary.KvCacheMode,
        built: vocabulary.KvCacheMode,
        prompts: list[list[int]],
        fresh: dict[str, list[int]],
    ) -> None:
        backend = build(built)
        context = backend.engine.context
        assert context.enable_prefix_caching  # the default: a refit must invalidate what the old weights cached
        scheduler = engine_module.Engine(backend, max_batch_size=8, kv_cache_mode=mode)
        requests = greedy_requests(prompts)
        kv_bytes = context.memory_buffer.numel() * context.memory_buffer.element_size()
        seen: dict[str, Any] = {}

        def write() -> None:
            torch.cuda.synchronize()
            seen["allocated_during"] = torch.cuda.memory_allocated()
            seen["suspended_during"] = backend.suspended
            backend.write_weights(gpu.scaled_reference_weights(seed=1))

        async def scenario() -> tuple[dict[str, list[int]], dict[str, list[int]]]:
            before = await together(scheduler, requests)
            seen["graphs"] = backend.engine.capture_stats
            seen["pointer"] = context.memory_buffer.data_ptr()
            torch.cuda.synchronize()
            seen["allocated_before"] = torch.cuda.memory_allocated()
            await scheduler.suspend("drain")
            await scheduler.run_exclusive(write)
            scheduler.resume(weight_version=1)
            after = await together(scheduler, requests)
            torch.cuda.synchronize()
            seen["allocated_after"] = torch.cuda.memory_allocated()
            return before, after

        try:
            before, after = asyncio.run(scenario())
        finally:
            scheduler.close()
            backend.close()
        freed = seen["allocated_before"] - seen["allocated_during"]
        recaptured = backend.engine.capture_stats is not seen["graphs"]
        gpu.report(
            f"refit_{mode}_built_{built}",
            kv_bytes=kv_bytes,
            freed_during_refit=freed,
            allocated_before=seen["allocated_before"],
            allocated_after=seen["allocated_after"],
            graphs_recaptured=recaptured,
            same_kv_pointer=context.memory_buffer.data_ptr() == seen["pointer"],
            equal_fresh=after == fresh,
        )
        assert seen["suspended_during"] and not backend.suspended
        assert after == fresh
        assert before != after
        if mode == "persist":
            assert not recaptured and context.memory_buffer.data_ptr() == seen["pointer"]
            assert abs(freed) < 0.1 * kv_bytes
        else:
            assert recaptured
            assert freed >= 0.9 * kv_bytes, (freed, kv_bytes)


def _tp_worker(out: Path) -> None:
    """One rank of the TP=2 shard of :class:`TestTensorParallel` (started by torchrun)."""
    for key, value in gpu.NCCL_SAFE.items():
        os.environ.setdefault(key, value)
    rank, world, local = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    faulthandler.dump_traceback_later(95, exit=True)  # a hang prints every thread's stack and ends
    torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
    parallel = base.Parallel(tensor_parallel=world, rank=rank, world_size=world, local_rank=local)
    shard = build(parallel=parallel)
    sys.stderr.write(f"rank {rank}: built\n")
    if rank != 0:
        shard.serve_followers()
    else:
        result: dict[str, Any] = {}
        try:
            prompts = [shard.tokenizer.encode(text) for text in gpu.TEXTS]
            direct = run(shard, greedy_requests(prompts, logprobs=2))
            sys.stderr.write("rank 0: direct run done\n")
            result["direct"] = {
                key: [[step.token_id, step.logprob, list(step.top_logprobs)] for step in steps]
                for key, steps in direct.items()
            }
            joined, scheduler = staggered(shard, greedy_requests(prompts))
            result.update(joined=joined, batches=scheduler.batches, admitted=scheduler.admitted)
            sys.stderr.write("rank 0: staggered run done\n")
            shard.begin_weight_update("persist")
            shard.finish_weight_update("persist")
            result["after_refit"] = tokens(run(shard, greedy_requests(prompts)))
        except Exception:
            result["error"] = traceback.format_exc()
        out.write_text(json.dumps(result))
        shard.close()
    sys.stderr.write(f"rank {rank}: finished\n")
    sys.stderr.flush()
    # No destroy_process_group(): on the H200 x2 machine (torch 2.11) it hung at teardown after all
    # the work was done (2026-11-30), so the workers leave without it.
    os._exit(0)


if __name__ == "__main__":
    _tp_worker(Path(sys.argv[1]))
