"""Generation log-probabilities in NeMo RL's convention, on the transformers
backend (CPU, the tiny fp32 model): what the fleet reports for each sampled token equals what NeMo's
trainer recomputes for it (``TrainingSamplingParams``: temperature, then top-k, then top-p, then
``log_softmax``), within 1e-4; the per-request ``raw`` mode gives ``log_softmax`` of the logits;
greedy gives raw log-probabilities. Plus the shared filter on hand-computed rows.

The reference (:func:`helpers.nemo_reference.nemo_processed_logprobs`) is written from NeMo's algorithm,
not imported from the engine, and is applied to a fresh full forward pass of the same weights over prompt and
generated tokens (no KV cache, no padding).
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.nemo_reference import nemo_processed_logprobs
from megafleet_engine.backends import base, load_backend, sampling, transformers_backend

PROMPTS = ["hello", "the quick brown fox jumps over", "a", "RL needs token log-probabilities"]
NEW_TOKENS = 32
TOLERANCE = 1e-4
LOGIT_SCALE = 15.0
"""The tiny model's logits are nearly uniform; scaling its output layer peaks them, so top-p cuts
inside the top-k set (kept sets of 1 to 5 tokens) and the test sees every branch of the filter."""


@pytest.fixture(scope="module")
def backend() -> transformers_backend.TransformersBackend:
    loaded = load_backend("transformers", "tiny://llama", name="tiny", max_sequence_length=256)
    assert isinstance(loaded, transformers_backend.TransformersBackend)
    with torch.no_grad():
        loaded.parameters()["lm_head.weight"].mul_(LOGIT_SCALE)
    return loaded


def generate(
    backend: transformers_backend.TransformersBackend, **params: object
) -> list[tuple[list[int], list[base.TokenStep]]]:
    """Every prompt together in one batch (left-padded, KV cache), seeded; (prompt, steps) each."""
    prompts = [backend.tokenizer.encode(text) for text in PROMPTS]
    requests = [
        base.SequenceRequest(
            str(index),
            tuple(prompt),
            base.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, seed=100 + index, **params),  # type: ignore[arg-type]
        )
        for index, prompt in enumerate(prompts)
    ]
    produced: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in requests}
    for batch in backend.generate(requests):
        for step in batch:
            produced[step.request_id].append(step)
    return [(prompt, produced[str(index)]) for index, prompt in enumerate(prompts)]


def trainer_logits(
    backend: transformers_backend.TransformersBackend, prompt: list[int], steps: list[base.TokenStep]
) -> torch.Tensor:
    """The trainer's view: one forward pass over prompt + generated tokens; row ``i`` predicts
    generated token ``i``."""
    sequence = torch.tensor([prompt + [step.token_id for step in steps]])
    with torch.no_grad():
        logits = backend.model(sequence).logits[0].float()
    rows: torch.Tensor = logits[len(prompt) - 1 : len(prompt) - 1 + len(steps)]
    return rows


SAMPLED = [
    pytest.param(0.7, 5, 0.9, id="T0.7-top_k5-top_p0.9"),
    pytest.param(0.7, 5, 1.0, id="top_k-only"),
    pytest.param(0.7, 0, 0.9, id="top_p-only"),
    pytest.param(0.7, 0, 1.0, id="temperature-only"),
    pytest.param(1.0, 3, 0.8, id="T1-top_k3-top_p0.8"),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLED)
def test_processed_logprobs_equal_the_trainers(
    backend: transformers_backend.TransformersBackend, temperature: float, top_k: int, top_p: float
) -> None:
    kept_sizes = set()
    for prompt, steps in generate(backend, temperature=temperature, top_k=top_k, top_p=top_p, logprobs=5):
        assert len(steps) == NEW_TOKENS
        reference = nemo_processed_logprobs(
            trainer_logits(backend, prompt, steps), temperature=temperature, top_k=top_k, top_p=top_p
        )
        for position, step in enumerate(steps):
            expected = float(reference[position, step.token_id])
            assert step.logprob is not None and math.isfinite(step.logprob), (position, step)
            assert abs(step.logprob - expected) < TOLERANCE, (position, step.logprob, expected)
            # the alternatives come from the same distribution: the reference's five best
            best = torch.topk(reference[position], 5)
            assert [token for token, _ in step.top_logprobs] == best.indices.tolist() or len(
                set(best.values.tolist())
            ) < 5, (position, step.top_logprobs)
            for (_, shown), value in zip(step.top_logprobs, best.values.tolist(), strict=True):
                assert shown == value or abs(shown - value) < TOLERANCE
            kept_sizes.add(int(torch.isfinite(reference[position]).sum()))
    if top_k and top_p < 1.0:  # top-p cut inside the top-k set somewhere, and somewhere kept several
        assert min(kept_sizes) < top_k and max(kept_sizes) > 1, kept_sizes


def test_raw_mode_reports_log_softmax_of_the_logits(backend: transformers_backend.TransformersBackend) -> None:
    for prompt, steps in generate(backend, temperature=0.7, top_k=5, top_p=0.9, logprobs=2, logprobs_mode="raw"):
        reference = torch.log_softmax(trainer_logits(backend, prompt, steps), dim=-1)
        for position, step in enumerate(steps):
            assert step.logprob is not None
            assert abs(step.logprob - float(reference[position, step.token_id])) < TOLERANCE
            assert [token for token, _ in step.top_logprobs] == torch.topk(reference[position], 2).indices.tolist()


def test_raw_and_processed_draw_the_same_tokens(backend: transformers_backend.TransformersBackend) -> None:
    """The mode changes what is reported, never what is sampled."""
    processed = generate(backend, temperature=0.7, top_k=5, top_p=0.9, logprobs=0)
    raw = generate(backend, temperature=0.7, top_k=5, top_p=0.9, logprobs=0, logprobs_mode="raw")
    assert [[s.token_id for s in steps] for _, steps in processed] == [[s.token_id for s in steps] for _, steps in raw]


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"temperature": 0.0}, id="temperature-0"),
        pytest.param({"temperature": 0.7, "top_k": 1, "top_p": 0.9}, id="top_k-1"),
    ],
)
def test_greedy_reports_raw_logprobs(
    backend: transformers_backend.TransformersBackend, params: dict[str, float]
) -> None:
    for prompt, steps in generate(backend, logprobs=1, **params):
        reference = torch.log_softmax(trainer_logits(backend, prompt, steps), dim=-1)
        for position, step in enumerate(steps):
            assert step.token_id == int(torch.argmax(reference[position]))
            assert step.logprob is not None
            assert abs(step.logprob - float(reference[position, step.token_id])) < TOLERANCE


# -- the shared filter on hand-computed rows -------------------------------------------------------

INF = float("inf")
FILTER_CASES = [
    # (logits, temperature, top_k, top_p, kept)
    pytest.param([1.0, 3.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0, [1, 2, 3], id="top_k-keeps-ties-at-the-kth-value"),
    pytest.param([1.0, 3.0, 2.0, 0.0], 1.0, 0, 1.0, [0, 1, 2, 3], id="top_k-0-and-top_p-1-are-off"),
    pytest.param([1.0, 3.0, 2.0, 0.0], 1.0, 4, 1.0, [0, 1, 2, 3], id="top_k-of-the-whole-vocabulary-is-off"),
    pytest.param([1.0, 3.0, 2.0, 2.0, 0.0], 1.0, 2, 0.99, [1, 2, 3], id="top_k-keeps-ties-with-top_p-on"),
    # probabilities 4/7, 2/7, 1/7: a token is kept while the mass above it is below top_p (4/7 = 0.5714)
    pytest.param([math.log(4), math.log(2), 0.0], 1.0, 0, 0.57, [0], id="top_p-just-below-the-mass-above"),
    pytest.param([math.log(4), math.log(2), 0.0], 1.0, 0, 0.575, [0, 1], id="top_p-just-above-the-mass-above"),
    pytest.param([math.log(4), math.log(2), 0.0], 1.0, 0, 0.9, [0, 1, 2], id="top_p-keeps-the-nucleus"),
    pytest.param([5.0, 0.0, 0.0], 1.0, 0, 0.01, [0], id="top_p-always-keeps-the-largest"),
    # top-p runs on the top-k-renormalised distribution: top 2 of [log 3, 0, -1] = 0.75 / 0.25
    pytest.param([math.log(3), 0.0, -1.0], 1.0, 2, 0.7, [0], id="top_p-after-top_k-renormalises"),
    pytest.param([math.log(3), 0.0, -1.0], 1.0, 2, 0.8, [0, 1], id="top_p-after-top_k-keeps-both"),
    # temperature first: at T = 0.5 the probabilities of [log 2, 0] become 0.8 / 0.2
    pytest.param([math.log(2), 0.0], 0.5, 0, 0.75, [0], id="temperature-scales-before-top_p"),
    pytest.param([math.log(2), 0.0], 1.0, 0, 0.75, [0, 1], id="same-row-at-temperature-1"),
]


@pytest.mark.parametrize(("row", "temperature", "top_k", "top_p", "kept"), FILTER_CASES)
def test_filter_logits(row: list[float], temperature: float, top_k: int, top_p: float, kept: list[int]) -> None:
    logits = torch.tensor([row])
    filtered = sampling.filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == kept
    assert torch.equal(filtered[0, kept], logits[0, kept] / temperature)
    assert torch.equal(logits, torch.tensor([row])), "the input is not modified"
    independent = nemo_processed_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.allclose(torch.log_softmax(filtered, dim=-1), independent, atol=1e-6)


def test_sampling_only_draws_kept_tokens() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0, -1.0]] * 2000)
    drawn = sampling.sample(logits, temperature=0.7, top_k=3, top_p=0.6, generator=generator)
    kept = torch.isfinite(sampling.filter_logits(logits[:1], temperature=0.7, top_k=3, top_p=0.6)[0])
    assert set(drawn.tolist()) == set(kept.nonzero().flatten().tolist()) == {0, 1}


def test_greedy_logprobs_are_raw_and_modes_differ_when_sampling() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(sampling.processed_logprobs(logits, temperature=0.0, top_k=0, top_p=0.5), raw)
    assert torch.equal(sampling.logprobs(logits, temperature=0.7, top_k=2, top_p=1.0, mode="raw"), raw)
    processed = sampling.logprobs(logits, temperature=0.7, top_k=2, top_p=1.0, mode="processed")
    assert processed[0, 2] == -INF and abs(float(processed[0, :2].exp().sum()) - 1.0) < 1e-6


# -- the megatron backend's sampler, on a stand-in for megatron's context (no GPU needed) ------------


class FakeContext:
    """What the sampler reads of megatron's ``DynamicInferenceContext``: one paused request first,
    then the active ones, with megatron's per-request metadata (``top_p`` 0.0 = no nucleus cut)."""

    def __init__(self, request_ids: list[int], knobs: list[tuple[float, int, float]]) -> None:
        self.paused_request_count = 1
        self.total_request_count = 1 + len(request_ids)
        self.request_ids = torch.tensor([999, *request_ids], dtype=torch.int32)
        self.active_request_metadata = {
            "temperature": torch.tensor([knob[0] for knob in knobs] + [1.0], dtype=torch.float32),
            "top_k": torch.tensor([knob[1] for knob in knobs] + [0], dtype=torch.int32),
            "top_p": torch.tensor([knob[2] for knob in knobs] + [0.0], dtype=torch.float32),
        }


def test_megatron_sampler_filters_like_nemo_and_honours_raw_requests() -> None:
    from megafleet_engine.backends.megatron import nemo_sampler

    knobs = [(0.7, 5, 0.9), (0.7, 5, 0.9), (1.0, 1, 0.0), (0.7, 0, 0.0), (0.7, 5, 0.9)]
    context = FakeContext([10, 11, 12, 13, 14], knobs)
    sampler = nemo_sampler.NemoSampling(torch.Generator().manual_seed(0), vocab_size=64)
    sampler.raw_request_ids.add(11)
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 4

    produced = sampler.log_probs_kernel(logits, context)
    drawn = sampler.sample_kernel(logits, 5, context, no_top_k=False, no_top_p=False)

    nemo = nemo_processed_logprobs(logits, temperature=0.7, top_k=5, top_p=0.9)
    raw = torch.log_softmax(logits, dim=-1)
    expected = torch.stack([nemo[0], raw[1], raw[2], torch.log_softmax(logits[3] / 0.7, dim=-1), nemo[4]])
    assert torch.allclose(produced, expected, atol=1e-5)
    assert int(drawn[2]) == int(torch.argmax(logits[2])), "top_k 1 is greedy"
    assert all(math.isfinite(float(nemo[row, drawn[row]])) for row in (0, 1, 4)), "drawn from the kept set"


def test_megatron_sampling_takes_top_k_with_top_p() -> None:
    from megafleet_engine.backends import megatron

    mapped = megatron.to_megatron_sampling(
        base.SamplingParams(max_tokens=5, temperature=0.7, top_k=5, top_p=0.9), budget=10, termination_id=2
    )
    assert (mapped["temperature"], mapped["top_k"], mapped["top_p"]) == (0.7, 5, 0.9)
