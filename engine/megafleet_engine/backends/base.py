"""The one small interface every inference backend implements, and the types it speaks.

Called by the engine's request scheduler (:class:`megafleet_engine.engine.Engine`), which batches
concurrent requests (continuously, where the backend supports it: see :class:`Admission`), and
by the refit receiver, which writes weights in place. Backends know nothing about HTTP, OpenAI
request shapes or the agent: they turn token ids into token ids. Imports no torch at module level,
so protocol and HTTP code can import these types cheaply.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Collection, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    import torch

    from megafleet_engine.backends import weight_maps

FinishReason = Literal["stop", "length", "abort"]
LogprobsMode = Literal["processed", "raw"]
"""Which distribution a sequence's log-probabilities come from (:mod:`megafleet_engine.backends.sampling`):
``processed``, the one its tokens are drawn from (temperature, top-k, top-p applied: NeMo RL's
``processed_logprobs``); ``raw``, ``log_softmax`` of the model's logits (OpenAI's meaning)."""


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
    """How to pick tokens for one sequence. ``temperature == 0`` or ``top_k == 1`` is greedy.

    Both backends filter the same way (:func:`megafleet_engine.backends.sampling.filter_logits`:
    temperature, then top-k, then top-p, any combination) and report ``logprobs_mode``
    log-probabilities for the chosen token and its alternatives; a greedy sequence reports raw ones
    in either mode."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N >= 0: the chosen token's plus N alternatives
    logprobs_mode: LogprobsMode = "processed"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class SequenceRequest:
    """One sequence to continue: prompt token ids and how to sample."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class TokenStep(msgspec.Struct, frozen=True, gc=False):
    """One generated token of one sequence.

    ``finish_reason == "abort"`` with ``token_id == NO_TOKEN`` carries no token: the backend ended
    the sequence without generating (it could not run it, e.g. the prompt leaves no room); the
    engine fails that request instead of delivering the step.

    A msgspec struct, not a dataclass: a backend makes one per sequence per step (1,024 per step
    at batch 1,024), and this one is built in C (~0.14 µs against ~1.1 µs for a frozen dataclass)
    and is not tracked by the garbage collector (its fields hold no containers that could form a
    cycle), so a large batch does not set off collections. Copy with ``msgspec.structs.replace``.
    """

    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None  # set on the sequence's last token


NO_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class Switched:
    """What a backend did when it applied a :class:`Switch` (it hands this to ``Switch.done``)."""

    recomputed_tokens: int = 0
    """Tokens whose KV it recomputed with the new weights (``recompute``: every running sequence's
    prompt plus the tokens it generated so far; ``persist``: 0)."""
    recompute_seconds: float = 0.0
    """How long the recompute took (the forward over those tokens)."""


def _ignore(switched: Switched) -> None:
    """The default ``Switch.done``: nobody waits for the outcome."""


@dataclasses.dataclass(frozen=True)
class Switch:
    """The weights changed while the backend thread was parked at a step boundary (or idle).

    Handed to the backend by the scheduler (:class:`megafleet_engine.engine.Engine`) exactly once
    per switch: as :attr:`Admission.switch` from the ``admit`` call of the step boundary where the
    thread was parked, or through :meth:`Backend.switch_weights` when it was parked between batches.
    The new weights are already in the live parameters when the backend sees it (written in place
    while parked, or copied from the staging copy by :meth:`Backend.commit_staged` just before);
    the backend applies ``kv_cache_mode`` to the sequences still running before its next forward:

    * ``persist``: nothing; the KV computed with the old weights stays and the next token of every
      sequence is computed with the new weights over it;
    * ``recompute``: every running sequence's prefix (prompt plus every token it generated) is run
      through the new weights before its next token, and that KV replaces the old; with greedy
      sampling each later token equals what a fresh engine at ``version`` produces from the prefix;
    * ``offload``: the KV went to host memory during the writes and comes back unchanged (persist's
      contents); only backends that list it in :attr:`Backend.keep_modes` get it.

    Then it calls :attr:`done` once (on the backend thread) with what it did; a backend that ends the
    batch instead of taking another step may skip it (the scheduler then reports nothing recomputed).
    """

    version: int
    """The weight version the sequences continue with (the scheduler already stamps it on every step
    from now on)."""
    kv_cache_mode: vocabulary.KvCacheMode
    """What to do with the KV the running sequences hold: one of the backend's :attr:`Backend.keep_modes`."""
    staged: bool = False
    """The new weights came from the staging copy (already committed into the live tensors)."""
    done: Callable[[Switched], None] = dataclasses.field(default=_ignore, compare=False, repr=False)
    """Called by the backend once it applied the switch, before its next forward."""


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the scheduler hands a running batch between two decode steps.

    ``join``: sequences to add to the batch now (continuous batching); never more than the
    capacity the backend asked with. ``leave``: request ids of running sequences the scheduler has
    closed (cancelled by the client, aborted by a suspend); the backend should stop generating them
    (their later steps are dropped by the scheduler in any case). ``switch``: the weights changed
    before this step (the thread was parked here for a refit that keeps the running sequences):
    apply its KV-cache mode before the next forward (:class:`Switch`); ``None`` on every other step.
    """

    join: tuple[SequenceRequest, ...] = ()
    leave: Collection[str] = frozenset()
    switch: Switch | None = None


Admit = Callable[[int], Admission]
"""``admit(capacity)``: called by a backend between decode steps with how many more sequences it can
take now (``0``: none, only ask what leaves); returns the :class:`Admission`. The call is the step
boundary where a refit that keeps the running sequences parks the backend thread: it may take as
long as the refit's writes (its weight writes and ``settle`` run inside it, on this thread)."""


@dataclasses.dataclass
class PrefixCacheCounters:
    """What a backend's prefix cache saved since it started (read by the engine's metrics, on any
    thread: two ints, each written by the backend thread only)."""

    prompt_tokens: int = 0
    """Prompt tokens of the sequences the backend prefilled (counting each sequence's own prompt)."""
    hit_tokens: int = 0
    """Of those, tokens whose KV came from the cache or a sibling's prefill instead of a forward."""

    @property
    def hit_ratio(self) -> float:
        """``hit_tokens / prompt_tokens`` (0 before any prompt)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@typing.runtime_checkable
class CachesPrefixes(Protocol):
    """A backend that shares prompt-prefix KV among sequences (and says how much it saved). Its cache
    is tied to the weight version: a refit, in every mode (drained, aborted, kept in flight, staged),
    invalidates every block computed with the old weights before any later sequence can read one."""

    @property
    def prefix_caching(self) -> bool:
        """Whether sharing is on (a backend built with it off counts no hits)."""
        ...

    @property
    def prefix_cache(self) -> PrefixCacheCounters:
        """What sharing saved since the backend started."""
        ...


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the frontend needs to know about the loaded model."""

    name: str
    max_sequence_length: int
    vocab_size: int
    eos_token_id: int | None


class Tokenizer(Protocol):
    """What the OpenAI frontend needs of a Hugging Face tokenizer (text to token ids and back)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """This rank's parameters in a sharded backend's own (megatron) layout: what a refit sink
    writes into. Read when asked, so ``live`` shows a parameter rebound since."""

    live: dict[str, torch.Tensor]
    """The live tensors by megatron name."""
    specs: dict[str, weight_maps.ParamSpec]
    """By megatron name: the local shape and the Hugging Face slices that fill it."""
    hf_shapes: dict[str, tuple[int, ...]]
    """Every Hugging Face parameter of the model and its full shape."""


class Backend(Protocol):
    """An inference backend: batched token generation and in-place weight updates.

    Called by the scheduler (:class:`megafleet_engine.engine.Engine`), the command
    (:mod:`megafleet_engine.cli`), the frontend (its :attr:`tokenizer`) and the refit receiver
    (:mod:`megafleet_engine.refit_attempts` and :mod:`~megafleet_engine.refit_attempts.sinks`); this is
    all they use of a backend.

    Lifecycle: construct (loads the model skeleton; with deferred init, no weights), then
    :meth:`load_checkpoint` or the first weight writes + :meth:`finish_weight_update`, and
    :meth:`close` at the end. The scheduler guarantees :meth:`generate` and the weight methods never
    run concurrently, and calls them all from one thread (the *backend thread*). Weights change only
    on that thread, parked at a step boundary or idle. A refit takes one of three shapes:

    * *drain or abort, in place* (every backend): :meth:`begin_weight_update` (nothing in flight),
      weight writes, :meth:`settle_weight_update`, :meth:`finish_weight_update`, with the same
      KV-cache mode;
    * *keep, in place* (a mode of :attr:`keep_modes`): the thread parks inside ``admit`` between two
      steps of the running batch (or between batches), the weight writes and
      :meth:`settle_weight_update` run there with the sequences in flight, then the next ``admit``
      returns :attr:`Admission.switch` (:meth:`switch_weights` when parked between batches); no
      ``begin``/``finish_weight_update``;
    * *staged* (:meth:`staging_bytes` > 0 and :meth:`prepare_staging` ran at start): the writes go
      into the staging copy (:meth:`staged_parameters`, :meth:`staged_shard_map`) on the refit's own
      thread while the backend keeps generating; at the switch, on the backend thread,
      :meth:`commit_staged` copies it into the live tensors, followed by a :class:`Switch` (keep) or
      :meth:`finish_weight_update` (drain, abort); a failed refit calls :meth:`discard_staged`.

    A backend that can neither keep nor stage can take its members from :class:`InPlaceOnly`.

    A shard may span several rank processes (megatron with TP or PP > 1): the first rank of the
    group (the frontend rank) generates; every other rank :attr:`follows`, runs
    :meth:`serve_followers` and steps in lockstep. Each rank writes its own weights during a refit,
    so before the first rank resumes, :meth:`settle_weight_update` makes the group agree that every
    rank holds the whole new version. A single-process backend never follows and has nothing to
    settle.
    """

    info: ModelInfo

    supports_admission: bool
    """Whether :meth:`generate` takes new sequences into a running batch through ``admit``. When
    ``False`` the scheduler calls ``generate(batch)`` alone and starts the next batch as soon as
    this one ends."""

    kv_cache_mode: vocabulary.KvCacheMode
    """The KV-cache mode of refits unless the engine is told another."""

    keep_modes: frozenset[vocabulary.KvCacheMode]
    """The KV-cache modes under which this backend keeps its running sequences across a refit: the
    scheduler passes ``admit`` to :meth:`generate` (whatever :attr:`supports_admission` says), may park
    its thread inside that call with sequences in flight, and hands it a :class:`Switch` in one of
    these modes. Empty: it cannot pause between steps (a refit drains or aborts first, and the
    thread parks only between batches)."""

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer for the frontend; ``None`` when the model came without one."""
        ...

    @property
    def follows(self) -> bool:
        """Whether this rank follows the first one (runs :meth:`serve_followers`, never generates)."""
        ...

    @property
    def spans_ranks(self) -> bool:
        """Whether the shard has rank processes other than this one (else nothing needs settling)."""
        ...

    def generate(
        self, batch: Sequence[SequenceRequest], admit: Admit | None = None
    ) -> Generator[list[TokenStep], None, None]:
        """Continue every sequence of ``batch`` together; yield one list of steps per decode step
        (one entry per sequence that produced a token) until all have finished. Closing the
        generator early lets the backend wind the batch down.

        With ``admit`` (passed when :attr:`supports_admission` or :attr:`keep_modes`), call
        ``admit(capacity)`` before every step: add the sequences it returns to the running batch,
        stop those it says leave, and apply its :attr:`Admission.switch` before the next forward;
        keep going while any sequence runs. A backend that cannot take sequences mid-batch asks with
        capacity 0."""
        ...

    def switch_weights(self, switch: Switch) -> None:
        """The weights changed while the thread was parked between batches (nothing in flight):
        apply what ``switch`` means without running sequences (usually nothing: the next batch
        starts on the new weights) and call ``switch.done``."""
        ...

    def parameters(self) -> dict[str, torch.Tensor]:
        """The live parameters by (HF-style) name; refits write into these tensors in place."""
        ...

    def shard_map(self) -> ShardMap | None:
        """This rank's parameters in the backend's own sharded layout, or ``None`` when
        :meth:`parameters` holds every tensor whole (refit sinks pick how they write by it)."""
        ...

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        """Load weights from ``source`` into the live parameters (in place), or with ``staged`` into
        the staging copy (only after :meth:`prepare_staging`; the refit's thread, while serving)."""
        ...

    def staging_bytes(self) -> int:
        """Bytes a staging copy of this rank's parameters takes (``P`` of the staging memory rule),
        whether or not one is allocated; 0: this backend cannot stage."""
        ...

    def prepare_staging(self) -> None:
        """Allocate the staging copy: one tensor per live parameter tensor, of the same shape, dtype
        and device. Called once, at engine start, after the model and its caches exist (the copy
        never shrinks the KV cache the user sized), and only when the memory rule allows; every refit
        reuses it, so no refit allocates it. Raises when this backend cannot stage."""
        ...

    def staged_parameters(self) -> dict[str, torch.Tensor]:
        """The staging copy as :meth:`parameters` shows the live weights (same names, shapes and
        views); a staged refit writes these from its own thread while :meth:`generate` runs. Raises
        unless :meth:`prepare_staging` ran."""
        ...

    def staged_shard_map(self) -> ShardMap | None:
        """The staging copy as :meth:`shard_map` shows the live one; ``None`` exactly when
        :meth:`shard_map` is ``None``."""
        ...

    def commit_staged(self) -> None:
        """Copy the whole staging copy into the live parameters in place (``torch._foreach_copy_`` or
        ``copy_`` per tensor; never rebinding: CUDA graphs read the live addresses). On the backend
        thread, parked at a step boundary or idle; the scheduler hands the :class:`Switch` (``staged``)
        over right after. The staging copy keeps its contents (nothing reads them until the next
        refit overwrites them all)."""
        ...

    def discard_staged(self) -> None:
        """A staged refit failed before its switch: forget what it wrote into the staging copy (the
        copy stays allocated for the next refit; the live weights were never touched). On the
        refit's thread, while serving; never touches the live weights."""
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

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        """After this rank wrote (``ok``) or failed to write weight ``version``: on the first rank,
        ask every rank and return whether all of them hold it (a collective, on the backend
        thread); on a following rank, record the outcome for the first rank's question and return
        ``ok`` at once (any thread). Without other ranks: ``ok``."""
        ...

    def serve_followers(self) -> None:
        """On a following rank: apply the first rank's messages until it closes the backend."""
        ...

    def close(self) -> None:
        """Release what the backend holds (the first rank releases its followers)."""
        ...


class InPlaceOnly:
    """The members of :class:`Backend` for a backend that neither keeps sequences across a refit nor
    stages (its refits drain or abort, then write in place): no :attr:`keep_modes`, no staging copy.
    Mixed into such backends (and test doubles) so they still satisfy the protocol."""

    keep_modes: frozenset[vocabulary.KvCacheMode] = frozenset()

    def switch_weights(self, switch: Switch) -> None:
        """Nothing in flight and no cache of its own that outlives a refit's ``finish_weight_update``."""
        switch.done(Switched())

    def staging_bytes(self) -> int:
        return 0

    def prepare_staging(self) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot stage a refit: it writes weights in place only")

    def staged_parameters(self) -> dict[str, torch.Tensor]:
        raise RuntimeError(f"{type(self).__name__} holds no staging copy")

    def staged_shard_map(self) -> ShardMap | None:
        raise RuntimeError(f"{type(self).__name__} holds no staging copy")

    def commit_staged(self) -> None:
        raise RuntimeError(f"{type(self).__name__} holds no staging copy")

    def discard_staged(self) -> None:
        """Nothing was staged."""
