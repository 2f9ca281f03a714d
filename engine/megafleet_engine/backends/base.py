"""The one small interface every inference backend implements, and the types it speaks.

Called by the engine's request scheduler (:mod:`megafleet_engine.scheduler`), which batches
concurrent requests, and by the refit receiver, which writes weights in place. Backends know
nothing about HTTP, OpenAI request shapes or the agent: they turn token ids into token ids.
Imports no torch at module level, so protocol and HTTP code can import these types cheaply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one sequence. ``temperature == 0`` or ``top_k == 1`` is greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N >= 0: the chosen token's plus N alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class SequenceRequest:
    """One sequence to continue: prompt token ids and how to sample."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenStep:
    """One generated token of one sequence."""

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None  # set on the sequence's last token


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to know about the loaded model."""

    name: str
    max_sequence_length: int
    vocab_size: int
    eos_token_id: int | None


class Backend(Protocol):
    """An inference backend: batched token generation and in-place weight updates.

    Lifecycle: construct (loads the model skeleton; with deferred init, no weights), then
    :meth:`load_checkpoint` or the first :meth:`write_weights` + :meth:`finish_weight_update`.
    The scheduler guarantees :meth:`generate` and the weight methods never run concurrently.
    """

    info: ModelInfo

    def generate(self, batch: Sequence[SequenceRequest]) -> Iterator[list[TokenStep]]:
        """Continue every sequence of ``batch`` together; yield one list of steps per decode step
        (one entry per still-running sequence) until all have finished."""
        ...

    def parameters(self) -> dict[str, torch.Tensor]:
        """The live parameters by (HF-style) name; refits write into these tensors in place."""
        ...

    def load_checkpoint(self, source: str) -> None:
        """Load weights from ``source`` into the live parameters (in place)."""
        ...

    def finish_weight_update(self, kv_cache_mode: Literal["persist", "offload", "recompute"]) -> None:
        """Called after new weights were written: drop or rebuild caches as the mode requires."""
        ...
