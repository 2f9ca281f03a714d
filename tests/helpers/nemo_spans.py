"""What a sample whose generated tokens span refits must carry, computed here from the weights of each
version (it holds no tests): per generated token, the logits that sampled it, under the two ways an
engine can keep a sequence through a refit (proposal 0003, section 1).

* ``recompute``: at the switch the whole prefix is run through the new weights, so token ``g`` of a
  span of version ``v`` has the logits of ``v``'s forward pass over prompt + tokens before ``g``: a
  fresh engine's at ``v``.
* ``persist``: the KV computed before the switch stays, so the new weights continue over the old
  KV. Token ``g`` is sampled by the step whose input is token ``g - 1`` (at position ``P + g - 1``
  for a prompt of ``P`` tokens), so the first step of a span that starts at ``g`` runs on version
  ``v`` from position ``P + g - 1`` on, over the cache the earlier versions built: a KV replay.

Then NeMo RL's processed logprobs (:func:`helpers.nemo_reference.nemo_processed_logprobs`; greedy
sampling reports them at temperature 1 without top-k or top-p, the raw ``log_softmax``).
Used by tests/e2e/test_nemo_in_flight.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import transformers

from helpers.nemo_reference import nemo_processed_logprobs

KvMode = Literal["recompute", "persist"]
Model = Callable[..., Any]
"""A Hugging Face causal LM (``model(input_ids=..., cache=..., use_cache=...)``)."""


def runs(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(start, end, version)`` of each run of equal versions, in order (``end`` exclusive)."""
    found: list[tuple[int, int, int]] = []
    for index, version in enumerate(versions):
        if found and found[-1][2] == version:
            found[-1] = (found[-1][0], index + 1, version)
        else:
            found.append((index, index + 1, version))
    return found


def logits(
    models: Mapping[int, Model], prompt: Sequence[int], tokens: Sequence[int], versions: Sequence[int], kv: KvMode
) -> torch.Tensor:
    """``[len(tokens), vocab]``: the logits each generated token was sampled from, each token's
    version given by ``versions`` (see the module docstring for ``kv``)."""
    assert len(tokens) == len(versions) > 0, (len(tokens), len(versions))
    sequence = torch.tensor([list(prompt) + list(tokens)])
    before = len(prompt) - 1  # the position whose logits sample generated token 0
    rows = []
    with torch.inference_mode():
        if kv == "recompute":
            for start, end, version in runs(versions):
                full = models[version](input_ids=sequence[:, : before + end]).logits[0]
                rows.append(full[before + start : before + end])
        else:
            cache = transformers.DynamicCache()
            for index, (start, end, version) in enumerate(runs(versions)):
                first = 0 if index == 0 else before + start  # the input positions this version processes
                output = models[version](input_ids=sequence[:, first : before + end], cache=cache, use_cache=True)
                cache = output.cache
                rows.append(output.logits[0, before + start - first :])
    return torch.cat(rows).float()


def logprobs(
    models: Mapping[int, Model], prompt: Sequence[int], tokens: Sequence[int], versions: Sequence[int], kv: KvMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(processed logprob of each generated token, the largest processed logprob of its row)``:
    a greedy token's two are equal, up to float noise."""
    rows = logits(models, prompt, tokens, versions, kv)
    processed = nemo_processed_logprobs(rows, temperature=1.0, top_k=None, top_p=1.0)
    picked = processed[torch.arange(len(tokens)), torch.tensor(list(tokens))]
    return picked, processed.max(dim=-1).values
