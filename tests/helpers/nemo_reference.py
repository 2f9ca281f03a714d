"""NeMo RL's trainer-side processed log-probabilities, written in the tests from NeMo's algorithm
(``nemo_rl/algorithms/logits_sampling_utils.py``, ``TrainingSamplingParams``), never imported from
the engine, so the engine's logprobs are checked against NeMo's definition, not against themselves.

Used by tests/engine/test_engine_logprobs.py (the backend) and tests/sdk/test_nemo_ray.py (the NeMo
adapter against a real engine process).
"""

from __future__ import annotations

import torch


def nemo_processed_logprobs(
    logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """NeMo RL's trainer-side processed log-probabilities of ``logits`` ``[rows, vocab]``, written
    after its ``TrainingSamplingParams`` path: scale by the temperature unless it is 1; top-k on
    when ``top_k > 0`` (keep values ``>=`` the k-th largest), top-p on when ``top_p != 1`` (sort
    ascending, top-k mask, ``cumsum(softmax) > 1 - top_p`` kept, the largest always kept, scatter
    back); then float32 ``log_softmax``."""
    z = logits.float().clone()
    if temperature != 1.0:
        z.div_(temperature)
    k_on = top_k is not None and top_k > 0
    if top_p == 1.0:
        if k_on:
            assert top_k is not None
            kth = torch.topk(z, top_k, dim=-1).values[..., -1:].expand_as(z)
            z = torch.where(z >= kth, z, torch.tensor(-float("inf"), dtype=z.dtype))
        return torch.log_softmax(z, dim=-1)
    values, index = z.sort(dim=-1, descending=False)
    if k_on:
        assert top_k is not None
        at = torch.full(values.shape[:-1], values.size(-1) - top_k, dtype=torch.long).unsqueeze(-1)
        values.masked_fill_(~(values >= values.gather(-1, at)), -float("inf"))
    mass = torch.cumsum(values.softmax(dim=-1), dim=-1)
    kept = mass > 1 - top_p
    kept[..., -1] = True
    values.masked_fill_(~kept, -float("inf"))
    return torch.log_softmax(values.scatter(dim=-1, index=index, src=values), dim=-1)
