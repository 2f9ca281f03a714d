"""What a fleet refitted by a NeMo-style trainer must serve, for the end-to-end tests of NeMo's wires
(it holds no tests): a batch of prompts in NeMo's shape, and the greedy tokens and logprobs of a local
transformers copy holding step ``s``'s tensors (:func:`helpers.nemo_trainer.step_source`), against
which :func:`check_serves` holds the adapter's ``generate``.
"""

from __future__ import annotations

import torch

from helpers import nemo_trainer
from megafleet.sdk import nemo
from megafleet_engine.models import tiny

MAX_TOKENS = 8
PROMPTS = [[1, 50], [1, 60, 61], [1, 41, 43, 42, 44], [1, 70, 71, 72]]


def batch() -> dict[str, torch.Tensor]:
    """:data:`PROMPTS` right-padded, as NeMo's ``BatchedDataDict``."""
    width = max(len(prompt) for prompt in PROMPTS)
    return {
        "input_ids": torch.tensor([prompt + [0] * (width - len(prompt)) for prompt in PROMPTS]),
        "input_lengths": torch.tensor([len(prompt) for prompt in PROMPTS]),
    }


def expected(step: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs from a local transformers copy holding step ``step``'s tensors."""
    model, _ = tiny.build_tiny(nemo_trainer.step_source(step))
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        inputs = torch.tensor([prompt])
        with torch.inference_mode():
            output = model.generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=MAX_TOKENS
            )
            generated = output[0, len(prompt) :]
            logits = model(output[:, :-1]).logits[0, len(prompt) - 1 :]
        tokens.append([int(token) for token in generated])
        chosen = torch.log_softmax(logits.float(), dim=-1).gather(1, generated.unsqueeze(1)).squeeze(1)
        logprobs.append([float(value) for value in chosen])
    return tokens, logprobs


def check_serves(generation: nemo.MegafleetGeneration, step: int, version: int) -> None:
    """Every prompt's greedy tokens and logprobs are step ``step``'s, stamped with ``version``."""
    out = generation.generate(batch(), greedy=True)
    tokens, logprobs = expected(step)
    assert out["weight_versions"].tolist() == [version] * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        length = int(out["generation_lengths"][i])
        assert out["output_ids"][i, len(prompt) : len(prompt) + length].tolist() == tokens[i], (step, i)
        served = out["logprobs"][i, len(prompt) : len(prompt) + length]
        assert torch.allclose(served, torch.tensor(logprobs[i]), atol=1e-4), (step, i, served, logprobs[i])
