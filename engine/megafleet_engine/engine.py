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

Pausing (a refit that keeps the running sequences, :mod:`megafleet_engine.pause_point`): the backend
thread parks at a step boundary, inside ``admit`` (a backend with ``keep_modes`` always gets one) or
between batches, with the gate open; the weight version changes on that thread, at the switch, so
every step is stamped with the version that computed it. Weights change only on the backend thread,
parked at a step boundary or idle.

Output delivery: every sequence is enqueued with a *sink* (:data:`Sink`), called once per decode step
with every item of its sequences (:mod:`megafleet_engine.running_batch`); :meth:`Engine.submit` is
the one-sequence async view on top.

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
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, TypeVar

from megafleet_engine import pause_point, refit_staging, running_batch
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
    produced: int = 0  # tokens delivered (backend thread)

    def cancel(self) -> None:
        self.cancelled.set()
        if self.reap is not None:
            self.reap.append(self)  # deque appends are atomic: any thread may cancel


@dataclasses.dataclass(frozen=True)
class Suspended:
    """What a suspend did with the sequences in flight: waited for (``drained``), or ended
    (``aborted``, with the ``aborted_tokens`` they had produced, thrown away)."""

    drained: int = 0
    aborted: int = 0
    aborted_tokens: int = 0


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

    A refit that keeps the running sequences pauses instead (:meth:`pause`, :meth:`switch`,
    :meth:`unpause`); ``weight_kv``, read with the version, is the KV-cache mode they crossed into
    ``weight_version`` with (``None`` after a drain, abort or start). ``staging`` is the backend's
    staging copy (:mod:`megafleet_engine.refit_staging`), set once at start by the engine command.

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
        self._keeps = bool(backend.keep_modes)  # parks inside admit, so it always gets one
        self.weight_kv: vocabulary.KvCacheMode | None = None
        self.pauses = pause_point.PausePoint()
        self.staging = refit_staging.OFF
        self.state: vocabulary.EngineState = "ready" if weight_version is not None else "loading"
        self.last_error: str | None = None
        self._queue: collections.deque[Handle | pause_point.Call | None] = collections.deque()
        self._in_flight = 0
        self._abort_all = False
        self._holding = False  # suspended for a refit: new requests wait at the gate
        self._waiters: list[_Waiter] = []
        self.held = 0
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the queue got an item
        self._idle = threading.Condition(self._lock)  # _in_flight went down
        self._batch = running_batch.RunningBatch(self._ended)  # backend thread only
        self.batches = 0
        self.batch_sizes: list[int] = []
        self.admitted = 0
        self.admissions = 0
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
    def generated_tokens(self) -> int:
        """Tokens delivered over the engine's life."""
        return self._batch.generated_tokens

    @property
    def running(self) -> int:
        """Sequences in the running batch (read without the backend thread's cooperation)."""
        return len(self._batch.open)

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
        return max(queued - len(self._batch.open), 0) + held

    def reserved_tokens(self) -> int:
        """Tokens the running batch may hold in its KV cache: each open sequence's prompt plus its
        ``max_tokens`` (read without the backend thread's cooperation, at scrape time only)."""
        handles = list(self._batch.open.values())  # one C-level copy under the GIL; the thread may move on
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
        reap = self._batch.cancelled
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

    async def suspend(
        self, mode: vocabulary.SuspendMode, *, timeout_seconds: float = 60.0, hold: bool = False
    ) -> Suspended:
        """Close the gate and stop admission; drain (wait for) or abort every request in flight,
        then let the backend free what the KV-cache mode frees during a refit.

        ``hold``: the suspend is for a refit that resumes soon, so requests arriving meanwhile wait
        at the gate (up to ``refit_wait_seconds``) instead of being refused."""
        aborted: list[Handle] = []
        with self._lock:
            in_flight, tokens_before = self._in_flight, self._batch.aborted_tokens
            if self.state in ("ready", "suspended"):
                self.state = "suspended"
                self._holding = hold
                if not hold:
                    self._wake()  # a hold turned into a plain suspend: waiters answer now
            self._abort_all = mode == "abort"
            if self._abort_all:  # accepted but not started: end them here, they never run
                aborted = self._drop_queued()
        _end(aborted, lambda: Aborted("request aborted by a suspend for refit"))
        with self._idle:
            busy = self._in_flight > 0
        if busy:  # else nothing to wait for (no thread hop)
            await asyncio.to_thread(self._wait_idle, timeout_seconds)
        mode_now = self.kv_cache_mode
        await self.run_exclusive(lambda: self.backend.begin_weight_update(mode_now))
        if mode == "abort":
            return Suspended(aborted=in_flight, aborted_tokens=self._batch.aborted_tokens - tokens_before)
        return Suspended(drained=in_flight)

    def resume(self, *, weight_version: int | None = None) -> None:
        """Open the gate again, serving ``weight_version`` (unchanged when ``None``).

        The backend's ``finish_weight_update`` is queued ahead of every request accepted from now
        on, so caches are rebuilt (and stale KV dropped) before anything runs on the new weights.
        """
        with self._lock:
            if weight_version is not None and weight_version != self.weight_version:
                self.weight_version = weight_version
                self.weight_kv = None  # nothing was kept across this version change
            if self.weight_version is None:
                raise EngineError("cannot resume an engine that has never received weights")
            self._queue.append(pause_point.Call(self._finish_weight_update))
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
        """Run ``fn`` on the backend thread between batches (weight writes, checkpoint loads), or on
        the parked thread while the engine is paused (:meth:`pause`).

        Not paused, a running batch stops admitting while the call waits, and the call runs once it ends."""
        call = pause_point.Call(fn)
        if not self.pauses.submit(call):
            with self._lock:
                self._queue.append(call)
                self._work.notify()
        await asyncio.to_thread(call.done.wait)
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    # -- pausing -------------------------------------------------------------------------------

    async def pause(self, *, timeout_seconds: float = 60.0) -> None:
        """Park the backend thread at its next step boundary (between batches for a backend without
        ``keep_modes``), every running sequence and its KV in place, and return once it is parked;
        the gate stays open. :class:`TimeoutError` leaves the pause asked for (:meth:`unpause`)."""
        try:
            await self.pauses.pause(timeout_seconds, wake=self._notify)
        except pause_point.PauseError as error:
            raise EngineError(str(error)) from None

    @property
    def paused(self) -> bool:
        """Whether the backend thread is parked by :meth:`pause`."""
        return self.pauses.parked

    async def switch(
        self, version: int, kv_cache_mode: vocabulary.KvCacheMode, *, staged: bool, timeout_seconds: float = 60.0
    ) -> pause_point.Paused:
        """The last call of a pause: ``staged``, copy the staging copy into the live weights on the
        parked thread (if that raises, the engine stays parked); then serve ``version`` from the next
        step on (set on the backend thread), the backend applying ``kv_cache_mode`` to the running
        sequences (:class:`~megafleet_engine.backends.base.Switch`). Returns once it did, with the stall."""
        order = pause_point.SwitchOrder(version, kv_cache_mode, staged)
        try:
            return await self.pauses.switch(order, self.backend.commit_staged if staged else None, timeout_seconds)
        except pause_point.PauseError as error:
            raise EngineError(str(error)) from None

    def unpause(self, *, error: str | None = None) -> None:
        """Release a paused engine without a switch (any thread). ``error``: weights were written, so
        the kept sequences end with :class:`EngineError` (``error``) and those queued meanwhile with
        :class:`NotServing`; else they all go on with the weights they started with."""
        withdrawn = self.pauses.withdraw()  # asked for but not parked yet: nothing was written
        with self._lock:
            self._queue.extend(withdrawn)
            self._work.notify()
        self.pauses.release(pause_point.Release(error=error))

    def _notify(self) -> None:
        """Wake an idle backend thread to look at its queue and the pause point."""
        with self._lock:
            self._work.notify()

    def close(self) -> None:
        self.unpause(error="the engine is closing")
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
                while not self._queue and not self.pauses.requested:
                    self._work.wait()
                if self.pauses.requested:
                    first: Handle | pause_point.Call | bool | None = True
                else:
                    first = self._queue.popleft()
                batch: list[Handle] = []
                if isinstance(first, Handle):
                    batch.append(first)
                    while len(batch) < self.max_batch_size and self._queue and isinstance(self._queue[0], Handle):
                        batch.append(self._queue.popleft())  # type: ignore[arg-type]
            if first is None:
                return
            if first is True:
                self._park_between_batches()
            elif isinstance(first, pause_point.Call):
                first.run()
            else:
                self._generate(batch)

    def _park_between_batches(self) -> None:
        """Stop here for a pause with no batch running, and apply what it ends with."""
        switch = self._parked(0, between_batches=True)
        try:
            if switch is not None:
                self.backend.switch_weights(switch)
        except Exception:
            log.exception("the backend failed to switch weights between batches")
        self.pauses.settle_switch()

    def _parked(self, kept: int, *, between_batches: bool) -> base.Switch | None:
        """Park for the pause asked for (backend thread) and go on as its release says: with the new
        weight version stamped from now on (the backend's switch returned), or without a switch,
        failing what was kept and queued when the weights were partly written."""
        release = self.pauses.park(kept, between_batches=between_batches)
        if release.switch is not None:
            with self._lock:
                self.weight_version = release.switch.version
                self.weight_kv = release.switch.kv_cache_mode
                if self.state != "ready":  # a refit of a loading or stale engine that kept nothing
                    self.state = "ready"
                    self._holding = False
                    self._wake()
            return self.pauses.backend_switch(release.switch)
        if release.error is not None:  # the weights are partly written: nothing may run on them
            self._batch.fail_all(EngineError(release.error), told=False)
            self._batch.flush()
            with self._lock:
                failed, state = self._drop_queued(), self.state
            _end(failed, lambda: NotServing(state))
        return None

    def _drop_queued(self) -> list[Handle]:
        """Take every sequence accepted but not started out of the queue (call with the lock held)."""
        dropped = [item for item in self._queue if isinstance(item, Handle)]
        kept = [item for item in self._queue if not isinstance(item, Handle)]
        self._queue.clear()
        self._queue.extend(kept)
        self._in_flight -= len(dropped)
        self._idle.notify_all()
        return dropped

    def _admit(self, capacity: int) -> base.Admission:
        """Between two steps of a running batch: park for a pause (a backend that keeps sequences),
        close what was cancelled or aborted, and hand the backend up to ``capacity`` waiting
        sequences unless admission is stopped."""
        batch = self._batch
        switch = self._parked(len(batch.open), between_batches=False) if self.pauses.requested and self._keeps else None
        batch.reap(abort_all=self._abort_all)
        leave = batch.take_leaving()
        room = min(capacity, self.max_batch_size - len(batch.open))
        joining: list[Handle] = []
        if room > 0:
            with self._lock:
                if self.state == "ready" and not self._abort_all:
                    while len(joining) < room and self._queue and isinstance(self._queue[0], Handle):
                        joining.append(self._queue.popleft())  # type: ignore[arg-type]
        batch.flush()
        if not joining:
            return base.Admission(leave=leave, switch=switch)
        self.admitted += len(joining)
        self.admissions += 1
        self.batch_sizes[-1] += len(joining)
        join = tuple(batch.open_sequence(pending) for pending in joining)
        return base.Admission(join=join, leave=leave, switch=switch)

    def _generate(self, handles: list[Handle]) -> None:
        self.batches += 1
        self.batch_sizes.append(len(handles))
        batch = self._batch
        batch.start()
        requests = [batch.open_sequence(pending) for pending in handles]
        if self.continuous or self._keeps:
            produced = self.backend.generate(requests, admit=self._admit)
        else:
            produced = self.backend.generate(requests)
        try:
            for steps in produced:
                self.pauses.settle_switch()  # the first step after a switch the backend did not report
                batch.take(steps, abort_all=self._abort_all)
                if not batch.open:
                    break
        except Exception as error:
            log.exception("generation failed for a batch of %d", self.batch_sizes[-1])
            batch.fail_all(EngineError(f"generation failed: {error}"), told=True)
        finally:
            produced.close()  # let the backend wind the batch down now
            self.pauses.settle_switch()  # a switch handed over at the batch's last boundary
        batch.fail_all(EngineError("generation ended early"), told=True)  # the backend ended without a final step
        batch.flush()
        batch.start()

    def _ended(self) -> None:
        """One sequence of the running batch ended (backend thread)."""
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()


def _end(handles: list[Handle], error: Callable[[], BaseException]) -> None:
    """End sequences that never ran, each with its own ``error()``."""
    for pending in handles:
        pending.done = True
    running_batch.send([(pending, error()) for pending in handles])


def _put_all(queue: asyncio.Queue[base.TokenStep | BaseException], items: list[Item]) -> None:
    for _, item in items:
        queue.put_nowait(item)
