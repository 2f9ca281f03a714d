"""The API server's side of the IPC channel: an :class:`~megafleet_engine.openai.engine_client.EngineClient`
for the engine in the core process, and the metrics it forwards there.

Used by :mod:`megafleet_engine.api_server`. Everything runs on the API server's event loop: a
request's sequences become one batch, and what is to be sent (new sequences, aborts, metric
observations) is gathered over one loop turn and sent as one message per kind
(:meth:`CoreClient.flush`). One task reads the core's messages: an :class:`~.messages.Outputs`
(one engine step) is split by request and handed to each request's batch in one piece; a
:class:`~.messages.Status` updates the state and weight version ``/health`` and ``/v1/models`` show.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence

import zmq
import zmq.asyncio

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base
from megafleet_engine.core_ipc import messages
from megafleet_engine.openai import engine_client
from megafleet_protocol import vocabulary

__all__ = ["CoreClient", "ForwardedMetrics"]

log = logging.getLogger(__name__)


def error_of(failure: messages.Failure) -> engine_module.EngineError:
    """The engine error a :class:`~.messages.Failure` stands for."""
    if failure.kind == "not_serving":
        state: vocabulary.EngineState = failure.state  # type: ignore[assignment]
        return engine_module.NotServing(state, waited=failure.waited)
    if failure.kind == "aborted":
        return engine_module.Aborted(failure.message)
    return engine_module.EngineError(failure.message)


class ForwardedMetrics:
    """The frontend's metrics, forwarded to the core once per loop turn (the core serves them)."""

    def __init__(self, client: CoreClient) -> None:
        self._client = client
        self.requests: list[tuple[str, int, float]] = []
        self.first_token: list[float] = []
        self.prompt_tokens = 0

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        """Sent at once: the request's last byte is not sent yet, so the core counts it first."""
        self.requests.append((endpoint, status, seconds))
        self._client.flush()

    def observe_first_token(self, seconds: float) -> None:
        self.first_token.append(seconds)
        self._client.schedule_flush()

    def count_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens += count
        self._client.schedule_flush()

    def take(self, epoch: int) -> messages.Report | None:
        if not (self.requests or self.first_token or self.prompt_tokens):
            return None
        report = messages.Report(epoch, self.requests, self.first_token, self.prompt_tokens)
        self.requests, self.first_token, self.prompt_tokens = [], [], 0
        return report


class CoreClient:
    """The engine core as seen from an API server (see the module docstring).

    Args:
        epoch: this API server's epoch (the core ignores messages of other epochs).
        core_address: the core's PULL socket; own_address: this API server's output socket there.
        info: the model; state, weight_version, accepting: the engine's at this server's start.
    """

    def __init__(
        self,
        *,
        epoch: int,
        core_address: str,
        own_address: str,
        info: base.ModelInfo,
        state: vocabulary.EngineState,
        weight_version: int | None,
        accepting: bool,
    ) -> None:
        self._epoch = epoch
        self._info = info
        self._state: vocabulary.EngineState = state
        self._weight_version = weight_version
        self._accepting = accepting
        self._context = zmq.asyncio.Context()
        self._sync_context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.connect(own_address)
        self._outbox: zmq.Socket[bytes] = self._sync_context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(core_address)
        self._seqs = itertools.count()
        self._open: dict[int, tuple[engine_client.Batch, int, str]] = {}  # seq -> batch, index, request id
        self._new: list[messages.Sequence] = []
        self._aborted: list[int] = []
        self._scheduled = False
        self.metrics = ForwardedMetrics(self)

    @property
    def info(self) -> base.ModelInfo:
        return self._info

    @property
    def weight_version(self) -> int | None:
        return self._weight_version

    @property
    def state(self) -> vocabulary.EngineState:
        return self._state

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def submit(self, requests: Sequence[base.SequenceRequest]) -> engine_client.Batch:
        """Queue ``requests`` as one batch; an error at the engine's gate arrives with the first step."""
        seqs = [next(self._seqs) for _ in requests]
        batch = engine_client.Batch(len(requests), lambda indexes: self._abort([seqs[index] for index in indexes]))
        for index, (seq, request) in enumerate(zip(seqs, requests, strict=True)):
            self._open[seq] = (batch, index, request.request_id)
            self._new.append(messages.Sequence(seq, request.request_id, list(request.prompt_token_ids), request.params))
        self.schedule_flush()
        return batch

    def _abort(self, seqs: list[int]) -> None:
        for seq in seqs:
            if self._open.pop(seq, None) is not None:
                self._aborted.append(seq)
        self.schedule_flush()

    def schedule_flush(self) -> None:
        """Send what this loop turn gathered once the turn ends (one message per kind)."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what was gathered now."""
        self._scheduled = False
        if self._new:
            sequences, self._new = self._new, []
            self._submit(sequences)
        if self._aborted:
            seqs, self._aborted = self._aborted, []
            self._send(messages.Abort(self._epoch, seqs))
        report = self.metrics.take(self._epoch)
        if report is not None:
            self._send(report)

    def _send(self, message: messages.ToCore) -> None:
        self._outbox.send(messages.encoder.encode(message), zmq.NOBLOCK)

    def _submit(self, sequences: list[messages.Sequence]) -> None:
        """Send ``sequences`` to the core in one message. One that cannot be encoded (a number
        beyond 64 bits that validation let through) fails its own request at once, and the others
        are sent without it: a failed flush would leave every request of this loop turn waiting
        for an answer that never comes."""
        try:
            data = messages.encoder.encode(messages.Submit(self._epoch, sequences))
        except Exception:  # which sequence it was is found below; each one is reported
            sendable = [sequence for sequence in sequences if self._encodable(sequence)]
            if not sendable:
                return
            data = messages.encoder.encode(messages.Submit(self._epoch, sendable))
        self._outbox.send(data, zmq.NOBLOCK)

    def _encodable(self, sequence: messages.Sequence) -> bool:
        try:
            messages.encoder.encode(sequence)
        except Exception as error:
            self._fail(sequence.seq, f"the request cannot be sent to the engine core ({error})")
            return False
        return True

    def _fail(self, seq: int, message: str) -> None:
        """End sequence ``seq`` here with an engine error (its request answers 500)."""
        entry = self._open.pop(seq, None)
        if entry is not None:
            batch, index, request_id = entry
            log.error("sequence %s failed before reaching the engine: %s", request_id, message)
            batch.push([(index, engine_module.EngineError(message))], self._weight_version)

    async def run(self) -> None:
        """Read the core's messages until cancelled."""
        while True:
            message = messages.api_decoder.decode(await self._inbox.recv())
            if isinstance(message, messages.Status):
                self._state = message.state  # type: ignore[assignment]
                self._weight_version = message.weight_version
                self._accepting = message.accepting
            else:
                self._deliver(message)

    def _deliver(self, outputs: messages.Outputs) -> None:
        """Split one engine step by request; each batch gets its part in one piece."""
        parts: dict[int, tuple[engine_client.Batch, list[engine_client.StepItem]]] = {}
        opened = self._open
        finishes = dict(outputs.finished)
        logprobs, tops = outputs.logprobs, outputs.tops
        last: engine_client.Batch | None = None
        part: list[engine_client.StepItem] = []
        for position, (seq, token_id) in enumerate(zip(outputs.seqs, outputs.token_ids, strict=True)):
            entry = opened.get(seq)
            if entry is None:
                continue  # aborted here already
            batch, index, request_id = entry
            finish = finishes.get(position) if finishes else None
            if logprobs is None:
                step = base.TokenStep(request_id, token_id, None, (), finish)  # type: ignore[arg-type]
            else:
                top = tops[position] if tops is not None else None
                step = base.TokenStep(request_id, token_id, logprobs[position], tuple(top) if top else (), finish)  # type: ignore[arg-type]
            if finish is not None:
                del opened[seq]
            if batch is not last:
                found = parts.get(id(batch))
                if found is None:
                    found = parts[id(batch)] = (batch, [])
                last, part = batch, found[1]
            part.append((index, step))
        for failed in outputs.failures:
            entry = opened.pop(failed.seq, None)
            if entry is None:
                continue
            batch, index, _ = entry
            found = parts.get(id(batch))
            if found is None:
                found = parts[id(batch)] = (batch, [])
            found[1].append((index, error_of(failed)))
        for batch, items in parts.values():
            batch.push(items, outputs.weight_version, outputs.weight_kv)

    def close(self) -> None:
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._context.term()
        self._sync_context.term()
