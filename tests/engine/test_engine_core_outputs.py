"""One engine step over the core's IPC channel: the core's sink packs a step's tokens as arrays
(:class:`megafleet_engine.core_ipc.messages.Outputs`) and the API server's client unpacks them into
the same token steps, per request, with logprobs, alternatives, finish reasons, failures and the
weight version intact; what cannot be encoded fails its own sequences, never the others and never
silently; and the scheduler's once-per-step cancellation (a handle cancelled while queued still ends
when it opens)."""

from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path
from typing import Any

import zmq

from megafleet_engine import engine as engine_module
from megafleet_engine.backends import base
from megafleet_engine.core_ipc import client as client_module
from megafleet_engine.core_ipc import core, messages

INFO = base.ModelInfo("m", 64, 100, None)
PARAMS = base.SamplingParams(max_tokens=4)


class _Socket:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(data)

    def close(self, linger: int = 0) -> None:
        pass


class _Engine:
    weight_version = 7
    weight_kv = "recompute"


def _pack(items: list[engine_module.Item]) -> messages.Outputs:
    sock = _Socket()
    sink = core._Client(0, 1, sock, _Engine())  # type: ignore[arg-type]
    sink.sink(items)
    [data] = sock.sent
    message = messages.api_decoder.decode(data)
    assert isinstance(message, messages.Outputs)
    return message


def test_a_step_without_logprobs_travels_as_two_int_arrays() -> None:
    items: list[engine_module.Item] = [
        (3, base.TokenStep("a", 11, None)),
        (5, base.TokenStep("b", 12, None, finish_reason="length")),
    ]
    outputs = _pack(items)
    assert (outputs.seqs, outputs.token_ids) == ([3, 5], [11, 12])
    assert outputs.logprobs is None and outputs.tops is None
    assert outputs.finished == [(1, "length")]
    assert (outputs.weight_version, outputs.weight_kv) == (7, "recompute")


def test_the_api_server_gets_back_the_steps_the_core_sent(tmp_path: Path) -> None:
    asyncio.run(_round_trip(tmp_path))


async def _round_trip(tmp_path: Path) -> None:
    client = client_module.CoreClient(
        epoch=1,
        core_address=f"ipc://{tmp_path}/core",
        own_address=f"ipc://{tmp_path}/own",
        info=INFO,
        state="ready",
        weight_version=7,
        accepting=True,
    )
    try:
        requests = [base.SequenceRequest(name, (1, 2), PARAMS) for name in ("a", "b", "c")]
        first = await client.submit(requests[:2])
        second = await client.submit(requests[2:])
        sent: dict[str, base.TokenStep] = {
            "a": base.TokenStep("a", 11, -0.5, ((11, -0.5), (4, -1.5))),
            "b": base.TokenStep("b", 12, None, finish_reason="stop"),
        }
        items: list[engine_module.Item] = [
            (0, sent["a"]),
            (1, sent["b"]),
            (2, engine_module.Aborted("request cancelled")),
        ]
        client._deliver(_pack(items))
        got = await first.next()
        assert got == [(0, sent["a"]), (1, sent["b"])]
        assert first.weight_version == 7
        try:
            await second.next()
        except engine_module.Aborted as error:
            assert "cancelled" in str(error)
        else:
            raise AssertionError("the failure did not reach its batch")
    finally:
        client.close()


def test_a_sequence_that_cannot_be_sent_fails_alone(tmp_path: Path) -> None:
    """A number beyond 64 bits (which the frontend refuses, but a client of the engine core could
    pass) fails its own request at once; the request submitted in the same event-loop turn still
    reaches the core. Once, the whole flush failed and both waited forever."""
    asyncio.run(_unsendable(tmp_path))


async def _unsendable(tmp_path: Path) -> None:
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(f"ipc://{tmp_path}/core")
    client = client_module.CoreClient(
        epoch=1,
        core_address=f"ipc://{tmp_path}/core",
        own_address=f"ipc://{tmp_path}/own",
        info=INFO,
        state="ready",
        weight_version=7,
        accepting=True,
    )
    try:
        huge = base.SamplingParams(max_tokens=4, top_k=10**20)
        bad = await client.submit([base.SequenceRequest("bad", (1, 2), huge)])
        good = await client.submit([base.SequenceRequest("good", (1, 2), PARAMS)])
        try:
            await asyncio.wait_for(bad.next(), 5)
        except engine_module.EngineError as error:
            assert "cannot be sent to the engine core" in str(error)
        else:
            raise AssertionError("the unsendable sequence did not fail")
        assert inbox.poll(5000), "the sendable sequence never reached the core"
        message = messages.core_decoder.decode(inbox.recv())
        assert isinstance(message, messages.Submit)
        assert [sequence.request_id for sequence in message.sequences] == ["good"]
        assert good.weight_version is None, "nothing came back for it yet: it is in flight, not failed"
    finally:
        client.close()
        inbox.close(linger=0)
        context.term()


def test_a_step_that_cannot_be_encoded_fails_its_sequences() -> None:
    """The core's sink cannot drop a step silently: if it cannot be encoded, its sequences fail."""
    items: list[engine_module.Item] = [(3, base.TokenStep("a", 10**20, None)), (5, base.TokenStep("b", 12, None))]
    outputs = _pack(items)
    assert outputs.seqs == [] and [failure.seq for failure in outputs.failures] == [3, 5]
    assert all(failure.kind == "error" and "could not be sent" in failure.message for failure in outputs.failures)


class _SteppedBackend(base.InPlaceOnly):
    """Yields one token per open sequence per step, for ``steps`` steps, each step once the test
    releases ``go``; records which sequences it was told left."""

    supports_admission = True
    kv_cache_mode = "persist"
    info = INFO

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.left: list[str] = []
        self.go = threading.Semaphore(0)

    def generate(self, batch: Any, admit: Any = None) -> Any:
        open_ids = [request.request_id for request in batch]
        for step in range(self.steps):
            admission = admit(0)
            self.left.extend(admission.leave)
            open_ids = [key for key in open_ids if key not in admission.leave]
            assert self.go.acquire(timeout=10)
            finish = "length" if step == self.steps - 1 else None
            yield [base.TokenStep(key, step, None, finish_reason=finish) for key in open_ids]  # type: ignore[arg-type]


def test_a_handle_cancelled_while_queued_behind_a_running_batch_ends_at_its_first_step() -> None:
    asyncio.run(_cancelled_while_queued())


async def _cancelled_while_queued() -> None:
    # One sequence per batch: "drop" waits while "keep" runs, is cancelled there, and the steps of
    # "keep" settle the cancellations before "drop" is open; it must still end once it opens.
    backend = _SteppedBackend(steps=3)
    engine = engine_module.Engine(backend, max_batch_size=1)  # type: ignore[arg-type]
    got: collections.defaultdict[Any, list[Any]] = collections.defaultdict(list)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def sink(items: list[engine_module.Item]) -> None:
        def put() -> None:
            for tag, item in items:
                got[tag].append(item)
            if sum(len(entries) for entries in got.values()) >= 4:  # keep: 3 tokens; drop: 1 error
                done.set()

        loop.call_soon_threadsafe(put)

    try:
        entries = [("keep", base.SequenceRequest("k", (1,), PARAMS)), ("drop", base.SequenceRequest("d", (1,), PARAMS))]
        handles = await engine.enqueue(entries, sink)
        handles[1].cancel()
        for _ in range(2 * backend.steps):
            backend.go.release()
        await asyncio.wait_for(done.wait(), 10)
        assert [item.token_id for item in got["keep"]] == [0, 1, 2]
        [error] = got["drop"]
        assert isinstance(error, engine_module.Aborted)
        assert backend.left == ["d"]
        assert engine.generated_tokens == 3
    finally:
        engine.close()
