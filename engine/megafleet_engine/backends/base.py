"""The one small interface every inference backend implements, and the types it speaks.

Called by the engine's request scheduler (:class:`megafleet_engine.engine.Engine`), which batches
concurrent requests (continuously, where the backend supports it: see :class:`Admission`), and
by the refit receiver, which writes weights in place. Backends know nothing about HTTP, OpenAI
request shapes or the agent: they turn token ids into token ids. Imports no torch at module level,
so protocol and HTTP code can import these types cheaply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Where one rank process sits in its shard's model-parallel world (defaults: one process).

    Ranks follow megatron's order (TP fastest, then PP). ``master_port`` 0 lets a single-process
    backend pick a free local port for its own group."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0


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
    """One generated token of one sequence.

    ``finish_reason == "abort"`` with ``token_id == NO_TOKEN`` carries no token: the backend ended
    the sequence without generating (it could not run it, e.g. the prompt leaves no room); the
    engine fails that request instead of delivering the step.
    """

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None  # set on the sequence's last token


NO_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the scheduler hands a running batch between two decode steps.

    ``join``: sequences to add to the batch now (continuous batching); never more than the
    capacity the backend asked with. ``leave``: request ids of running sequences the scheduler has
    closed (cancelled by the client, aborted by a suspend); the backend should stop generating them
    (their later steps are dropped by the scheduler in any case).
    """

    join: tuple[SequenceRequest, ...] = ()
    leave: Collection[str] = frozenset()


Admit = Callable[[int], Admission]
"""``admit(capacity)``: called by a backend between decode steps with how many more sequences it can
take now (``0``: none, only ask what leaves); returns the :class:`Admission`."""


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
    The scheduler guarantees :meth:`generate` and the weight methods never run concurrently, and
    calls them all from one thread. A refit is :meth:`begin_weight_update` (nothing in flight),
    weight writes, :meth:`finish_weight_update`, with the same KV-cache mode.
    """

    info: ModelInfo

    supports_admission: bool
    """Whether :meth:`generate` takes new sequences into a running batch through ``admit``. When
    ``False`` the scheduler calls ``generate(batch)`` alone and starts the next batch as soon as
    this one ends."""

    def generate(self, batch: Sequence[SequenceRequest], admit: Admit | None = None) -> Iterator[list[TokenStep]]:
        """Continue every sequence of ``batch`` together; yield one list of steps per decode step
        (one entry per sequence that produced a token) until all have finished.

        With ``admit`` (only passed when :attr:`supports_admission`), call ``admit(capacity)``
        before every step: add the sequences it returns to the running batch and stop those it
        says leave; keep going while any sequence runs."""
        ...

    def parameters(self) -> dict[str, torch.Tensor]:
        """The live parameters by (HF-style) name; refits write into these tensors in place."""
        ...

    def load_checkpoint(self, source: str) -> None:
        """Load weights from ``source`` into the live parameters (in place)."""
        ...

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Called before new weights are written, with nothing in flight: ``persist`` keeps the KV
        cache and CUDA graphs, ``offload`` frees them (GPU memory goes back to the device),
        ``recompute`` drops the KV cache (a backend may free it now and rebuild it after).
        Idempotent."""
        ...

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Called after new weights were written: rebuild what :meth:`begin_weight_update` freed;
        no KV entry computed with the old weights may serve a later request. Idempotent."""
        ...


class ModelParallelBackend(Backend, Protocol):
    """A backend whose shard spans several rank processes (megatron with TP or PP > 1).

    The first rank of the group (the frontend rank) generates; every other rank runs
    :meth:`serve_followers` and steps in lockstep. Each rank writes its own weights during a refit,
    so before the first rank resumes, :meth:`settle_weight_update` makes the group agree that every
    rank holds the whole new version."""

    @property
    def follows(self) -> bool:
        """Whether this rank follows the first one (runs :meth:`serve_followers`, never generates)."""
        ...

    def serve_followers(self) -> None:
        """On a following rank: apply the first rank's messages until it closes the backend."""
        ...

    @property
    def spans_ranks(self) -> bool:
        """Whether the shard has rank processes other than this one (else nothing needs settling)."""
        ...

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        """After this rank wrote (``ok``) or failed to write weight ``version``: on the first rank,
        ask every rank and return whether all of them hold it (a collective, on the backend
        thread); on a following rank, record the outcome for the first rank's question and return
        ``ok`` at once (any thread)."""
        ...
