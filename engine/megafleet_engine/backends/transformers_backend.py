"""The ``transformers`` backend: Hugging Face causal LMs on CPU or one GPU, tensor parallel 1.

Called by the engine's backend thread (:class:`megafleet_engine.engine.Engine`). A batch is
decoded together: prompts are left-padded, each step runs one forward pass over every running
sequence with a shared KV cache, and each sequence samples with its own parameters and seeded
generator. Greedy decoding gives the model's own greedy output (``model.generate(do_sample=False)``).

No continuous batching (``supports_admission = False``): the left-padded shared cache cannot take
new rows mid-batch, so the scheduler starts the next batch when this one ends. Given an ``admit``
(always, since it keeps sequences across refits), :meth:`TransformersBackend.generate` asks it with
capacity 0 between steps, stops the sequences that leave and applies a refit's switch. No cache
outlives a batch, so every KV-cache mode holds across a drained refit as is.

Keeping sequences across a refit (``keep_modes``: ``persist`` and ``recompute``; there is no host
copy of the cache to offload to): the scheduler parks the backend thread inside ``admit`` while the
weights are written, then hands over the :class:`~megafleet_engine.backends.base.Switch`. Under
``persist`` the batch goes on with the same cache. Under ``recompute`` the cache, local to
:meth:`~TransformersBackend.generate`, is rebuilt: every running row's prompt plus its generated
tokens are left-padded again (finished rows dropped) and run through the new weights in one forward,
whose cache replaces the old and whose last logits stand in for the next decode step, exactly as a
fresh batch of those prefixes would start. A staging copy (:meth:`~TransformersBackend.prepare_staging`)
is one tensor per parameter, committed with ``torch._foreach_copy_``.
One process holds the whole model: it never follows another rank and has nothing to settle.

Prefix sharing (``prefix_caching``, on by default): the identical prefixes of a batch (the samples of
one prompt: OpenAI's ``n``, GRPO's repeated prompts, which the SDK routes to one shard) are prefilled
once; the rows of that one forward's cache, its logits, mask and positions are then repeated for
every sibling (``DynamicCache.batch_select_indices``), so the batch decodes exactly as if each had
been prefilled alone. Shared prefixes that are not whole prompts (a system prompt before different
questions) and prompts of different batches are not shared: the left-padded cache of a static batch
puts a prefix at a different column in every batch and row, so reusing it would mean copying and
re-aligning KV per row, which costs about what the prefill of a short prefix does on this backend
(CPU, small models). Nothing cached outlives its batch, so a refit never meets a block of old weights
here: a batch kept across a refit keeps its KV by its own mode (``persist``: the KV of the old
weights, the mode's meaning; ``recompute``: re-prefilled with the new weights, siblings once again).
:attr:`~TransformersBackend.prefix_cache` counts the prompt tokens a prefill skipped.

Tokens are drawn, and log-probabilities reported, as :mod:`megafleet_engine.backends.sampling`
says: by default those of the filtered distribution the token was drawn from (NeMo RL's processed
log-probabilities), ``log_softmax`` of the raw logits when greedy or when the sequence asks for
``raw``. Alternatives (``top_logprobs``) come from the same distribution as the chosen token.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Sequence
from pathlib import Path

import torch
import transformers

from megafleet_engine.backends import base, sampling
from megafleet_engine.models import tiny
from megafleet_protocol import vocabulary


@dataclasses.dataclass
class _Running:
    request: base.SequenceRequest
    generator: torch.Generator | None
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.tokens)


class TransformersBackend:
    """A :class:`~megafleet_engine.backends.base.Backend` over a ``PreTrainedModel``."""

    supports_admission = False
    kv_cache_mode: vocabulary.KvCacheMode = "persist"
    keep_modes: frozenset[vocabulary.KvCacheMode] = frozenset({"persist", "recompute"})
    follows = False
    spans_ranks = False

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        tokenizer: transformers.PreTrainedTokenizerBase,
        *,
        name: str,
        max_sequence_length: int,
        prefix_caching: bool = True,
    ) -> None:
        self.model = model
        self.prefix_caching = prefix_caching
        self.prefix_cache = base.PrefixCacheCounters()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        eos = tokenizer.eos_token_id
        self.info = base.ModelInfo(
            name=name,
            max_sequence_length=max_sequence_length,
            vocab_size=int(model.config.vocab_size),
            eos_token_id=int(eos) if eos is not None else None,
        )
        self._pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0))
        self._staging: dict[str, torch.Tensor] | None = None  # the staging copy, once prepared

    # -- weights -------------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: parameter.data for name, parameter in self.model.named_parameters()}

    def shard_map(self) -> None:
        """Every parameter is held whole, by its HF name (:meth:`parameters`)."""
        return None

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        """Copy a checkpoint's tensors into the live parameters (never rebinding them), or into the
        staging copy."""
        if tiny.is_tiny(source):
            weights = tiny.reference_weights(source)
        else:
            from safetensors.torch import load_file

            weights = {}
            for path in sorted(Path(source).glob("*.safetensors")):
                weights.update(load_file(str(path)))
        live = self.staged_parameters() if staged else self.parameters()
        missing = sorted(set(live) - set(weights))
        if missing:
            raise ValueError(f"checkpoint {source} lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(weights[name])

    # -- staging -------------------------------------------------------------------------------

    def staging_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.parameters().values())

    def prepare_staging(self) -> None:
        """One empty tensor beside each parameter (idempotent)."""
        if self._staging is None:
            self._staging = {name: torch.empty_like(tensor) for name, tensor in self.parameters().items()}

    def staged_parameters(self) -> dict[str, torch.Tensor]:
        if self._staging is None:
            raise RuntimeError(
                "this engine holds no staging copy (MEGAFLEET_REFIT_STAGING is off, or there was no room)"
            )
        return dict(self._staging)

    def staged_shard_map(self) -> None:
        """Every staged tensor is held whole, by its HF name (:meth:`staged_parameters`)."""
        return None

    def commit_staged(self) -> None:
        staged = self.staged_parameters()
        live = self.parameters()
        with torch.no_grad():
            torch._foreach_copy_([live[name] for name in staged], list(staged.values()))

    def discard_staged(self) -> None:
        """Nothing reads the staging copy before the next refit overwrites all of it."""

    def switch_weights(self, switch: base.Switch) -> None:
        """Between batches no cache exists: the next batch starts on the new weights."""
        switch.done(base.Switched())

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """No cache outlives a batch here, so every mode is already satisfied."""

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """No cache outlives a batch here, so every mode is already satisfied."""

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        """No other rank holds weights of this model: the outcome is this rank's own."""
        return ok

    def serve_followers(self) -> None:
        """Never called: a single-process backend has no followers."""
        raise RuntimeError("the transformers backend runs in one process: no rank follows it")

    def close(self) -> None:
        """Nothing outlives a batch, and no other rank waits for this one."""

    # -- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, batch: Sequence[base.SequenceRequest], admit: base.Admit | None = None
    ) -> Generator[list[base.TokenStep], None, None]:
        running = [_Running(request, _generator(request.params, self.device)) for request in batch]
        output = self._prefill(running)
        while True:
            logits = output.logits[:, -1, :].float()
            steps, next_tokens = self._sample(running, logits)
            if steps:
                yield steps
            if all(state.done for state in running):
                return
            if admit is not None:  # capacity 0: only learn which sequences the scheduler closed
                admission = admit(0)
                for state in running:
                    state.done = state.done or state.request.request_id in admission.leave
                if all(state.done for state in running):
                    return
                if admission.switch is not None and admission.switch.kv_cache_mode == "recompute":
                    running = [state for state in running if not state.done]
                    output = self._recompute(running, admission.switch)
                    continue
                if admission.switch is not None:
                    self._persist(admission.switch)
            input_ids = next_tokens.unsqueeze(-1)
            attention_mask = torch.cat([output.attention_mask, torch.ones_like(input_ids)], dim=-1)
            position_ids = output.position_ids[:, -1:] + 1
            output = self._forward(input_ids, attention_mask, position_ids, output.cache)

    def _prefill(self, running: Sequence[_Running]) -> _Output:
        """One forward over every row's prompt and generated tokens, left-padded, into a new cache;
        identical prefixes (with :attr:`prefix_caching`) run once and their rows are repeated."""
        prefixes = [(*state.request.prompt_token_ids, *state.tokens) for state in running]
        unique = list(dict.fromkeys(prefixes)) if self.prefix_caching else prefixes
        self.prefix_cache.prompt_tokens += sum(len(prefix) for prefix in prefixes)
        self.prefix_cache.hit_tokens += sum(len(prefix) for prefix in prefixes) - sum(len(prefix) for prefix in unique)
        input_ids, attention_mask = self._left_pad(unique)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        output = self._forward(input_ids, attention_mask, position_ids, transformers.DynamicCache())
        if len(unique) == len(prefixes):
            return output
        row = {prefix: index for index, prefix in enumerate(unique)}
        rows = torch.tensor([row[prefix] for prefix in prefixes], dtype=torch.long, device=self.device)
        output.cache.batch_select_indices(rows)
        return _Output(
            output.logits[:, -1:, :].index_select(0, rows),  # only the last position is read
            output.cache,
            output.attention_mask.index_select(0, rows),
            output.position_ids.index_select(0, rows),
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: transformers.Cache,
    ) -> _Output:
        output = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        return _Output(output.logits, output.cache, attention_mask, position_ids)

    def _recompute(self, running: list[_Running], switch: base.Switch) -> _Output:
        """The running rows' prefixes through the new weights: a fresh cache, and the logits of
        their next token (what the next decode step would have computed)."""
        started = time.perf_counter()
        output = self._prefill(running)
        recomputed = sum(state.length for state in running)
        switch.done(base.Switched(recomputed_tokens=recomputed, recompute_seconds=time.perf_counter() - started))
        return output

    def _persist(self, switch: base.Switch) -> None:
        """The cache stays as the old weights computed it (``persist``); nothing else is kept."""
        if switch.kv_cache_mode not in self.keep_modes:
            raise ValueError(f"the transformers backend keeps with persist or recompute, not {switch.kv_cache_mode}")
        switch.done(base.Switched())

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            if prompt:
                ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                mask[row, width - len(prompt) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _sample(self, running: list[_Running], logits: torch.Tensor) -> tuple[list[base.TokenStep], torch.Tensor]:
        steps: list[base.TokenStep] = []
        next_tokens = torch.full((len(running),), self._pad_id, dtype=torch.long, device=logits.device)
        for row, state in enumerate(running):
            if state.done:
                continue
            params = state.request.params
            token, logprobs = _pick(logits[row], params, state.generator)
            next_tokens[row] = token
            state.tokens.append(token)
            finish = self._finish_reason(token, len(state.tokens), state.length, params)
            state.done = finish is not None
            steps.append(
                base.TokenStep(
                    request_id=state.request.request_id,
                    token_id=token,
                    logprob=float(logprobs[token]) if params.logprobs is not None else None,
                    top_logprobs=_top(logprobs, params.logprobs),
                    finish_reason=finish,
                )
            )
        return steps, next_tokens

    def _finish_reason(
        self, token: int, produced: int, length: int, params: base.SamplingParams
    ) -> base.FinishReason | None:
        if not params.ignore_eos and token == self.info.eos_token_id:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if produced >= params.max_tokens or length >= self.info.max_sequence_length:
            return "length"
        return None


@dataclasses.dataclass(frozen=True)
class _Output:
    """One forward's logits and cache, and the mask and positions it ran with (the next step
    extends them by one column)."""

    logits: torch.Tensor
    cache: transformers.Cache
    attention_mask: torch.Tensor
    position_ids: torch.Tensor


def _generator(params: base.SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def _pick(
    logits: torch.Tensor, params: base.SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor]:
    """The next token and the log-probabilities the sequence reports (its ``logprobs_mode``)."""
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    drawn = sampling.sample(logits.unsqueeze(0), temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    logprobs = sampling.logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p, mode=params.logprobs_mode)
    return int(drawn[0]), logprobs


def _top(logprobs: torch.Tensor, count: int | None) -> tuple[tuple[int, float], ...]:
    if not count:
        return ()
    values, indices = torch.topk(logprobs, min(count, logprobs.numel()))
    return tuple((int(index), float(value)) for index, value in zip(indices, values, strict=True))


def load(
    source: str,
    *,
    name: str,
    max_sequence_length: int,
    dtype: str,
    device: str,
    load_weights: bool,
    prefix_caching: bool = True,
) -> TransformersBackend:
    """A backend for a ``tiny://`` model or a local Hugging Face checkpoint folder."""
    torch_dtype = getattr(torch, dtype)
    if tiny.is_tiny(source):
        model, tokenizer = tiny.build_tiny(source, dtype=torch_dtype)
        if not load_weights:
            _scramble(model)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
        if load_weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch_dtype)
        else:
            config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.eval()
    model.to(device)
    return TransformersBackend(
        model, tokenizer, name=name, max_sequence_length=max_sequence_length, prefix_caching=prefix_caching
    )


def _scramble(model: transformers.PreTrainedModel) -> None:
    """Deferred init: the parameters exist, but hold zeros until the first refit writes them."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
