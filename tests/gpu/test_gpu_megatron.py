"""The megatron backend: source parsing and sampling maps (anywhere), generation and in-place weight
writes on megatron-core's dynamic engine (one NVIDIA GPU with megatron-core and flash-attention).

The GPU tests skip cleanly here (no GPU, no megatron-core: it needs Python >= 3.12). On the GPU
machine they build one tiny Llama (bf16, decode CUDA graphs on) whose attention and output
weights are scaled up, so attention is peaked and wrong head layouts would show in the outputs.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base, megatron_backend, weight_maps
from megafleet_engine.models import tiny

SOURCE = "tiny://llama?hidden=256&heads=4&kv_heads=2&intermediate=512"  # head_dim 64, a common kernel shape
MAX_SEQUENCE_LENGTH = 256
NEW_TOKENS = 24


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "needs megatron-core (>= 0.19, Python >= 3.12), which is not installed"
    if not any(importlib.util.find_spec(name) for name in ("flash_attn", "flash_attn_3", "flashattn_hopper")):
        return "needs a flash-attention kernel (FA2 >= 2.7.3, FA3 or FA4) for megatron's dynamic engine"
    return None


GPU_SKIP = _gpu_skip_reason()
ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or ""),
    # megatron-core, the cutlass DSL and flash-attention-4 warn (deprecations, optional packages,
    # JIT notes) in ways this project does not control; show those warnings, don't fail on them.
    pytest.mark.filterwarnings("default"),
]


# -- anywhere --------------------------------------------------------------------------------------


def test_random_source_takes_a_preset_and_overrides() -> None:
    parsed = megatron_backend.parse_source("random://llama-8b?layers=2&seed=7")
    assert parsed.kind == "random"
    assert parsed.seed == 7
    assert (parsed.shape.layers, parsed.shape.hidden, parsed.shape.kv_heads, parsed.shape.vocab) == (2, 4096, 8, 128256)
    assert parsed.shape.rope_scaling_factor == 8.0
    smaller = megatron_backend.parse_source("random://llama-8b?hidden=1024&heads=8&kv_heads=2")
    assert smaller.shape.head_dim == 128


def test_tiny_source_has_the_transformers_backend_shape() -> None:
    parsed = megatron_backend.parse_source("tiny://llama?layers=3")
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
        megatron_backend.parse_source(source)


def test_sampling_maps_onto_megatron_parameters() -> None:
    greedy = megatron_backend.to_megatron_sampling(
        base.SamplingParams(max_tokens=100, temperature=0.0, logprobs=2), budget=40, termination_id=2
    )
    assert greedy["top_k"] == 1 and greedy["temperature"] == 1.0 and greedy["top_p"] == 0.0
    assert greedy["num_tokens_to_generate"] == 40
    assert greedy["return_log_probs"] and greedy["top_n_logprobs"] == 2 and greedy["termination_id"] == 2
    nucleus = megatron_backend.to_megatron_sampling(
        base.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, ignore_eos=True), budget=40, termination_id=2
    )
    assert (nucleus["temperature"], nucleus["top_k"], nucleus["top_p"]) == (0.7, 0, 0.9)
    assert nucleus["termination_id"] == -1 and not nucleus["return_log_probs"]
    with pytest.raises(ValueError, match="top_k and top_p"):
        megatron_backend.to_megatron_sampling(
            base.SamplingParams(max_tokens=5, top_k=5, top_p=0.5), budget=10, termination_id=2
        )


@pytest.mark.parametrize(("dtype", "device"), [("float32", "cuda"), ("bfloat16", "cpu")])
def test_load_refuses_what_megatron_cannot_run(dtype: str, device: str) -> None:
    with pytest.raises(ValueError, match="megatron backend"):
        megatron_backend.load(SOURCE, name="t", max_sequence_length=64, dtype=dtype, device=device, load_weights=True)


# -- on the GPU ------------------------------------------------------------------------------------


def scaled_reference_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny model's weights with q/k (peaked attention) and the output layer (peaked logits)
    scaled up, rounded to bf16 as the backend holds them."""
    weights = tiny.reference_weights(f"{SOURCE}&seed={seed}")
    scaled = {}
    for name, tensor in weights.items():
        factor = 4.0 if ("q_proj" in name or "k_proj" in name) else 10.0 if name == "lm_head.weight" else 1.0
        scaled[name] = (tensor * factor).to(torch.bfloat16)
    return scaled


@pytest.fixture(scope="module")
def backend() -> Iterator[megatron_backend.MegatronBackend]:
    loaded = megatron_backend.load(
        SOURCE,
        name="tiny",
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        options=megatron_backend.EngineOptions(max_batch_size=8, kv_buffer_gb=1.0, max_step_tokens=2048),
    )
    loaded.write_weights(scaled_reference_weights())
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def prompts(backend: megatron_backend.MegatronBackend) -> list[list[int]]:
    texts = ["hello", "the quick brown fox jumps over", "a", "RL needs token log-probabilities"]
    return [backend.tokenizer.encode(text) for text in texts]


def greedy_requests(prompts: list[list[int]], **extra: object) -> list[base.SequenceRequest]:
    params = base.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **extra)  # type: ignore[arg-type]
    return [base.SequenceRequest(str(index), tuple(prompt), params) for index, prompt in enumerate(prompts)]


def run(backend: base.Backend, requests: list[base.SequenceRequest]) -> dict[str, list[base.TokenStep]]:
    steps: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in requests}
    for batch in backend.generate(requests):
        for step in batch:
            steps[step.request_id].append(step)
    return steps


def tokens(steps: dict[str, list[base.TokenStep]]) -> dict[str, list[int]]:
    return {request_id: [step.token_id for step in produced] for request_id, produced in steps.items()}


class TestOnGpu:
    """One tiny model (bf16, CUDA graphs), shared by every test of the class."""

    pytestmark = ON_GPU

    def test_live_parameters_hold_exactly_the_mapped_hf_weights(
        self, backend: megatron_backend.MegatronBackend
    ) -> None:
        live = {name: parameter.data for name, parameter in backend.model.named_parameters()}
        back = weight_maps.megatron_to_hf([live], backend.shape)
        expected = scaled_reference_weights()
        assert sorted(back) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(back[name].cpu(), tensor), name
        views = backend.parameters()
        assert set(views) == set(expected)
        assert all(view.is_cuda and view.dtype == torch.bfloat16 for view in views.values())

    def test_greedy_equals_megatron_engine_called_directly(
        self, backend: megatron_backend.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        sampling = megatron_backend._megatron("inference.sampling_params")
        direct = backend.engine.generate(
            prompts, sampling.SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
        )
        expected = {str(index): list(record.merge().generated_tokens) for index, record in enumerate(direct)}

        produced = run(backend, greedy_requests(prompts))

        assert tokens(produced) == expected
        for steps in produced.values():
            assert len(steps) == NEW_TOKENS
            assert [step.finish_reason for step in steps] == [None] * (NEW_TOKENS - 1) + ["length"]

    def test_logprobs_match_the_hf_reference_model(
        self, backend: megatron_backend.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        """Teacher-force megatron's greedy output through the HF model (fp32, the same bf16 weights)."""
        reference, _ = tiny.build_tiny(SOURCE)
        reference.load_state_dict({name: tensor.float() for name, tensor in scaled_reference_weights().items()})
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

    def test_in_place_weight_writes_change_outputs_and_restoring_restores_them(
        self, backend: megatron_backend.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        requests = greedy_requests(prompts)
        before = tokens(run(backend, requests))
        views = backend.parameters()
        saved = {name: view.clone() for name, view in views.items()}
        pointers = {name: parameter.data_ptr() for name, parameter in backend.model.named_parameters()}

        backend.write_weights(scaled_reference_weights(seed=1))
        backend.finish_weight_update("persist")
        changed = tokens(run(backend, requests))

        for name, view in backend.parameters().items():  # restore through the aliasing views
            view.copy_(saved[name])
        backend.finish_weight_update("persist")
        restored = tokens(run(backend, requests))

        assert {name: parameter.data_ptr() for name, parameter in backend.model.named_parameters()} == pointers
        assert sum(changed[key] != before[key] for key in before) >= 3
        assert restored == before

    def test_sliced_writes_equal_whole_writes(self, backend: megatron_backend.MegatronBackend) -> None:
        whole = scaled_reference_weights()
        before = {name: view.clone() for name, view in backend.parameters().items()}
        sliced = []
        for spec in backend.shard_map.values():
            for piece in spec.pieces:
                dim, start, stop = piece.hf_range
                sliced.append((piece.hf_name, whole[piece.hf_name].narrow(dim, start, stop - start).clone()))
        backend.write_weights(sliced, sliced=True)
        after = backend.parameters()
        assert all(torch.equal(after[name], before[name]) for name in before)

    def test_stop_tokens_end_a_sequence_at_their_first_occurrence(
        self, backend: megatron_backend.MegatronBackend, prompts: list[list[int]]
    ) -> None:
        free = tokens(run(backend, greedy_requests(prompts[:1])))["0"]
        stop = free[5]
        stopped = run(backend, greedy_requests(prompts[:1], stop_token_ids=(stop,)))["0"]
        assert [step.token_id for step in stopped] == free[: free.index(stop) + 1]
        assert stopped[-1].finish_reason == "stop"

    def test_the_engine_scheduler_streams_the_backends_tokens(
        self, backend: megatron_backend.MegatronBackend, prompts: list[list[int]]
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
