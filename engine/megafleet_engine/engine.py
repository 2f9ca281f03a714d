"""The engine core: a request scheduler that batches concurrent sequences onto one backend, the
engine state machine (loading, ready, suspended, stale, failed) and the weight version.

Called by the OpenAI frontend (:meth:`Engine.submit`) and by the agent (state, suspend/resume,
weight updates). One background thread owns the backend: it takes every waiting sequence (up to
``max_batch_size``) as one batch, and it is the only thread that touches the model, so generation
and weight writes never overlap.

Continuous batching: when the backend supports it (``backend.supports_admission``), sequences that
arrive while a batch runs join it between two decode steps (the backend calls the scheduler's
``admit``; see :class:`~megafleet_engine.backends.base.Admission`), and sequences the scheduler
closes early (client gone, suspend in abort mode) leave it. Admission stops while the engine is not
``ready`` (a suspend is pending or done) and while a backend call (:meth:`Engine.run_exclusive`, a
weight write) or shutdown waits in the queue, so the running batch drains and the call runs next.
Otherwise the next batch starts as soon as the running one ends.

Output delivery: every sequence is enqueued with a *sink* (:data:`Sink`), and the backend thread
calls each sink once per decode step with every item for its sequences (one call per step, not one
per token): the OpenAI frontend's in-process client hands a request's step to its event loop in one
hop, and the engine core's IPC server (:mod:`megafleet_engine.core_ipc.core`) turns a step into one
message per API-server process. :meth:`Engine.submit` is the one-sequence async view on top.

Holding at the gate: a suspend *for a refit* (``suspend(..., hold=True)``, what a refit attempt
does) keeps the gate closed but makes new requests wait there instead of answering
:class:`NotServing`: each waits (on an asyncio future woken by :meth:`Engine.resume` or
:meth:`Engine.mark`, no polling) for at most ``refit_wait_seconds`` and then enters the queue
behind the backend's cache rebuild, so it runs on the new weights. Waiting requests are not in
flight: a drain waits only for what was accepted before the suspend, and an abort-mode suspend
never aborts them. A refit that fails (``stale``/``failed``) or a wait past the bound answers
:class:`NotServing` as before; a client that goes away while waiting is simply dropped. Other
suspends (fencing a stale shard, draining before removal) and ``loading``/``stale``/``failed``
engines answer at once: nothing they could wait for is known to come soon.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from megafleet_engine.backends import base
from megafleet_protocol import vocabulary

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineError(RuntimeError):
    """Base of the engine's own errors."""


class NotServing(EngineError):
    """The engine does not accept requests now (loading, suspended, stale or failed); ``waited``:
    seconds the request was held at the gate for a refit that did not end in time."""

    def __init__(self, state: vocabulary.EngineState, *, waited: float | None = None) -> None:
        detail = "" if waited is None else f" (held {waited:.0f} s for a refit that did not finish)"
        super().__init__(f"the engine is {state} and does not accept requests{detail}")
        self.state = state
        self.waited = waited


class Aborted(EngineError):
    """A request was aborted by a suspend in abort mode."""


Item = tuple[Any, "base.TokenStep | BaseException"]
"""What a sink receives per sequence: the tag it was enqueued with, and its next token or its error."""
Sink = Callable[[list[Item]], None]
"""Called with every item of one step for the sequences enqueued with it: from the backend thread
once per step, or from the suspending thread for sequences an abort-mode suspend ends before they
ran. Must be quick and thread-safe (hand the items over; never block)."""


@dataclasses.dataclass(eq=False)
class Handle:
    """One enqueued sequence: :meth:`cancel` stops it at the next step (its sink gets ``Aborted``
    unless it already finished)."""

    request: base.SequenceRequest
    sink: Sink
    tag: Any
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    key: str = ""  # the id the backend sees: the request's own, or an alias if that is taken
    done: bool = False  # ended (finished, failed or aborted): its sink got its last item or gets it now
    reap: collections.deque[Handle] | None = None  # the engine's cancellations, read once per step

    def cancel(self) -> None:
        self.cancelled.set()
        if self.reap is not None:
            self.reap.append(self)  # deque appends are atomic: any thread may cancel


@dataclasses.dataclass
class _Call:
    """Work for the backend thread other than generation (weight writes, cache rebuilds)."""

    fn: Callable[[], object]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


@dataclasses.dataclass(eq=False)
class _Waiter:
    """One entry held at the gate: the event loop and future that wake it, and how many sequences
    it queues once the gate opens (what the waiting-sequences gauge counts)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    sequences: int


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Engine:
    """Serve one backend: batch requests, gate them by state, stamp the weight version.

    ``weight_version`` is ``None`` until weights are loaded (deferred init: state ``loading``
    until the first refit finishes). A response is always produced by one weight version: a
    suspend closes the gate, stops admission and waits for (drain) or aborts (abort) everything in
    flight before weights may change. ``kv_cache_mode`` (default: the backend's ``kv_cache_mode``)
    is passed to the backend's ``begin_weight_update`` at the end of a
    suspend and to its ``finish_weight_update`` on resume, before any later request runs.

    ``refit_wait_seconds`` bounds how long a request waits at the gate while the engine is
    suspended for a refit (0: answer :class:`NotServing` at once); ``held`` counts the sequences
    that waited and ``held_now`` those waiting now (a multi-prompt request or a batch of requests
    queued at once counts each of its sequences).

    ``generated_tokens`` counts tokens delivered and ``running`` is the number of sequences in the
    running batch (the metrics read both at scrape time). ``batches`` counts backend batches and
    ``batch_sizes`` the sequences each one served (those admitted while it ran included);
    ``admitted`` counts sequences that joined a running batch and ``admissions`` the steps at which
    at least one joined.
    """

    def __init__(
        self,
        backend: base.Backend,
        *,
        max_batch_size: int = 64,
        weight_version: int | None = 0,
        kv_cache_mode: vocabulary.KvCacheMode | None = None,
        refit_wait_seconds: float = 60.0,
    ) -> None:
        self.backend = backend
        self.refit_wait_seconds = refit_wait_seconds
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.kv_cache_mode: vocabulary.KvCacheMode = backend.kv_cache_mode if kv_cache_mode is None else kv_cache_mode
        self.continuous = backend.supports_admission
        self.state: vocabulary.EngineState = "ready" if weight_version is not None else "loading"
        self.last_error: str | None = None
        self._queue: collections.deque[Handle | _Call | None] = collections.deque()
        self._in_flight = 0
        self._abort_all = False
        self._holding = False  # suspended for a refit: new requests wait at the gate
        self._waiters: list[_Waiter] = []
        self.held = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the queue got an item
        self._idle = threading.Condition(self._lock)  # _in_flight went down
        # The running batch (backend thread only): open sequences by the id the backend sees, and
        # the ids closed early that the backend has not been told about yet.
        self._open: dict[str, Handle] = {}
        self._leaving: set[str] = set()
        self._aliases = itertools.count()
        self.batches = 0
        self.batch_sizes: list[int] = []
        self.admitted = 0
        self.admissions = 0
        self.generated_tokens = 0
        self._outbox: list[tuple[Handle, base.TokenStep | BaseException]] = []  # backend thread only
        # Handles cancelled since the backend thread last looked (any thread appends; the backend
        # thread closes them once per step), so no step scans every open sequence for a flag.
        self._cancelled: collections.deque[Handle] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="megafleet-engine", daemon=True)
        self._thread.start()

    # -- requests ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Sequences accepted but not finished."""
        with self._lock:
            return self._in_flight

    @property
    def accepting(self) -> bool:
        """Whether a request sent now will be served: ``ready``, or suspended for a refit with
        holding on (it waits at the gate for the new version)."""
        with self._lock:
            return self.state == "ready" or self._holds()

    @property
    def running(self) -> int:
        """Sequences in the running batch (read without the backend thread's cooperation)."""
        return len(self._open)

    @property
    def held_now(self) -> int:
        """Requests waiting at the gate now."""
        with self._lock:
            return sum(waiter.sequences for waiter in self._waiters)

    @property
    def waiting(self) -> int:
        """Sequences accepted and not yet in the running batch, plus sequences held at the gate
        (what an autoscaler reads as queue pressure; read at scrape time, never exact)."""
        with self._lock:
            queued = self._in_flight
            held = sum(waiter.sequences for waiter in self._waiters)
        return max(queued - len(self._open), 0) + held

    def reserved_tokens(self) -> int:
        """Tokens the running batch may hold in its KV cache: each open sequence's prompt plus its
        ``max_tokens`` (read without the backend thread's cooperation, at scrape time only)."""
        handles = list(self._open.values())  # one C-level copy under the GIL; the thread may move on
        return sum(len(h.request.prompt_token_ids) + h.request.params.max_tokens for h in handles)

    async def submit(self, request: base.SequenceRequest) -> AsyncGenerator[base.TokenStep, None]:
        """Stream the generated tokens of one sequence; raises :class:`NotServing` at the gate
        (after holding it up to ``refit_wait_seconds`` while suspended for a refit).

        Cancelling the consumer (client disconnect) stops the sequence at the next step, or drops
        it from the gate while it waits.
        """
        loop = asyncio.get_running_loop()
        steps: asyncio.Queue[base.TokenStep | BaseException] = asyncio.Queue()

        def sink(items: list[Item]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
                loop.call_soon_threadsafe(_put_all, steps, items)

        [handle] = await self.enqueue([(None, request)], sink)
        try:
            while True:
                item = await steps.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            handle.cancel()

    async def enqueue(self, entries: Sequence[tuple[Any, base.SequenceRequest]], sink: Sink) -> list[Handle]:
        """Queue every ``(tag, request)`` of ``entries`` at once, behind the gate (held while
        suspended for a refit, as :meth:`submit`); their tokens go to ``sink`` once per step, tagged.

        Raises :class:`NotServing` for all of them at the gate; nothing is queued then."""
        reap = self._cancelled
        handles = [Handle(request, sink, tag, reap=reap) for tag, request in entries]
        await self._enter(handles)
        return handles

    async def _enter(self, handles: list[Handle]) -> None:
        """Queue ``handles`` once the gate is open; hold them while suspended for a refit."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + self.refit_wait_seconds
        counted = False
        while True:
            with self._lock:
                if self.state == "ready":
                    self._in_flight += len(handles)
                    self._queue.extend(handles)
                    self._work.notify()
                    return
                if not self._holds():
                    raise NotServing(self.state, waited=time.monotonic() - started if counted else None)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotServing(self.state, waited=time.monotonic() - started)
                future: asyncio.Future[None] = loop.create_future()
                waiter = _Waiter(loop, future, len(handles))
                self._waiters.append(waiter)
                if not counted:
                    self.held += len(handles)
                    counted = True
            try:
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                with self._lock:
                    state = self.state
                raise NotServing(state, waited=time.monotonic() - started) from None
            finally:
                with self._lock:
                    if waiter in self._waiters:
                        self._waiters.remove(waiter)

    def _holds(self) -> bool:
        """Suspended for a refit with a wait allowed (call with the lock held)."""
        return self.state == "suspended" and self._holding and self.refit_wait_seconds > 0

    def _wake(self) -> None:
        """Wake every request waiting at the gate to look again (call with the lock held)."""
        for waiter in self._waiters:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
                waiter.loop.call_soon_threadsafe(_settle, waiter.future)

    # -- state ---------------------------------------------------------------------------------

    async def suspend(self, mode: vocabulary.SuspendMode, *, timeout_seconds: float = 60.0, hold: bool = False) -> None:
        """Close the gate and stop admission; drain (wait for) or abort every request in flight,
        then let the backend free what the KV-cache mode frees during a refit.

        ``hold``: the suspend is for a refit that resumes soon, so requests arriving meanwhile wait
        at the gate (up to ``refit_wait_seconds``) instead of being refused."""
        aborted: list[Handle] = []
        with self._lock:
            if self.state in ("ready", "suspended"):
                self.state = "suspended"
                self._holding = hold
                if not hold:
                    self._wake()  # a hold turned into a plain suspend: waiters answer now
            self._abort_all = mode == "abort"
            if self._abort_all:  # accepted but not started: end them here, they never run
                aborted = [item for item in self._queue if isinstance(item, Handle)]
                kept = [item for item in self._queue if not isinstance(item, Handle)]
                self._queue.clear()
                self._queue.extend(kept)
                self._in_flight -= len(aborted)
                self._idle.notify_all()
        for pending in aborted:
            pending.done = True
        _send([(pending, Aborted("request aborted by a suspend for refit")) for pending in aborted])
        with self._idle:
            busy = self._in_flight > 0
        if busy:  # else nothing to wait for (no thread hop)
            await asyncio.to_thread(self._wait_idle, timeout_seconds)
        mode_now = self.kv_cache_mode
        await self.run_exclusive(lambda: self.backend.begin_weight_update(mode_now))

    def resume(self, *, weight_version: int | None = None) -> None:
        """Open the gate again, serving ``weight_version`` (unchanged when ``None``).

        The backend's ``finish_weight_update`` is queued ahead of every request accepted from now
        on, so caches are rebuilt (and stale KV dropped) before anything runs on the new weights.
        """
        with self._lock:
            if weight_version is not None:
                self.weight_version = weight_version
            if self.weight_version is None:
                raise EngineError("cannot resume an engine that has never received weights")
            self._queue.append(_Call(self._finish_weight_update))
            self._work.notify()
            self.state = "ready"
            self._abort_all = False
            self._holding = False
            self._wake()  # queued behind the cache rebuild above: they run on the new weights

    def mark(self, state: vocabulary.EngineState, error: str | None = None) -> None:
        """Set ``stale`` or ``failed`` (with the reason) from the agent."""
        with self._lock:
            self.state = state
            self._holding = False
            if error is not None:
                self.last_error = error
            self._wake()  # held requests answer NotServing now, not at their deadline

    async def run_exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the backend thread between batches (weight writes, checkpoint loads).

        A running batch stops admitting while the call waits, and the call runs once it ends."""
        call = _Call(fn)
        with self._lock:
            self._queue.append(call)
            self._work.notify()
        await asyncio.to_thread(call.done.wait)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            self._queue.append(None)
            self._work.notify()
        self._thread.join(timeout=10)

    # -- backend thread ------------------------------------------------------------------------

    def _finish_weight_update(self) -> None:
        try:
            self.backend.finish_weight_update(self.kv_cache_mode)
        except Exception as error:
            log.exception("rebuilding the backend's caches after a refit failed")
            self.mark("failed", f"rebuilding caches after a refit failed: {error}")
            raise

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
            with self._work:
                while not self._queue:
                    self._work.wait()
                first = self._queue.popleft()
                batch: list[Handle] = []
                if isinstance(first, Handle):
                    batch.append(first)
                    while len(batch) < self.max_batch_size and self._queue and isinstance(self._queue[0], Handle):
                        batch.append(self._queue.popleft())  # type: ignore[arg-type]
            if first is None:
                return
            if isinstance(first, _Call):
                self._execute(first)
            else:
                self._generate(batch)

    def _execute(self, call: _Call) -> None:
        try:
            call.result = call.fn()
        except BaseException as error:  # handed to the awaiting coroutine
            call.error = error
        finally:
            call.done.set()

    def _open_sequence(self, pending: Handle) -> base.SequenceRequest:
        """Register ``pending`` in the running batch; the request as the backend sees it."""
        key = pending.request.request_id
        if key in self._open:  # two live requests share an id: give the backend a unique one
            key = f"{key}#megafleet-{next(self._aliases)}"
        pending.key = key
        self._open[key] = pending
        if pending.cancelled.is_set():  # cancelled while queued: its reap may have passed already
            self._cancelled.append(pending)
        if key == pending.request.request_id:
            return pending.request
        return dataclasses.replace(pending.request, request_id=key)

    def _admit(self, capacity: int) -> base.Admission:
        """Between two steps of a running batch: close what was cancelled or aborted, and hand the
        backend up to ``capacity`` waiting sequences unless admission is stopped."""
        self._reap()
        leave, self._leaving = self._leaving, set()
        room = min(capacity, self.max_batch_size - len(self._open))
        joining: list[Handle] = []
        if room > 0:
            with self._lock:
                if self.state == "ready" and not self._abort_all:
                    while len(joining) < room and self._queue and isinstance(self._queue[0], Handle):
                        joining.append(self._queue.popleft())  # type: ignore[arg-type]
        self._flush()
        if not joining:
            return base.Admission(leave=leave)
        self.admitted += len(joining)
        self.admissions += 1
        self.batch_sizes[-1] += len(joining)
        return base.Admission(join=tuple(self._open_sequence(pending) for pending in joining), leave=leave)

    def _generate(self, batch: list[Handle]) -> None:
        self.batches += 1
        self.batch_sizes.append(len(batch))
        self._open = {}
        self._leaving = set()
        requests = [self._open_sequence(pending) for pending in batch]
        if self.continuous:
            produced = self.backend.generate(requests, admit=self._admit)
        else:
            produced = self.backend.generate(requests)
        try:
            for steps in produced:
                self._take(steps)
                if not self._open:
                    break
        except Exception as error:
            log.exception("generation failed for a batch of %d", self.batch_sizes[-1])
            for pending in list(self._open.values()):
                self._close(pending, EngineError(f"generation failed: {error}"), told=True)
        finally:
            produced.close()  # let the backend wind the batch down now
        for pending in list(self._open.values()):  # the backend ended without a final step
            self._close(pending, EngineError("generation ended early"), told=True)
        self._flush()
        self._leaving = set()

    def _reap(self) -> None:
        """Close the open sequences cancelled since the last look, or every open one while a
        suspend aborts (backend thread, once per step: no per-sequence scan)."""
        reap = self._cancelled
        while reap:
            pending = reap.popleft()
            if self._open.get(pending.key) is pending:
                self._close(pending, Aborted("request cancelled"))
        if self._abort_all:
            for pending in list(self._open.values()):
                self._close(pending, Aborted("request aborted by a suspend for refit"))

    def _take(self, steps: list[base.TokenStep]) -> None:
        """Deliver one decode step's tokens to their open sequences: one sink call per sink.

        Per token this is one dict lookup and one append; cancellations and aborts are settled
        once for the whole step (:meth:`_reap`) before any token of it is handed over."""
        self._reap()
        opened = self._open
        outbox = self._outbox
        delivered = 0
        for step in steps:
            pending = opened.get(step.request_id)
            if pending is None:
                continue  # closed early; the backend learns it at the next admit
            finish = step.finish_reason
            if finish is None:
                if pending.key is not pending.request.request_id:  # an alias: the client's id back
                    step = msgspec.structs.replace(step, request_id=pending.request.request_id)
                outbox.append((pending, step))
                delivered += 1
            elif finish == "abort" and step.token_id == base.NO_TOKEN:
                self._close(pending, EngineError("the backend could not run this sequence"), told=True)
            else:
                if pending.key is not pending.request.request_id:
                    step = msgspec.structs.replace(step, request_id=pending.request.request_id)
                outbox.append((pending, step))
                delivered += 1
                self._close(pending, None, told=True)
        self.generated_tokens += delivered
        self._flush()

    def _deliver(self, pending: Handle, item: base.TokenStep | BaseException) -> None:
        """Hold ``item`` for the step's one call to the sequence's sink (:meth:`_flush`)."""
        self._outbox.append((pending, item))

    def _flush(self) -> None:
        """Hand the step's items to their sinks, one call per sink (backend thread)."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            _send(items)

    def _close(self, pending: Handle, error: BaseException | None, *, told: bool = False) -> None:
        """End one open sequence of the running batch (``told``: the backend already ended it)."""
        if self._open.pop(pending.key, None) is None:
            return
        pending.done = True
        if not told:
            self._leaving.add(pending.key)
        if error is not None:
            self._deliver(pending, error)
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()


def _send(items: list[tuple[Handle, base.TokenStep | BaseException]]) -> None:
    """Call each sink once with its sequences' items, in order; a failing sink is logged and skipped.

    Consecutive items mostly share a sink (one request's sequences, one API server's), so the
    grouping looks a sink up only when it changes."""
    grouped: dict[int, tuple[Sink, list[Item]]] = {}
    last: Sink | None = None
    batch: list[Item] = []
    for handle, item in items:
        sink = handle.sink
        if sink is not last:
            entry = grouped.get(id(sink))
            if entry is None:
                entry = grouped[id(sink)] = (sink, [])
            last, batch = sink, entry[1]
        batch.append((handle.tag, item))
    for sink, batch in grouped.values():
        try:
            sink(batch)
        except Exception:
            log.exception("an output sink failed; its %d items are dropped", len(batch))


def _put_all(queue: asyncio.Queue[base.TokenStep | BaseException], items: list[Item]) -> None:
    for _, item in items:
        queue.put_nowait(item)
