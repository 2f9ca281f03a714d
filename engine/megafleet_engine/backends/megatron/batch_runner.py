"""Generation on megatron's engine: the first rank's batch loop, the ticks every rank applies, and
turning megatron's requests into token steps.

Called by :class:`.backend.MegatronBackend` (``generate`` on the first rank; a follower's ticks
and steps). A batch is added to megatron's engine as one set of requests and stepped; before every
step the scheduler's ``admit`` hands over sequences that arrived meanwhile (``add_request`` between
steps: megatron schedules them into the next step with the running ones) and names those it
closed, which end through megatron's own early-finish path (the set its stop-word logic uses), as
do sequences that sampled a stop id megatron does not know. Each step yields the tokens it
produced. Sampling maps onto megatron's per-request parameters (greedy = ``top_k=1``; megatron
has one sampling generator, so per-request seeds are ignored), which :mod:`.nemo_sampler`'s sampler
(installed on megatron's controller here) filters as NeMo RL's trainer does, top-k and top-p
together allowed. EOS stops through megatron's ``termination_id``. Log-probabilities are processed
ones (those of the distribution the token was drawn from; raw when greedy), or ``log_softmax`` of
the raw logits for sequences that ask for ``raw``: the runner keeps their megatron ids in the
sampler's :attr:`~.nemo_sampler.NemoSampling.raw_request_ids` on every rank while they run.

Step outputs as arrays, so that a step costs no Python work per sequence (``bench/HISTORY.md``): a
step's request ids, sampled tokens and finished ids are read from megatron's step result (host
tensors megatron already copied back) with one ``tolist()`` each, between megatron's forward and its
bookkeeping; sequences without log-probabilities (the RL rollout's case) take their token from those
lists, with no lookup of megatron's request record.
Sequences that asked for log-probabilities read them from their record as before.
:attr:`Runner.array_collect` ``False`` reads every sequence from its record (the benchmark's A/B).

A record may hold several requests: megatron checkpoints a request (its prompt becomes prompt +
generated tokens, and a new request with empty ``generated_tokens`` continues it) when it evicts it
under KV pressure and when a refit that keeps the running sequences recomputes their KV. Each
sequence keeps how many tokens its record's earlier requests generated (its ``offset``), so it reads
its new tokens and log-probabilities from the record's last request, and no token is emitted twice
or lost across a checkpoint.

A refit that keeps the running sequences parks the backend thread inside ``admit``; the admission
that ends the park carries the :class:`~megafleet_engine.backends.base.Switch`, which the runner
hands to :attr:`Runner.boundary` (the backend: a lockstep ``switch`` tick every rank applies) before
the step's tick, as it does when a suspension that kept the sequences is still :attr:`Runner.held`
(the refit ended without a switch: the boundary resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Generator
from typing import Any

import torch

from megafleet_engine.backends import base
from megafleet_engine.backends.megatron import build, lockstep, nemo_sampler

__all__ = ["Runner", "to_megatron_sampling"]

log = logging.getLogger(__name__)

_FIRST_REQUEST_ID = 1 << 30  # megatron keeps ids in int32; its own counter (engine.generate) starts at 0

Boundary = Callable[[base.Switch | None], None]
"""What the backend does at a step boundary where a refit parked the thread (:attr:`Runner.boundary`)."""


def to_megatron_sampling(params: base.SamplingParams, *, budget: int, termination_id: int) -> dict[str, Any]:
    """Keyword arguments of megatron's ``SamplingParams`` for one sequence (``budget``: tokens it
    may generate). The log-probability mode is not among them (megatron has no such parameter):
    :class:`Runner` hands it to the sampler."""
    top_p = params.top_p if params.top_p < 1.0 else 0.0  # megatron: 0.0 = no nucleus cut
    if params.greedy:
        temperature, top_k, top_p = 1.0, 1, 0.0
    else:
        temperature, top_k = params.temperature, params.top_k
    return {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "return_log_probs": params.logprobs is not None,
        "skip_prompt_log_probs": True,
        "top_n_logprobs": params.logprobs or 0,
        "num_tokens_to_generate": min(params.max_tokens, budget),
        "termination_id": -1 if params.ignore_eos else termination_id,
    }


@dataclasses.dataclass
class _Sequence:
    request: base.SequenceRequest
    stops: frozenset[int]
    ends: frozenset[int] = frozenset()
    """``stops`` and the EOS id unless ``ignore_eos``: a token in it finishes with ``stop``."""
    plain: bool = False
    """No log-probabilities asked: the step's token arrays carry all it needs."""
    emitted: int = 0
    done: bool = False
    parts: int = 1
    """Requests in its megatron record when :attr:`offset` was counted."""
    offset: int = 0
    """Tokens generated by the record's requests before its last one (checkpoints)."""


class Runner:
    """Megatron's ``engine`` as one rank runs it: the running batch (first rank: sequences by
    megatron id, megatron ids by request id, and the ids to stop at the next tick, where a stop
    token megatron does not know was sampled), the ids every rank hands megatron alike, and the
    event loop megatron's engine runs its coroutines on."""

    def __init__(
        self,
        engine: Any,
        info: base.ModelInfo,
        ranks: lockstep.Lockstep,
        *,
        max_requests: int,
        other_eos: frozenset[int],
    ) -> None:
        self.engine = engine
        self.info = info
        self._lockstep = ranks
        self._max_requests = max_requests
        self._other_eos = other_eos
        self._sequences: dict[int, _Sequence] = {}
        self._by_key: dict[str, int] = {}
        self._stops: set[int] = set()
        self._loop = asyncio.new_event_loop()  # megatron's engine runs its coroutines on this loop
        engine._loop = self._loop
        self._ids = itertools.count(_FIRST_REQUEST_ID)
        self.sampler = nemo_sampler.install(engine.controller)
        self._raw = self.sampler.raw_request_ids  # on every rank alike
        self.array_collect = True
        """Read plain sequences' tokens from the step's arrays (see the module's docstring)."""
        self._arrays: tuple[list[int], list[int], list[int]] | None = None
        self._detailed = 0  # running sequences that are not plain
        self.boundary: Boundary | None = None
        """Called (first rank) after an ``admit`` that ends a refit's park: with its switch, or
        ``None`` while :attr:`held`. Set by the backend."""
        self.held = False
        """A refit suspended megatron's engine with the sequences kept; the next boundary resumes it."""

    def close(self) -> None:
        """Close the event loop."""
        self._loop.close()

    def tick(self, tick: lockstep.Tick) -> list[base.TokenStep]:
        """First rank: send ``tick`` to the followers and apply it here."""
        if self._lockstep.spans_ranks:
            self._lockstep.broadcast(tick)
        elif not tick.join and not tick.leave:
            return []  # nothing joins or leaves this step
        return self.apply(tick)

    def step(self) -> dict[str, Any]:
        """One step of megatron's engine (every rank); finished requests leave the raw set. On the
        first rank with :attr:`array_collect`, the step's arrays are kept for :meth:`collect`."""
        result: dict[str, Any] = self._loop.run_until_complete(self._step())
        if self._raw:
            for record in result["finished_request_records"]:
                self._raw.discard(record.requests[-1].request_id)
        return result

    async def _step(self) -> dict[str, Any]:
        """megatron's ``async_step`` (its forward, then its bookkeeping), reading the step's ids,
        tokens and finished ids in between."""
        forward = await self.engine.async_forward()
        output = forward[0]
        self._arrays = None
        if output is not None and self.array_collect and self._lockstep.leader:
            self._arrays = (
                output["active_request_ids"].tolist(),
                output["sample"].tolist(),
                output["finished_request_ids"].tolist(),
            )
        result: dict[str, Any] = await self.engine.async_bookkeep(*forward)
        return result

    def lead(
        self, batch: list[base.SequenceRequest], admit: base.Admit | None
    ) -> Generator[list[base.TokenStep], None, None]:
        """The first rank's batch loop: before every step, one tick (sequences joining: the batch,
        then what ``admit`` hands over; sequences leaving: closed by the scheduler or ended here by
        a stop token megatron does not know), which the followers apply too; then one step."""
        torch.cuda.set_device(self._lockstep.device)  # generate() runs on the engine's own thread
        joining = batch
        outcome = "failed"
        try:
            while True:
                leaving, self._stops = self._stops, set()
                if admit is not None:
                    room = max(0, self._max_requests - len(self._sequences) - len(joining))
                    admission = admit(room)
                    if admission.switch is not None or self.held:
                        self._at_boundary(admission.switch)
                    joining = [*joining, *admission.join]
                    leaving |= {self._by_key[key] for key in admission.leave if key in self._by_key}
                rejected = self.tick(lockstep.Tick(join=tuple(joining), leave=tuple(sorted(leaving))))
                joining = []
                if rejected:
                    yield rejected
                if not self.engine.has_unfinished_requests():
                    outcome = "done"
                    return
                steps = self.collect(self.step())
                if steps:
                    yield steps
        except GeneratorExit:
            outcome = "closed"
            raise
        finally:
            if outcome == "closed":
                self.wind_down()
            elif outcome == "failed":
                self.recover()
            self._sequences.clear()
            self._by_key.clear()
            self._stops.clear()
            self._detailed = 0
            self._arrays = None

    def _at_boundary(self, switch: base.Switch | None) -> None:
        if self.boundary is None:
            raise RuntimeError("a refit switched the weights, but this runner has no boundary to apply it")
        self.boundary(switch)

    def wind_down(self) -> None:
        """The scheduler closed the batch early: stop every request megatron still runs."""
        while self.engine.has_unfinished_requests():
            self.tick(lockstep.Tick(leave=tuple(sorted(self.engine.requests))))
            self.step()

    def recover(self) -> None:
        """A step failed: drop every request so the next batch starts from a clean engine."""
        log.warning("resetting megatron's engine after a failed step")
        with contextlib.suppress(Exception):
            if self._lockstep.spans_ranks:
                self._lockstep.broadcast(lockstep.Tick(control="reset"))
            self.reset()

    def reset(self) -> None:
        self.engine.reset()
        self.engine.stop_word_finished_request_ids.clear()
        self._raw.clear()

    def apply(self, tick: lockstep.Tick) -> list[base.TokenStep]:
        """Add the joining sequences to megatron's engine and stop the leaving ones (every rank
        does the same, in the same order). Returns an ``abort`` step for each joining sequence
        that cannot run (first rank only)."""
        sampling_params = build.megatron_core("inference.sampling_params")
        eos = self.info.eos_token_id
        termination = -1 if eos is None else eos
        rejected: list[base.TokenStep] = []
        for request in tick.join:
            request_id = next(self._ids)  # consumed on every rank alike, so the ids agree
            prompt = list(request.prompt_token_ids) or [self.engine.controller.tokenizer.eod]
            budget = self.info.max_sequence_length - len(prompt)
            try:
                if budget <= 0:
                    raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room to generate")
                megatron_params = sampling_params.SamplingParams(
                    **to_megatron_sampling(request.params, budget=budget, termination_id=termination)
                )
            except ValueError as error:
                if self._lockstep.leader:
                    log.warning("request %s cannot run: %s", request.request_id, error)
                    rejected.append(_no_token(request.request_id))
                continue
            future = self.engine.add_request(request_id, prompt, megatron_params)
            if future.done():  # megatron refused it at once (e.g. more blocks than the KV cache has)
                if self._lockstep.leader:
                    log.warning("megatron refused request %s", request.request_id)
                    rejected.append(_no_token(request.request_id))
                continue
            if request.params.logprobs_mode == "raw":
                self._raw.add(request_id)
            if self._lockstep.leader:
                params = request.params
                stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._other_eos)
                ends = stops if params.ignore_eos or eos is None else stops | {eos}
                plain = params.logprobs is None
                self._sequences[request_id] = _Sequence(request, stops, ends, plain)
                self._by_key[request.request_id] = request_id
                self._detailed += not plain
        for request_id in tick.leave:
            sequence = self._sequences.get(request_id)
            if sequence is not None:
                sequence.done = True
            if request_id in self.engine.requests:  # megatron's own early finish (as for stop words)
                self.engine.stop_word_finished_request_ids.add(request_id)
        return rejected

    def collect(self, result: dict[str, Any]) -> list[base.TokenStep]:
        """The tokens one step produced for the running sequences, in one list for the step.

        With the step's arrays (:meth:`_step`), a plain sequence costs one dict lookup and one
        :class:`~megafleet_engine.backends.base.TokenStep`; the others (and all of them without
        arrays) read their new tokens from megatron's request record."""
        steps: list[base.TokenStep] = []
        sequences = self._sequences
        requests = self.engine.requests
        arrays, self._arrays = self._arrays, None
        if arrays is not None:
            self._plain_steps(steps, *arrays)
        if arrays is None or self._detailed:
            for request_id in result["active_request_ids"]:
                sequence = sequences.get(request_id)
                if sequence is not None and not sequence.done and (arrays is None or not sequence.plain):
                    request, offset = _current(sequence, requests[request_id].record)
                    self._new_steps(steps, sequence, request_id, (request, offset), False)
        for record in result["finished_request_records"]:
            last = record.requests[-1]
            sequence = sequences.pop(last.request_id, None)
            if sequence is None:
                continue
            self._by_key.pop(sequence.request.request_id, None)
            self._detailed -= not sequence.plain
            if not sequence.done and (arrays is None or not sequence.plain):
                self._new_steps(steps, sequence, last.request_id, _current(sequence, record), True)
            if not sequence.done:  # ended without a token: megatron failed it
                log.warning("megatron request for %s ended with status %s", sequence.request.request_id, last.status)
                steps.append(_no_token(sequence.request.request_id))
                sequence.done = True
        return steps

    def _plain_steps(
        self, steps: list[base.TokenStep], request_ids: list[int], tokens: list[int], finished_ids: list[int]
    ) -> None:
        """Append the step's token of every running plain sequence (one token per sequence per
        step: chunked prefill and speculative decoding are off). A sequence megatron finished this
        step ends with ``length`` unless its token is a stop; one that sampled a stop megatron
        does not know is ended at the next tick."""
        sequences = self._sequences
        finished = set(finished_ids)
        for request_id, token in zip(request_ids, tokens, strict=True):
            sequence = sequences.get(request_id)
            if sequence is None or sequence.done or not sequence.plain:
                continue
            index = sequence.emitted
            sequence.emitted = index + 1
            finish: base.FinishReason | None = None
            if token in sequence.ends:
                finish = "stop"
            elif request_id in finished or index + 1 >= sequence.request.params.max_tokens:
                finish = "length"
            steps.append(base.TokenStep(sequence.request.request_id, token, None, (), finish))
            if finish is not None:
                sequence.done = True
                if request_id not in finished:  # megatron would go on (a stop id it does not know)
                    self._stops.add(request_id)

    def _new_steps(
        self,
        steps: list[base.TokenStep],
        sequence: _Sequence,
        request_id: int,
        current: tuple[Any, int],
        finished: bool,
    ) -> None:
        """Append ``sequence``'s tokens that megatron produced since the last call to ``steps``;
        ``current`` is the megatron request holding them and how many tokens came before its first."""
        request, offset = current
        generated = request.generated_tokens
        count = offset + len(generated)
        params = sequence.request.params
        key = sequence.request.request_id
        eos = None if params.ignore_eos else self.info.eos_token_id
        for index in range(sequence.emitted, count):
            token = int(generated[index - offset])
            finish: base.FinishReason | None = None
            if token == eos or token in sequence.stops:
                finish = "stop"
            elif (finished and index == count - 1) or index + 1 >= params.max_tokens:
                finish = "length"
            if params.logprobs is None:
                steps.append(base.TokenStep(key, token, None, (), finish))
            else:
                top = _top_logprobs(request, index - offset) if params.logprobs else ()
                steps.append(base.TokenStep(key, token, _logprob(request, index - offset), top, finish))
            if finish is not None:
                sequence.done = True
                if not finished:  # megatron would go on (a stop id it does not know): end it
                    self._stops.add(request_id)
                break
        sequence.emitted = count


def _current(sequence: _Sequence, record: Any) -> tuple[Any, int]:
    """The request of ``record`` to read ``sequence``'s new tokens from, and how many tokens its
    record generated before that request: the last one and the sequence's offset (counted again
    when megatron checkpointed it since), or the whole record merged when tokens not emitted yet sit
    in an earlier request (a checkpoint in the step that generated them)."""
    parts = record.requests
    if len(parts) == 1:
        return parts[0], 0
    if len(parts) != sequence.parts:
        sequence.parts = len(parts)
        sequence.offset = sum(len(part.generated_tokens) for part in parts[:-1])
    if sequence.emitted < sequence.offset:
        return record.merge(), 0
    return parts[-1], sequence.offset


def _no_token(request_id: str) -> base.TokenStep:
    return base.TokenStep(request_id=request_id, token_id=base.NO_TOKEN, logprob=None, finish_reason="abort")


def _logprob(request: Any, index: int) -> float | None:
    values = request.generated_log_probs
    return float(values[index]) if values is not None and index < len(values) else None


def _top_logprobs(request: Any, index: int) -> tuple[tuple[int, float], ...]:
    entries = request.generated_top_n_logprobs
    if not entries or index >= len(entries):
        return ()
    ranked = sorted(((int(key), float(value)) for key, value in entries[index].items()), key=lambda kv: -kv[1])
    return tuple(ranked)
