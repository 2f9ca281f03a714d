"""The batch the backend runs now, as the engine's backend thread keeps it: its open sequences by the
id the backend sees, the ids closed early that the backend has not been told about yet, and the
delivery of every step's items to their sinks (one call per sink per step).

Made once by the engine (:class:`megafleet_engine.engine.Engine`) and used by its backend thread
only, except :attr:`RunningBatch.cancelled`, which any thread appends to (a handle's ``cancel``) and
the backend thread empties once per step, so no step scans every open sequence for a flag. Per token,
delivery is one dict lookup, one counter and one append; cancellations and aborts are settled once
per step (:meth:`RunningBatch.reap`) before any token of it is handed over. A sequence that ends
(finished, failed, aborted) is reported once to ``ended`` (the engine's in-flight count).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable

import msgspec

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base

__all__ = ["RunningBatch", "send"]

log = logging.getLogger(__name__)


class RunningBatch:
    """The open sequences of the running batch and their outbox.

    Args:
        ended: called (backend thread) each time an open sequence ends.
    """

    def __init__(self, ended: Callable[[], None]) -> None:
        self.open: dict[str, engine_module.Handle] = {}
        self.leaving: set[str] = set()
        self.cancelled: collections.deque[engine_module.Handle] = collections.deque()
        self.generated_tokens = 0
        """Tokens delivered, over the engine's life."""
        self.aborted_tokens = 0
        """Tokens of sequences ended by an abort-mode suspend, over the engine's life."""
        self._ended = ended
        self._aliases = itertools.count()
        self._outbox: list[tuple[engine_module.Handle, base.TokenStep | BaseException]] = []

    def start(self) -> None:
        """A new batch begins: nothing is open or leaving."""
        self.open = {}
        self.leaving = set()

    def take_leaving(self) -> set[str]:
        """The ids closed early since the backend was last told (it is told now)."""
        leave, self.leaving = self.leaving, set()
        return leave

    def open_sequence(self, pending: engine_module.Handle) -> base.SequenceRequest:
        """Register ``pending`` in the running batch; the request as the backend sees it."""
        key = pending.request.request_id
        if key in self.open:  # two live requests share an id: give the backend a unique one
            key = f"{key}#megafleet-{next(self._aliases)}"
        pending.key = key
        self.open[key] = pending
        if pending.cancelled.is_set():  # cancelled while queued: its reap may have passed already
            self.cancelled.append(pending)
        if key == pending.request.request_id:
            return pending.request
        return dataclasses.replace(pending.request, request_id=key)

    def reap(self, *, abort_all: bool) -> None:
        """Close the open sequences cancelled since the last look, or every open one while a
        suspend aborts (once per step: no per-sequence scan)."""
        reap = self.cancelled
        while reap:
            pending = reap.popleft()
            if self.open.get(pending.key) is pending:
                self.close(pending, engine_module.Aborted("request cancelled"))
        if abort_all:
            for pending in list(self.open.values()):
                self.aborted_tokens += pending.produced
                self.close(pending, engine_module.Aborted("request aborted by a suspend for refit"))

    def take(self, steps: list[base.TokenStep], *, abort_all: bool) -> None:
        """Deliver one decode step's tokens to their open sequences: one sink call per sink."""
        self.reap(abort_all=abort_all)
        opened = self.open
        outbox = self._outbox
        delivered = 0
        for step in steps:
            pending = opened.get(step.request_id)
            if pending is None:
                continue  # closed early; the backend learns it at the next admit
            finish = step.finish_reason
            if finish is not None and finish == "abort" and step.token_id == base.NO_TOKEN:
                self.close(pending, engine_module.EngineError("the backend could not run this sequence"), told=True)
                continue
            if pending.key is not pending.request.request_id:  # an alias: the client's id back
                step = msgspec.structs.replace(step, request_id=pending.request.request_id)
            outbox.append((pending, step))
            pending.produced += 1
            delivered += 1
            if finish is not None:
                self.close(pending, None, told=True)
        self.generated_tokens += delivered
        self.flush()

    def fail_all(self, error: BaseException, *, told: bool) -> None:
        """End every open sequence with ``error`` (``told``: the backend already ended them)."""
        for pending in list(self.open.values()):
            self.close(pending, error, told=told)

    def flush(self) -> None:
        """Hand the step's items to their sinks, one call per sink."""
        if self._outbox:
            items, self._outbox = self._outbox, []
            send(items)

    def close(self, pending: engine_module.Handle, error: BaseException | None, *, told: bool = False) -> None:
        """End one open sequence (``told``: the backend already ended it)."""
        if self.open.pop(pending.key, None) is None:
            return
        pending.done = True
        if not told:
            self.leaving.add(pending.key)
        if error is not None:
            self._outbox.append((pending, error))
        self._ended()


def send(items: list[tuple[engine_module.Handle, base.TokenStep | BaseException]]) -> None:
    """Call each sink once with its sequences' items, in order; a failing sink is logged and skipped.

    Consecutive items mostly share a sink (one request's sequences, one API server's), so the
    grouping looks a sink up only when it changes."""
    grouped: dict[int, tuple[engine_module.Sink, list[engine_module.Item]]] = {}
    last: engine_module.Sink | None = None
    batch: list[engine_module.Item] = []
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
