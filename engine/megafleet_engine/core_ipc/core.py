"""The engine core's side of the IPC channel, and the supervisor of its API-server processes.

Called by :class:`megafleet_engine.server.EngineServers` on a frontend rank when
``MEGAFLEET_API_SERVERS`` is above 0. :class:`CoreServer` spawns that many API-server processes
(``python -m megafleet_engine.api_server``, so they never import torch or load the model), each
inheriting the frontend's listening socket (the kernel spreads connections over them) and the read
end of a pipe whose write end only this process holds: when the core dies, for whatever reason, the
pipe reads end-of-file and every API server exits at once (never a frontend that accepts requests
nobody will answer). The tokenizer reaches them pickled in a private folder, with their config.

Requests arrive on one PULL socket and enter the engine as one batch per message
(:meth:`~megafleet_engine.engine.Engine.enqueue`); the engine's backend thread calls each API
server's sink once per step, which sends that step's tokens as one :class:`~.messages.Outputs`
message. An API server that exits is restarted (its sequences are cancelled; a new epoch keeps
stale messages apart) unless it failed :data:`RESTART_LIMIT` times within
:data:`RESTART_WINDOW_SECONDS`; then the core logs that the frontend is down and stops restarting
it, and the pod's readiness probe fails (once no API server is left, the frontend port is closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine.backends import base
from megafleet_engine.core_ipc import messages
from megafleet_protocol import http_limits

__all__ = ["RESTART_LIMIT", "RESTART_WINDOW_SECONDS", "CoreServer"]

log = logging.getLogger(__name__)

RESTART_LIMIT = 5
"""Restarts of one API server within :data:`RESTART_WINDOW_SECONDS` after which the core gives up."""
RESTART_WINDOW_SECONDS = 60.0
STATUS_POLL_SECONDS = 0.02
"""How often the core looks for a change of the engine's state or weight version to announce."""
HEARTBEAT_SECONDS = 1.0
"""A status message at least this often, changed or not."""
STOP_SECONDS = 15.0
"""How long a stopping API server may take (its graceful shutdown) before it is killed."""


class _Client:
    """One API-server process: its output socket (the engine's thread and the event loop both send,
    under a lock) and its sequences in the engine."""

    def __init__(self, slot: int, epoch: int, sock: zmq.Socket[bytes], engine: engine_module.Engine) -> None:
        self.slot = slot
        self.epoch = epoch
        self.process: subprocess.Popen[bytes] | None = None
        self.handles: dict[int, engine_module.Handle] = {}
        self.dropped: set[int] = set()  # aborted before the engine accepted them
        self._sock = sock
        self._lock = threading.Lock()
        self._closed = False
        self._engine = engine

    def sink(self, items: list[engine_module.Item]) -> None:
        """One engine step's items for this API server (backend thread): one message, its tokens
        as arrays (a few list appends per token, no object per token)."""
        seqs: list[int] = []
        token_ids: list[int] = []
        logprobs: list[float | None] = []
        tops: list[list[tuple[int, float]] | None] = []
        finished: list[tuple[int, str]] = []
        failures: list[messages.Failure] = []
        any_logprobs = False
        handles = self.handles
        for seq, item in items:
            if isinstance(item, base.TokenStep):
                if item.logprob is not None or item.top_logprobs:
                    any_logprobs = True
                if item.finish_reason is not None:
                    finished.append((len(seqs), item.finish_reason))
                    handles.pop(seq, None)
                seqs.append(seq)
                token_ids.append(item.token_id)
                logprobs.append(item.logprob)
                tops.append(list(item.top_logprobs) if item.top_logprobs else None)
            else:
                failures.append(failure(seq, item))
                handles.pop(seq, None)
        version, kv = self._engine.weight_version, self._engine.weight_kv
        try:
            if any_logprobs:
                self.send(messages.Outputs(version, seqs, token_ids, logprobs, tops, finished, failures, kv))
            else:
                self.send(messages.Outputs(version, seqs, token_ids, None, None, finished, failures, kv))
        except Exception as error:  # unsendable: fail its sequences rather than leave them waiting
            log.exception("API server %d: an engine step could not be sent; failing its sequences", self.slot)
            message = f"the engine's output could not be sent ({type(error).__name__})"
            ended = sorted({seq for seq, _ in items})
            for seq in ended:
                handle = handles.pop(seq, None)
                if handle is not None:
                    handle.cancel()
            self.send(messages.no_tokens(version, [messages.Failure(seq, "error", message) for seq in ended]))

    def send(self, message: messages.ToApiServer) -> None:
        data = messages.encoder.encode(message)
        with self._lock:
            if self._closed:
                return
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.Again:  # no peer: before it connected, or after it exited
                log.debug("API server %d is not connected (yet, or any more); dropped a message", self.slot)

    def close(self) -> None:
        """Stop sending and cancel every sequence it had in the engine."""
        with self._lock:
            self._closed = True
            self._sock.close(linger=0)
        for handle in list(self.handles.values()):
            handle.cancel()
        self.handles.clear()


def failure(seq: int, error: BaseException) -> messages.Failure:
    """The message for an engine error of one sequence."""
    if isinstance(error, engine_module.NotServing):
        return messages.Failure(seq, "not_serving", str(error), error.state, error.waited)
    if isinstance(error, engine_module.Aborted):
        return messages.Failure(seq, "aborted", str(error))
    return messages.Failure(seq, "error", str(error))


@dataclasses.dataclass(frozen=True)
class ApiServerConfig:
    """What an API-server process is started with (written as JSON into the core's private folder)."""

    slot: int
    epoch: int
    core_address: str  # where it sends (the core's PULL socket)
    own_address: str  # where it receives (its PUSH socket in the core)
    listen_fd: int
    core_pipe_fd: int
    tokenizer_file: str
    info: dict[str, Any]
    state: str
    weight_version: int | None
    accepting: bool
    api_key: str | None
    http: dict[str, int]  # its server's bounds, a :class:`~megafleet_engine.http_limits.HttpLimits`


class CoreServer:
    """The IPC server and API-server supervisor of one engine core (see the module docstring).

    Args:
        engine: the core's engine.
        metrics: the core's metrics (fed by the API servers' reports).
        tokenizer: handed to the API servers (pickled).
        listener: the frontend's listening socket, bound by the caller.
        count: API-server processes to run.
        api_key: the frontend's API key, if any.
        http: the bounds of each API server's HTTP server.
    """

    def __init__(
        self,
        engine: engine_module.Engine,
        metrics: metrics_module.Metrics,
        tokenizer: base.Tokenizer,
        *,
        listener: socket.socket,
        count: int,
        api_key: str | None = None,
        http: http_limits.HttpLimits = http_limits.DEFAULTS.frontend,
    ) -> None:
        self._engine = engine
        self._http = http
        self._metrics = metrics
        self._listener = listener
        self._count = count
        self._api_key = api_key
        self._folder = Path(tempfile.mkdtemp(prefix="megafleet-core-"))
        self._tokenizer_file = self._folder / "tokenizer.pickle"
        try:
            self._tokenizer_file.write_bytes(pickle.dumps(tokenizer))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise RuntimeError(
                f"the tokenizer cannot be handed to API-server processes ({error}); set MEGAFLEET_API_SERVERS=0 "
                "to serve the frontend in the engine's process"
            ) from None
        self._context = zmq.asyncio.Context()
        self._sync_context = zmq.Context()
        self._input = self._context.socket(zmq.PULL)
        self._input_address = f"ipc://{self._folder}/core"
        self._input.bind(self._input_address)
        self._pipe_read, self._pipe_write = os.pipe()  # the write end stays here, never inherited
        self._epochs = itertools.count(1)
        self._clients: dict[int, _Client] = {}
        self._by_epoch: dict[int, _Client] = {}
        self._restarts: dict[int, list[float]] = {}
        self._stopping = asyncio.Event()
        self._status: tuple[str, int | None, bool] | None = None
        self._submits: set[asyncio.Task[None]] = set()

    @property
    def count(self) -> int:
        return self._count

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """The running API-server processes, by slot."""
        return [client.process for client in self._clients.values() if client.process is not None]

    async def serve(self) -> None:
        """Start the API servers and run until :meth:`stop`; then stop them (gracefully)."""
        for slot in range(self._count):
            self._spawn(slot)
        supervise = asyncio.create_task(self._supervise(), name="megafleet-core-supervise")
        tasks = [
            asyncio.create_task(self._receive(), name="megafleet-core-receive"),
            asyncio.create_task(self._announce(), name="megafleet-core-status"),
        ]
        try:
            await self._stopping.wait()
        finally:
            # Stopping: no API server is restarted, and this process lets go of the listening socket,
            # so once the API servers close theirs a new connection is refused (the client tries
            # elsewhere) instead of queueing where nobody accepts it. Requests keep reaching the
            # engine, and their outputs the API servers, until every API server has exited: what they
            # accepted meanwhile is answered.
            supervise.cancel()
            await asyncio.gather(supervise, return_exceptions=True)
            self._listener.close()
            try:
                await asyncio.to_thread(self._stop_processes)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self._close()

    def stop(self) -> None:
        """Ask :meth:`serve` to stop the API servers and return (call on the core's event loop)."""
        self._stopping.set()

    # -- API-server processes --------------------------------------------------------------------

    def _spawn(self, slot: int) -> None:
        epoch = next(self._epochs)
        own_address = f"ipc://{self._folder}/out-{slot}-{epoch}"
        sock: zmq.Socket[bytes] = self._sync_context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: the engine thread must never block on a send
        sock.bind(own_address)
        client = _Client(slot, epoch, sock, self._engine)
        info = self._engine.backend.info
        config = ApiServerConfig(
            slot=slot,
            epoch=epoch,
            core_address=self._input_address,
            own_address=own_address,
            listen_fd=self._listener.fileno(),
            core_pipe_fd=self._pipe_read,
            tokenizer_file=str(self._tokenizer_file),
            info=dataclasses.asdict(info),
            state=self._engine.state,
            weight_version=self._engine.weight_version,
            accepting=self._engine.accepting,
            api_key=self._api_key,
            http=dataclasses.asdict(self._http),
        )
        config_file = self._folder / f"api-server-{slot}-{epoch}.json"
        config_file.write_text(json.dumps(dataclasses.asdict(config)))
        client.process = subprocess.Popen(
            [sys.executable, "-m", "megafleet_engine.api_server", str(config_file)],
            pass_fds=(self._listener.fileno(), self._pipe_read),
        )
        self._clients[slot] = client
        self._by_epoch[epoch] = client
        log.info("API server %d started (pid %d)", slot, client.process.pid)

    async def _supervise(self) -> None:
        """Restart an API server that exited, within the restart limit."""
        while True:
            await asyncio.sleep(0.2)  # polling child exit codes; a child watcher needs the main thread
            for slot, client in list(self._clients.items()):
                process = client.process
                if process is None or process.poll() is None:
                    continue
                client.close()
                del self._by_epoch[client.epoch]
                now = time.monotonic()
                recent = [t for t in self._restarts.get(slot, []) if now - t < RESTART_WINDOW_SECONDS]
                if len(recent) >= RESTART_LIMIT:
                    log.error(
                        "API server %d (pid %d) exited with status %s and failed %d times in %.0f s: not "
                        "restarting it; the frontend no longer answers and the pod goes not-ready",
                        slot,
                        process.pid,
                        process.returncode,
                        len(recent) + 1,
                        RESTART_WINDOW_SECONDS,
                    )
                    del self._clients[slot]
                    if not self._clients:  # nobody accepts any more: refuse connections instead of queueing them
                        log.error("no API server is left; closing the frontend port")
                        self._listener.close()
                    continue
                log.error(
                    "API server %d (pid %d) exited with status %s; restarting it", slot, process.pid, process.returncode
                )
                self._restarts[slot] = [*recent, now]
                self._spawn(slot)

    def _stop_processes(self) -> None:
        for client in self._clients.values():
            if client.process is not None and client.process.poll() is None:
                client.process.terminate()
        deadline = time.monotonic() + STOP_SECONDS
        for client in self._clients.values():
            if client.process is None:
                continue
            try:
                client.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("API server %d did not stop in %.0f s; killing it", client.slot, STOP_SECONDS)
                client.process.kill()
                client.process.wait()

    def _close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._input.close(linger=0)
        self._context.term()
        self._sync_context.term()
        with contextlib.suppress(OSError):
            os.close(self._pipe_write)
        with contextlib.suppress(OSError):
            os.close(self._pipe_read)
        shutil.rmtree(self._folder, ignore_errors=True)

    # -- messages --------------------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            data = await self._input.recv()
            try:
                message = messages.core_decoder.decode(data)
            except msgspec.DecodeError as error:  # never sent by an API server of this version
                log.error("dropped a message from an API server that does not decode (%s)", error)
                continue
            client = self._by_epoch.get(message.epoch)
            if client is None:
                continue  # from an API server that has been replaced
            if isinstance(message, messages.Submit):
                task = asyncio.create_task(self._submit(client, message))
                self._submits.add(task)  # held: the loop keeps only weak references to tasks
                task.add_done_callback(self._submits.discard)
            elif isinstance(message, messages.Abort):
                for seq in message.seqs:
                    handle = client.handles.pop(seq, None)
                    if handle is None:
                        client.dropped.add(seq)
                    else:
                        handle.cancel()
            else:
                self._apply(message)

    async def _submit(self, client: _Client, message: messages.Submit) -> None:
        entries = [
            (sequence.seq, base.SequenceRequest(sequence.request_id, tuple(sequence.prompt), sequence.params))
            for sequence in message.sequences
        ]
        try:
            handles = await self._engine.enqueue(entries, client.sink)
        except Exception as error:  # NotServing at the gate; anything else fails these sequences too
            if not isinstance(error, engine_module.NotServing):
                log.exception("API server %d: queueing %d sequences failed", client.slot, len(entries))
            client.dropped.difference_update(sequence.seq for sequence in message.sequences)
            failures = [failure(sequence.seq, error) for sequence in message.sequences]
            client.send(messages.no_tokens(self._engine.weight_version, failures))
            return
        for handle in handles:
            if handle.tag in client.dropped:
                client.dropped.discard(handle.tag)
                handle.cancel()
            elif not handle.done:
                client.handles[handle.tag] = handle

    def _apply(self, report: messages.Report) -> None:
        for endpoint, status, seconds in report.requests:
            self._metrics.observe_request(endpoint, status, seconds)
        for seconds in report.first_token:
            self._metrics.observe_first_token(seconds)
        if report.prompt_tokens:
            self._metrics.count_prompt_tokens(report.prompt_tokens)

    async def _announce(self) -> None:
        """Tell every API server the engine's state and weight version when they change, and at
        least every :data:`HEARTBEAT_SECONDS`."""
        last_sent = 0.0
        while True:
            engine = self._engine
            status = (engine.state, engine.weight_version, engine.accepting)
            now = time.monotonic()
            if status != self._status or now - last_sent >= HEARTBEAT_SECONDS:
                self._status = status
                last_sent = now
                message = messages.Status(*status)
                for client in list(self._clients.values()):
                    client.send(message)
            await asyncio.sleep(STATUS_POLL_SECONDS)  # polling the engine's state; it has no change hook
