"""How both backends turn a row of logits into a token and the log-probabilities they report.

Called per sequence by the ``transformers`` backend (:mod:`.transformers_backend`) and per bucket
of rows by the megatron backend's sampler (:mod:`.megatron.nemo_sampler`), so the two filter, sample
and report alike.

The filter is NeMo RL's trainer's (``TrainingSamplingParams``), in its order: divide by the
temperature, then top-k (every token tied with the k-th largest value is kept), then top-p over the
softmax of the temperature-scaled, top-k-masked logits, with an *ascending* cumulative sum: a token
is kept when the cumulative probability up to and including it exceeds ``1 - top_p``, and the
largest is always kept. Filtered-out tokens become ``-inf``. ``top_k <= 0`` (or ``>=`` the
vocabulary) and ``top_p >= 1`` switch a cut off.

Invariants: tokens are drawn from ``softmax(filter_logits(...))``, so a sampled token always has
a finite processed log-probability; processed log-probabilities are ``log_softmax`` of exactly
that filtered row, in float32 (NeMo's ``processed_logprobs``, and vLLM's with
``logprobs_mode="processed_logprobs"``); greedy decoding (temperature 0 or ``top_k == 1``) picks the
argmax and reports raw log-probabilities, as vLLM does for greedy requests.
"""

from __future__ import annotations

import torch

from megafleet_engine.backends import base

__all__ = ["filter_logits", "greedy", "logprobs", "processed_logprobs", "raw_logprobs", "sample"]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest temperature that divides as itself (any larger one would round to inf)."""


def greedy(*, temperature: float, top_k: int) -> bool:
    """Whether these parameters decode greedily (same rule as :attr:`base.SamplingParams.greedy`)."""
    return temperature <= 0.0 or top_k == 1


def filter_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """NeMo's temperature, top-k and top-p filter over the last dimension, in float32.

    Returns a new tensor (``logits`` is not modified): the scaled logits, ``-inf`` where filtered
    out. ``temperature`` must be positive (greedy callers never filter)."""
    if temperature <= 0.0:
        raise ValueError(f"filter_logits needs a positive temperature, not {temperature}")
    # Beyond float32's range the divisor would round to inf, and a -inf logit over inf is NaN,
    # which no sampler draws from; the largest float32 flattens the row just the same.
    temperature = min(temperature, FLOAT32_MAX)
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float().clone()
    vocab = scaled.shape[-1]
    top_k_on = 0 < top_k < vocab
    if top_p >= 1.0:
        if top_k_on:
            threshold = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
            scaled.masked_fill_(scaled < threshold, float("-inf"))
        return scaled
    ordered, order = torch.sort(scaled, dim=-1, descending=False)
    if top_k_on:
        threshold = ordered[..., vocab - top_k : vocab - top_k + 1]
        ordered.masked_fill_(ordered < threshold, float("-inf"))
    cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
    keep = cumulative > 1 - top_p
    keep[..., -1] = True
    ordered.masked_fill_(~keep, float("-inf"))
    return torch.empty_like(ordered).scatter_(-1, order, ordered)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of the model's own logits, in float32 (OpenAI's meaning of logprobs)."""
    return torch.log_softmax(logits.float(), dim=-1)


def processed_logprobs(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are drawn from (raw ones when greedy)."""
    if greedy(temperature=temperature, top_k=top_k):
        return raw_logprobs(logits)
    return torch.log_softmax(filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p), dim=-1)


def logprobs(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, mode: base.LogprobsMode
) -> torch.Tensor:
    """The log-probabilities a sequence asked for: ``processed`` or ``raw``."""
    if mode == "raw":
        return raw_logprobs(logits)
    return processed_logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p)


def sample(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``logits`` (``[rows, vocab]``): the argmax when greedy, else a draw
    from ``softmax(filter_logits(...))`` with ``generator``. Returns ``[rows]`` int64 ids."""
    if greedy(temperature=temperature, top_k=top_k):
        return torch.argmax(logits, dim=-1)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator).view(-1)
