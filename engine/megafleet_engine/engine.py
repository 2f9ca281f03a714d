"""The engine core: a request scheduler that batches concurrent sequences onto one backend, the
engine state machine (loading, ready, suspended, stale, failed) and the weight version.

Called by the OpenAI frontend (:meth:`Engine.submit`) and by the agent (state, suspend/resume,
weight updates). One background thread owns the backend: it takes every waiting sequence (up to
``max_batch_size``) as one batch, so requests that arrive together are decoded together, and it is
the only thread that touches the model, so generation and weight writes never overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal, TypeVar

from megafleet_engine.backends import base

log = logging.getLogger(__name__)

State = Literal["loading", "ready", "suspended", "stale", "failed"]
SuspendMode = Literal["drain", "abort"]
T = TypeVar("T")


class EngineError(RuntimeError):
    """Base of the engine's own errors."""


class NotServing(EngineError):
    """The engine does not accept requests now (loading, suspended, stale or failed)."""

    def __init__(self, state: State) -> None:
        super().__init__(f"the engine is {state} and does not accept requests")
        self.state = state


class Aborted(EngineError):
    """A request was aborted by a suspend in abort mode."""


@dataclasses.dataclass
class _Pending:
    request: base.SequenceRequest
    loop: asyncio.AbstractEventLoop
    steps: asyncio.Queue[base.TokenStep | BaseException]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class _Call:
    """Work for the backend thread other than generation (weight writes, cache rebuilds)."""

    fn: Callable[[], object]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class Engine:
    """Serve one backend: batch requests, gate them by state, stamp the weight version.

    ``weight_version`` is ``None`` until weights are loaded (deferred init: state ``loading``
    until the first refit finishes). A response is always produced by one weight version: a
    suspend closes the gate and waits for (drain) or aborts (abort) everything in flight before
    weights may change.
    """

    def __init__(self, backend: base.Backend, *, max_batch_size: int = 64, weight_version: int | None = 0) -> None:
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.state: State = "ready" if weight_version is not None else "loading"
        self.last_error: str | None = None
        self._waiting: queue.Queue[_Pending | _Call | None] = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="megafleet-engine", daemon=True)
        self._thread.start()
        self.batches = 0
        self.batch_sizes: list[int] = []

    # -- requests ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Sequences accepted but not finished."""
        with self._lock:
            return self._in_flight

    async def submit(self, request: base.SequenceRequest) -> AsyncIterator[base.TokenStep]:
        """Stream the generated tokens of one sequence; raises :class:`NotServing` at the gate.

        Cancelling the consumer (client disconnect) stops the sequence at the next step.
        """
        with self._lock:
            if self.state != "ready":
                raise NotServing(self.state)
            self._in_flight += 1
        pending = _Pending(request, asyncio.get_running_loop(), asyncio.Queue())
        self._waiting.put(pending)
        try:
            while True:
                item = await pending.steps.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            pending.cancelled.set()

    # -- state ---------------------------------------------------------------------------------

    async def suspend(self, mode: SuspendMode, *, timeout_seconds: float = 60.0) -> None:
        """Close the gate; drain (wait for) or abort every request in flight."""
        with self._lock:
            if self.state == "ready":
                self.state = "suspended"
            self._abort_all = mode == "abort"
        await asyncio.to_thread(self._wait_idle, timeout_seconds)

    def resume(self, *, weight_version: int | None = None) -> None:
        """Open the gate again, serving ``weight_version`` (unchanged when ``None``)."""
        with self._lock:
            if weight_version is not None:
                self.weight_version = weight_version
            if self.weight_version is None:
                raise EngineError("cannot resume an engine that has never received weights")
            self.state = "ready"
            self._abort_all = False

    def mark(self, state: State, error: str | None = None) -> None:
        """Set ``stale`` or ``failed`` (with the reason) from the agent."""
        with self._lock:
            self.state = state
            if error is not None:
                self.last_error = error

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the backend thread between batches (weight writes, checkpoint loads)."""
        call = _Call(fn)
        self._waiting.put(call)
        await asyncio.to_thread(call.done.wait)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=10)

    # -- backend thread ------------------------------------------------------------------------

    _abort_all = False

    def _wait_idle(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        with self._idle:
            while self._in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{self._in_flight} requests still in flight after {timeout_seconds:.0f} s")
                self._idle.wait(remaining)

    def _run(self) -> None:
        while True:
            first = self._waiting.get()
            if first is None:
                return
            if isinstance(first, _Call):
                self._execute(first)
                continue
            batch = [first]
            while len(batch) < self.max_batch_size:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(item, _Pending):
                    self._waiting.put(item)  # keep calls and shutdown for after this batch
                    break
                batch.append(item)
            self._generate(batch)

    def _execute(self, call: _Call) -> None:
        try:
            call.result = call.fn()
        except BaseException as error:  # handed to the awaiting coroutine
            call.error = error
        finally:
            call.done.set()

    def _generate(self, batch: list[_Pending]) -> None:
        self.batches += 1
        self.batch_sizes.append(len(batch))
        by_id = {pending.request.request_id: pending for pending in batch}
        open_ids = set(by_id)
        try:
            for steps in self.backend.generate([pending.request for pending in batch]):
                for step in steps:
                    pending = by_id[step.request_id]
                    if step.request_id not in open_ids:
                        continue
                    if pending.cancelled.is_set():
                        self._finish(pending, open_ids, Aborted("request cancelled"))
                    elif self._abort_all:
                        self._finish(pending, open_ids, Aborted("request aborted by a suspend for refit"))
                    else:
                        self._deliver(pending, step)
                        if step.finish_reason is not None:
                            self._finish(pending, open_ids, None)
                if not open_ids:
                    break
        except Exception as error:
            log.exception("generation failed for a batch of %d", len(batch))
            for request_id in list(open_ids):
                self._finish(by_id[request_id], open_ids, EngineError(f"generation failed: {error}"))
        for request_id in list(open_ids):  # the backend ended without a final step
            self._finish(by_id[request_id], open_ids, EngineError("generation ended early"))

    def _deliver(self, pending: _Pending, item: base.TokenStep | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
            pending.loop.call_soon_threadsafe(pending.steps.put_nowait, item)

    def _finish(self, pending: _Pending, open_ids: set[str], error: BaseException | None) -> None:
        open_ids.discard(pending.request.request_id)
        if error is not None:
            self._deliver(pending, error)
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()
