"""Shared harness of the in-flight refit tests (it holds no tests): a tiny CPU backend of its own,
sequences run together through the in-process client (so every token comes with the weight version
that computed it, and spans are the frontend's), and the references their tokens are checked against.

* :func:`fresh_backend`: a tiny Llama of this test's own (the engine harness's backend is shared by
  the whole session, and these tests change its weights);
* :class:`Together`: sequences submitted as one request, so the idle engine runs them as one batch,
  read on the event loop step by step;
* :func:`fresh_greedy` (``recompute``'s reference: a fresh batch of the prefixes at the new version)
  and :func:`kv_replay` (``persist``'s: the prefix's KV built with the old weights, continued with the new).

A module, not a ``conftest.py`` (the root conftest must stay the only one); test modules import it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import transformers

from megafleet_engine import backends, engine
from megafleet_engine.backends import base, transformers_backend
from megafleet_engine.models import tiny
from megafleet_engine.openai import engine_client, version_spans

SOURCE = "tiny://llama"
NEW_SOURCE = "tiny://llama?seed=7"  # the version a refit brings: same shape, other weights
MAX_SEQUENCE_LENGTH = 256
PROMPTS = [
    [12, 40, 41],
    [50, 51, 52, 53, 54, 55, 56],
    [60],
    [70, 71, 72, 73, 74],
    [80, 81],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99],
    [100, 101, 102, 103],
    [110, 111, 112, 113, 114, 115],
]
"""Eight prompts of different lengths (the batch is left-padded)."""


def fresh_backend() -> transformers_backend.TransformersBackend:
    """The tiny Llama (float32, CPU, 256-token context) with the weights of :data:`SOURCE`."""
    backend = backends.load_backend(
        "transformers", SOURCE, name="tiny", max_sequence_length=MAX_SEQUENCE_LENGTH, dtype="float32"
    )
    assert isinstance(backend, transformers_backend.TransformersBackend)
    return backend


def greedy(request_id: str, prompt: Sequence[int], max_tokens: int) -> base.SequenceRequest:
    params = base.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return base.SequenceRequest(request_id, tuple(prompt), params)


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition()`` (engine and batch counters have no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:g} s"
        await asyncio.sleep(0.002)


@dataclasses.dataclass
class Together:
    """Sequences submitted together through the in-process client, read as they arrive."""

    batch: engine_client.Batch
    tokens: list[list[int]]
    reader: asyncio.Task[None]

    @classmethod
    async def start(cls, core: engine.Engine, prompts: Sequence[Sequence[int]], max_tokens: int) -> Together:
        requests = [greedy(f"seq-{index}", prompt, max_tokens) for index, prompt in enumerate(prompts)]
        batch = await engine_client.LocalClient(core).submit(requests)
        tokens: list[list[int]] = [[] for _ in prompts]

        async def read() -> None:
            while (steps := await batch.next()) is not None:
                for index, step in steps:
                    tokens[index].append(step.token_id)

        return cls(batch, tokens, asyncio.ensure_future(read()))

    def counts(self) -> list[int]:
        return [len(tokens) for tokens in self.tokens]

    async def finished(self, timeout: float = 60.0) -> list[list[int]]:
        await asyncio.wait_for(self.reader, timeout)
        return self.tokens

    def spans(self, index: int) -> tuple[version_spans.Span, ...]:
        return self.batch.spans(index)


def fresh_greedy(
    backend: base.Backend, prefixes: Sequence[Sequence[int]], max_tokens: Sequence[int]
) -> list[list[int]]:
    """What a fresh engine produces greedily from ``prefixes`` as one batch, on ``backend``'s
    current weights (the backend driven directly, no engine)."""
    pairs = enumerate(zip(prefixes, max_tokens, strict=True))
    requests = [greedy(f"ref-{index}", prefix, count) for index, (prefix, count) in pairs]
    out: dict[str, list[int]] = {request.request_id: [] for request in requests}
    for steps in backend.generate(requests):
        for step in steps:
            out[step.request_id].append(step.token_id)
    return [out[request.request_id] for request in requests]


@torch.inference_mode()
def kv_replay(
    model: transformers.PreTrainedModel, prompt: Sequence[int], before: Sequence[int], after: int, new_source: str
) -> list[int]:
    """``persist``'s reference for one sequence: the KV of ``prompt`` and ``before[:-1]`` built with
    ``model``'s weights (the old version), the new weights of ``new_source`` written in place, then
    ``after`` greedy tokens continued from that KV, starting by feeding ``before[-1]`` (the last
    token the old weights sampled). Restores the old weights before returning."""
    old = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    ids = torch.tensor([[*prompt, *before[:-1]]])
    output = model(input_ids=ids, cache=transformers.DynamicCache(), use_cache=True)
    cache = output.cache
    new = tiny.reference_weights(new_source)
    try:
        for name, tensor in model.named_parameters():
            tensor.data.copy_(new[name])
        produced: list[int] = []
        token = before[-1]
        for _ in range(after):
            output = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = output.cache
            token = int(output.logits[0, -1].argmax())
            produced.append(token)
        return produced
    finally:
        for name, tensor in model.named_parameters():
            tensor.data.copy_(old[name])
