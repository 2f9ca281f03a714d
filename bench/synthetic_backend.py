"""A backend with no model for ``serving.py --backend synthetic``: every running sequence gets one
token per step of a fixed duration, so the run measures the serving path alone (the scheduler, the
core's IPC, the API-server processes, the clients) on a machine without a GPU.

It is a measuring tool, not a stand-in for an engine: it admits sequences between steps as
megatron's engine does (the transformers backend on CPU does not, so streaming requests arriving
one by one would run as many small batches there), and its tokens are a function of the step and
the prompt, the same on every path. The tokenizer, vocabulary and sequence limit are the tiny
model's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Generator, Sequence
from typing import Any

from megafleet_engine.backends import base
from megafleet_protocol import vocabulary


class SyntheticBackend:
    """Wraps a loaded backend for its tokenizer and model info; generates without it.

    Args:
        model: the backend whose tokenizer and :class:`~megafleet_engine.backends.base.ModelInfo`
            are served.
        step_seconds: the duration of one step, whatever the batch (a GPU decode step's, roughly).
    """

    supports_admission = True
    keep_modes: frozenset[vocabulary.KvCacheMode] = frozenset({"persist"})  # its tokens depend on no weights

    def __init__(self, model: Any, step_seconds: float) -> None:
        self._model = model
        self._step = step_seconds
        self.info: base.ModelInfo = model.info
        self.kv_cache_mode = model.kv_cache_mode

    def __getattr__(self, name: str) -> Any:  # the rest of the Backend protocol: the model's
        return getattr(self._model, name)

    def generate(
        self, batch: Sequence[base.SequenceRequest], admit: base.Admit | None = None
    ) -> Generator[list[base.TokenStep], None, None]:
        vocab = self.info.vocab_size
        running = {request.request_id: [request, 0, _seed(request)] for request in batch}
        while running:
            started = time.perf_counter()
            if admit is not None:
                admission = admit(1 << 20)
                running.update({request.request_id: [request, 0, _seed(request)] for request in admission.join})
                for request_id in admission.leave:
                    running.pop(request_id, None)
            steps = []
            for request_id, entry in list(running.items()):
                request, produced, seed = entry
                produced += 1
                entry[1] = produced
                done = produced >= request.params.max_tokens
                token = (seed + produced * 7919) % vocab
                steps.append(base.TokenStep(request_id, token, None, (), "length" if done else None))
                if done:
                    del running[request_id]
            time.sleep(max(0.0, self._step - (time.perf_counter() - started)))
            if steps:
                yield steps


def _seed(request: base.SequenceRequest) -> int:
    """A sequence's tokens follow from its prompt, so every path produces the same ones."""
    return zlib.crc32(bytes(str(request.prompt_token_ids), "ascii"))
