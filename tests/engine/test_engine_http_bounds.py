"""The bounds of the engine's HTTP servers (:mod:`megafleet_engine.http_server`), measured from
outside with raw sockets: slow clients that send their request head one byte at a time neither slow
serving nor stay open past the head timeout (an engine process: its API-server process and its
agent); a server holds at most its connection limit and answers one more with a 503; idle
connections close after keep-alive; a body over the limit is a 413 and a stalled one a 408.

Open connections are counted as the kernel sees them: the sockets on the server's port (local
port) that are established or that the client closed and the server has not (``/proc/net/tcp``)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers import engine_command
from helpers import engine_harness as harness
from megafleet_engine import http_server
from megafleet_protocol import http_limits

pytestmark = pytest.mark.slow  # each test starts an engine and its servers

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"
HELD = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT: the server still holds the socket


def held_connections(address: str) -> int:
    """Sockets whose local end is ``address``'s port (IPv4) and that the server still holds."""
    port = int(address.rsplit(":", 1)[1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in HELD:
            count += 1
    return count


def wait_for(condition: Callable[[], bool], what: str, timeout: float) -> float:
    """Poll ``condition`` until true; the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)  # polling kernel socket state with a deadline
    return time.monotonic() - started


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


class Trickle:
    """``count`` connections to ``address`` that send :data:`HEAD` one byte per ``tick`` seconds
    each (a slowloris client), reading whatever the server answers until it closes them."""

    def __init__(self, address: str, count: int, *, tick: float = 0.2) -> None:
        self.socks = [connect(address) for _ in range(count)]
        for sock in self.socks:
            sock.setblocking(False)
        self.answers = [b""] * count
        self.closed: list[float | None] = [None] * count
        self.started = time.monotonic()
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set() and not self.all_closed:
            for index, sock in enumerate(self.socks):
                if self.closed[index] is None:
                    self._step(index, sock, HEAD[sent : sent + 1] if sent < len(HEAD) else b"")
            sent += 1
            self._stop.wait(self._tick)  # the trickle's own pace: one byte per tick

    def _step(self, index: int, sock: socket.socket, byte: bytes) -> None:
        try:
            while data := sock.recv(65536):
                self.answers[index] += data
            self.closed[index] = time.monotonic() - self.started  # recv gave b"": the server closed
            return
        except BlockingIOError:
            pass
        except OSError:
            self.closed[index] = time.monotonic() - self.started
            return
        try:
            if byte:
                sock.send(byte)
        except OSError:
            self.closed[index] = time.monotonic() - self.started

    @property
    def all_closed(self) -> bool:
        return all(when is not None for when in self.closed)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in self.socks:
            sock.close()


@pytest.fixture
def slow_clients() -> Iterator[list[Trickle]]:
    trickles: list[Trickle] = []
    try:
        yield trickles
    finally:
        for trickle in trickles:
            trickle.close()


def test_slow_clients_of_an_api_server_and_an_agent_are_released_and_serving_goes_on(
    tmp_path: Path, slow_clients: list[Trickle]
) -> None:
    """100 connections trickle a request head into the frontend (an API-server process) and 30 into
    the agent: both keep answering at once, and every slow connection is closed with a 408 once the
    head timeout (3 s here, 10 by default) has passed; no socket is left held."""
    env = {"MEGAFLEET_API_SERVERS": "1", "MEGAFLEET_HTTP_HEADER_TIMEOUT_SECONDS": "3"}
    engine = engine_command.EngineProcess("127.0.0.1", engine_command.token_file(tmp_path), env=env)
    try:
        addresses = engine.wait_serving()
        frontend, agent = addresses["frontend"], addresses["agent"]
        wait_for(lambda: _healthy(frontend), "the API server to answer", 60)
        slow_clients.append(Trickle(frontend, 100))
        slow_clients.append(Trickle(agent, 30))
        wait_for(lambda: held_connections(frontend) >= 100 and held_connections(agent) >= 30, "slow connections", 5)
        with openai.OpenAI(base_url=f"http://{frontend}/v1", api_key="x", max_retries=0, timeout=10) as client:
            started = time.monotonic()
            answer = client.completions.create(model=engine_command.MODEL, prompt="hi", max_tokens=2)
            served_in = time.monotonic() - started
        assert answer.choices and served_in < 2.5, f"a request beside 100 slow clients took {served_in:.2f} s"
        headers = {"Authorization": f"Bearer {engine_command.AGENT_TOKEN}"}
        assert httpx.get(f"http://{agent}/v1/state", headers=headers, timeout=5).status_code == 200
        assert all(when is None for trickle in slow_clients for when in trickle.closed), "closed before the timeout"
        wait_for(lambda: held_connections(frontend) + held_connections(agent) == 0, "the server to release them", 10)
        wait_for(lambda: all(trickle.all_closed for trickle in slow_clients), "the clients to see the close", 5)
        for trickle in slow_clients:
            for answer_bytes, closed in zip(trickle.answers, trickle.closed, strict=True):
                assert closed is not None and 2.5 < closed < 7, f"closed {closed} s after it opened, not about 3"
                assert answer_bytes.startswith(b"HTTP/1.1 408 "), answer_bytes[:80]
                body = json.loads(answer_bytes.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["code"] == "request_timeout"
    finally:
        engine.close()


def _healthy(address: str) -> bool:
    try:
        return httpx.get(f"http://{address}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _bounds(**frontend: int) -> http_limits.HttpBounds:
    return http_limits.HttpBounds(frontend=http_limits.HttpLimits(**{"max_connections": 4096, **frontend}))


def _get_health(sock: socket.socket) -> bytes:
    """Send ``GET /health`` on a kept-alive connection and read its whole (small) answer."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or not _complete(answer):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
        0,
    )
    return len(body) >= length


def test_a_server_holds_at_most_its_connection_limit_and_idle_ones_close_after_keep_alive(tmp_path: Path) -> None:
    """With a limit of 8: 8 kept-alive connections are served; a 9th is answered 503 (OpenAI body,
    Retry-After) without waiting for its request; once keep-alive (2 s here) closed the idle ones,
    a new connection is served again."""
    bounds = _bounds(max_connections=8, keep_alive_seconds=2)
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path), http=bounds) as served:
        frontend = served.servers.address("frontend")
        assert frontend is not None
        kept = [connect(frontend) for _ in range(8)]
        try:
            for sock in kept:  # one at a time: each is accepted and answered before the next opens
                assert _get_health(sock).startswith(b"HTTP/1.1 200 ")
            assert held_connections(frontend) == 8
            with connect(frontend) as extra:
                refused = _get_health(extra)
                assert extra.recv(1) == b"", "the refused connection is closed"
            assert refused.startswith(b"HTTP/1.1 503 "), refused[:80]
            head, _, body = refused.partition(b"\r\n\r\n")
            assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            with served.http() as http:
                again = http.get("/health")  # a client's request: it reads the answer sent before it
                assert again.status_code == 503 and again.json()["error"]["code"] == "too_many_connections"
                wait_for(lambda: held_connections(frontend) == 0, "keep-alive to close the idle connections", 10)
                assert all(sock.recv(1) == b"" for sock in kept), "the server closed every idle connection"
                good = http.post("/v1/completions", json={"model": harness.MODEL, "prompt": "hi", "max_tokens": 2})
                assert good.status_code == 200, good.text
        finally:
            for sock in kept:
                sock.close()


def _accepts(address: str) -> bool:
    try:
        connect(address).close()
        return True
    except OSError:
        return False


def test_a_stopping_server_answers_a_request_on_an_idle_connection_rather_than_dropping_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told to stop while two kept-alive connections are idle, a server stops accepting but keeps
    them for the lame-duck period: a request sent on one meanwhile is answered 503 (OpenAI body,
    Retry-After, Connection: close) rather than dropped unanswered; the other, still idle, is closed
    when the period ends, and the server stops."""
    monkeypatch.setattr(http_server, "LAME_DUCK_SECONDS", 2.0)
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path)) as served:
        frontend = served.servers.address("frontend")
        assert frontend is not None
        with connect(frontend) as asking, connect(frontend) as idle:
            for sock in (asking, idle):
                assert _get_health(sock).startswith(b"HTTP/1.1 200 ")
            served.servers.stop()
            wait_for(lambda: not _accepts(frontend), "the stopping server to close its listening socket", 10)
            answer = _get_health(asking)
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:80]
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
            assert json.loads(body)["error"]["code"] == "shutting_down"
            assert asking.recv(1) == b"", "the answered connection is closed"
            assert idle.recv(1) == b"", "the idle connection is closed when the lame-duck period ends"


def test_a_body_over_the_limit_is_a_413_and_a_stalled_one_a_408(tmp_path: Path) -> None:
    bounds = _bounds(max_body_bytes=1000, stall_timeout_seconds=1)
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path), http=bounds) as served:
        frontend = served.servers.address("frontend")
        assert frontend is not None
        body = {"model": harness.MODEL, "prompt": "x" * 2000, "max_tokens": 2}
        with served.http() as http:
            declared = http.post("/v1/completions", json=body)
            chunked = http.post("/v1/completions", content=iter([json.dumps(body).encode()]))
            for response in (declared, chunked):
                assert response.status_code == 413, response.text
                assert response.headers["connection"] == "close"
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error" and "1000 bytes" in error["message"]
            fits = http.post("/v1/completions", json={**body, "prompt": "x" * 100})
            assert fits.status_code == 200, fits.text
        with connect(frontend) as sock:
            sock.sendall(HEAD.replace(b"Content-Length: 40", b"Content-Length: 100") + b'{"model": ')
            started = time.monotonic()
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            stalled_for = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
        assert 0.8 < stalled_for < 4, stalled_for
        wait_for(lambda: held_connections(frontend) == 0, "every connection to be released", 5)


def test_a_client_that_stops_reading_a_stream_is_closed_and_its_generation_stopped(tmp_path: Path) -> None:
    """A stream whose client reads nothing fills the socket buffers; once the server has had more to
    send for the stall timeout (1 s here), it closes the connection and the request's sequences
    stop, long before they would have finished; the engine serves the next request. Both ends'
    socket buffers are made small (the server's through its listening socket, which accepted
    connections inherit), so they fill in a fraction of a second rather than after megabytes."""
    bounds = _bounds(stall_timeout_seconds=1)
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path), http=bounds) as served:
        frontend = served.servers.address("frontend")
        assert frontend is not None
        [listener] = [listener.sock for listener in served.servers.listeners if listener.name == "frontend"]
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        n, max_tokens = 16, harness.MAX_SEQUENCE_LENGTH - 1
        body = {
            "model": harness.MODEL,
            "prompt": [5],
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 20,
            "stream": True,
        }
        payload = json.dumps(body).encode()
        host, port = frontend.rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            sock.connect((host, int(port)))
            head = "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            wait_for(lambda: held_connections(frontend) == 0, "the server to close the unread stream", 30)
            wait_for(lambda: served.engine.queue_depth == 0, "its sequences to stop", 10)
            assert served.engine.generated_tokens < n * max_tokens, "the whole stream was generated anyway"
        with served.http() as http:
            good = http.post("/v1/completions", json={"model": harness.MODEL, "prompt": "hi", "max_tokens": 2})
            assert good.status_code == 200, good.text
