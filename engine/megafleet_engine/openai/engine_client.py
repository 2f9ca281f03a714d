"""How the OpenAI frontend reaches the engine: :class:`EngineClient`, and the in-process one.

Serving (:mod:`megafleet_engine.openai.serving`) submits the choices of one request as one batch
(:meth:`EngineClient.submit`) and reads their tokens back one engine step at a time
(:meth:`Batch.next`): the engine hands a step's tokens over in one piece, so the event loop wakes
once per step and request, never once per token. Two clients implement the protocol:
:class:`LocalClient` (the engine in this process: tests, benchmarks and ``MEGAFLEET_API_SERVERS=0``)
and :class:`megafleet_engine.core_ipc.client.CoreClient` (an API-server process talking to the engine
core over IPC). Imports no torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base
from megafleet_engine.openai import version_spans
from megafleet_protocol import vocabulary

__all__ = ["Batch", "EngineClient", "LocalClient", "StepItem"]

StepItem = tuple[int, "base.TokenStep | BaseException"]
"""One sequence's item of a step: its index in the batch, and its token or its error."""


class Batch:
    """The sequences of one request in flight; fed one engine step at a time on the event loop.

    ``weight_version`` is the version that produced the batch's first items. Every step comes with
    the version that computed it; :meth:`next` never returns tokens of two versions at once (steps
    queued meanwhile are split where the version changes), :attr:`version` is the version of the
    tokens it returned last, and :meth:`spans` says per sequence which of its tokens came from which
    version (:mod:`~megafleet_engine.openai.version_spans`). ``abort`` tells the engine to stop the
    given indexes (a stop string matched, the client went away)."""

    def __init__(self, size: int, abort: Callable[[list[int]], None]) -> None:
        self.weight_version: int | None = None
        self.version: int | None = None
        self._steps: collections.deque[tuple[int | None, str | None, Sequence[StepItem]]] = collections.deque()
        self._wake = asyncio.Event()
        self._open = set(range(size))
        self._spans = [version_spans.VersionSpans() for _ in range(size)]
        self._abort = abort
        self._started = False

    def push(self, items: Sequence[StepItem], weight_version: int | None, weight_kv: str | None = None) -> None:
        """Add one step's items, computed with ``weight_version``, which kept sequences entered as
        ``weight_kv`` says (the engine's; called on the batch's event loop)."""
        if not self._started:
            self._started = True
            self.weight_version = weight_version
        self._steps.append((weight_version, weight_kv, items))
        self._wake.set()

    async def next(self) -> list[tuple[int, base.TokenStep]] | None:
        """The tokens of the next step(s) for the open sequences, all of one version (then
        :attr:`version`); ``None`` once all finished or stopped. Raises the first error the engine
        gave an open sequence."""
        while self._open:
            if not self._steps:
                self._wake.clear()
                await self._wake.wait()
                continue
            version, kv = self._steps[0][0], self._steps[0][1]
            tokens: list[tuple[int, base.TokenStep]] = []
            while self._steps and self._steps[0][0] == version:
                for index, item in self._steps.popleft()[2]:
                    if index not in self._open:
                        continue  # stopped early: drop what it still had in flight
                    if isinstance(item, BaseException):
                        raise item
                    if item.finish_reason is not None:
                        self._open.discard(index)
                    self._spans[index].add(version, kv=kv)
                    tokens.append((index, item))
            if tokens:
                self.version = version
                return tokens
        return None

    def spans(self, index: int) -> tuple[version_spans.Span, ...]:
        """The version spans of sequence ``index``'s tokens returned so far."""
        return self._spans[index].spans

    def stop(self, index: int) -> None:
        """Stop one sequence early; the others go on."""
        if index in self._open:
            self._open.discard(index)
            self._abort([index])

    def close(self) -> None:
        """Stop every sequence still open (idempotent)."""
        still = sorted(self._open)
        self._open.clear()
        if still:
            self._abort(still)


class EngineClient(Protocol):
    """What serving needs of the engine, wherever it runs."""

    @property
    def info(self) -> base.ModelInfo: ...

    @property
    def weight_version(self) -> int | None: ...

    @property
    def state(self) -> vocabulary.EngineState: ...

    @property
    def accepting(self) -> bool:
        """Whether a request sent now will be served (see :attr:`Engine.accepting`)."""
        ...

    async def submit(self, requests: Sequence[base.SequenceRequest]) -> Batch:
        """Queue ``requests`` as one batch; raises :class:`~megafleet_engine.engine.NotServing`
        at the gate (nothing is queued then)."""
        ...


class LocalClient:
    """The engine in this process: a step's items reach the loop in one ``call_soon_threadsafe``."""

    def __init__(self, engine: engine_module.Engine) -> None:
        self.engine = engine

    @property
    def info(self) -> base.ModelInfo:
        return self.engine.backend.info

    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version

    @property
    def state(self) -> vocabulary.EngineState:
        return self.engine.state

    @property
    def accepting(self) -> bool:
        return self.engine.accepting

    async def submit(self, requests: Sequence[base.SequenceRequest]) -> Batch:
        loop = asyncio.get_running_loop()
        handles: list[engine_module.Handle] = []

        def abort(indexes: list[int]) -> None:
            for index in indexes:
                handles[index].cancel()

        batch = Batch(len(requests), abort)
        engine = self.engine

        def sink(items: list[engine_module.Item]) -> None:  # the backend thread, once per step
            with contextlib.suppress(RuntimeError):  # the loop is closed: the client is gone
                loop.call_soon_threadsafe(batch.push, items, engine.weight_version, engine.weight_kv)

        handles.extend(await engine.enqueue(list(enumerate(requests)), sink))
        return batch
