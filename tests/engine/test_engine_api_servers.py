"""The engine core and its API-server processes (``MEGAFLEET_API_SERVERS``), as a pod runs them:
the official client through two API servers sharing one port, per-step outputs, metrics counted in
the core, no torch in the API servers, and both failure directions (an API server dies: the core
restarts it; the core dies: the API servers exit and the port stops answering), and a stop
(SIGTERM) that answers every connection it accepted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import engine_command

pytestmark = pytest.mark.slow  # each test starts megafleet-engine processes

MODEL = engine_command.MODEL


class SplitEngine(engine_command.EngineProcess):
    """An engine process whose frontend runs in ``api_servers`` API-server processes."""

    def __init__(self, token: Path, api_servers: int) -> None:
        super().__init__("127.0.0.1", token, env={"MEGAFLEET_API_SERVERS": str(api_servers)})

    def api_server_pids(self) -> list[int]:
        return _children(self.process.pid)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"http://{self.addresses['metrics']}/metrics", timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
        )


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return sorted(int(child) for child in path.read_text().split()) if path.exists() else []


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling process state, with a deadline


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SplitEngine]:
    process = SplitEngine(engine_command.token_file(tmp_path), api_servers=2)
    try:
        process.wait_serving()
        _wait_for(lambda: len(process.api_server_pids()) == 2, "two API-server processes")
        _wait_for(lambda: _ready(process), "the frontend to answer")
        yield process
    finally:
        process.close()


def _ready(engine: SplitEngine) -> bool:
    try:
        return httpx.get(f"http://{engine.addresses['frontend']}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _client(engine: SplitEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=60)


def test_the_official_client_through_api_servers_with_metrics_from_the_core(engine: SplitEngine) -> None:
    reference = engine_command.Reference()
    prompt = [3, 4, 5, 6]
    with _client(engine) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=[prompt, prompt], max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
        )
        completion = raw.parse()
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True
            )
        )
    expected = reference.greedy(prompt, 6)
    assert [(choice.model_extra or {})["token_ids"] for choice in completion.choices] == [expected, expected]
    assert raw.headers["X-Megafleet-Weight-Version"] == "0"
    assert (completion.model_extra or {})["weight_version"] == 0
    assert chunks[-1].choices[-1].finish_reason is not None
    assert all((chunk.model_extra or {})["weight_version"] == 0 for chunk in chunks)
    # the spans come through the core's per-step outputs: one version, one span from the first token
    one_span = [{"start": 0, "version": 0}]
    assert [(choice.model_extra or {})["weight_version_spans"] for choice in completion.choices] == [one_span] * 2
    assert (chunks[-1].choices[-1].model_extra or {})["weight_version_spans"] == one_span
    # metrics live in the core: the API servers forward what they observed
    assert engine.metric("megafleet_requests_total", endpoint="/v1/completions", status="200") == 1
    assert engine.metric("megafleet_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert engine.metric("megafleet_generated_tokens_total") >= 12
    assert engine.metric("megafleet_time_to_first_token_seconds_count") == 2


def test_api_servers_load_neither_torch_nor_the_model(engine: SplitEngine) -> None:
    with _client(engine) as client:  # a request: the tokenizer has been used
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    core_maps = Path(f"/proc/{engine.process.pid}/maps").read_text()
    assert "libtorch" in core_maps  # the core has the model
    for pid in engine.api_server_pids():
        assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"API server {pid} loaded torch"


def test_the_api_server_modules_import_no_torch() -> None:
    script = (
        "import sys, megafleet_engine.api_server, megafleet_engine.core_ipc.client;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_api_server_that_dies_is_restarted(engine: SplitEngine) -> None:
    victim = engine.api_server_pids()[0]
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: victim not in engine.api_server_pids() and len(engine.api_server_pids()) == 2, "a replacement")
    assert any("exited with status -9; restarting it" in line for line in engine.log)
    with _client(engine) as client:  # both servers (the new one too) answer; requests hit either
        answers = [client.completions.create(model=MODEL, prompt="hi", max_tokens=2) for _ in range(6)]
    assert all((answer.model_extra or {})["weight_version"] == 0 for answer in answers)


def test_a_core_that_dies_takes_its_api_servers_down(engine: SplitEngine) -> None:
    servers = engine.api_server_pids()
    engine.process.send_signal(signal.SIGKILL)
    engine.process.wait(timeout=30)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie until its parent (now init) reaps it: it serves nothing either
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    _wait_for(lambda: all(gone(pid) for pid in servers), "the API servers to exit", timeout=15)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{engine.addresses['frontend']}/health", timeout=5)


def _stream_first_line(engine: SplitEngine, max_tokens: int) -> tuple[httpx.Client, Any, Iterator[str]]:
    http = httpx.Client(base_url=f"http://{engine.addresses['frontend']}", timeout=60)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    context = http.stream("POST", "/v1/completions", json=body)
    response = context.__enter__()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: {"))
    return http, context, lines


def test_a_client_that_leaves_stops_its_sequence_in_the_core(engine: SplitEngine) -> None:
    max_tokens = 120
    http, context, _ = _stream_first_line(engine, max_tokens)
    context.__exit__(None, None, None)  # the client goes away after its first token
    http.close()
    _wait_for(lambda: engine.metric("megafleet_queue_depth") == 0, "the core to drop the sequence", timeout=30)
    assert engine.metric("megafleet_generated_tokens_total") < max_tokens


def test_suspend_abort_and_resume_reach_requests_through_api_servers(engine: SplitEngine) -> None:
    http, context, lines = _stream_first_line(engine, 120)
    agent = httpx.Client(
        base_url=f"http://{engine.addresses['agent']}",
        headers={"Authorization": f"Bearer {engine_command.AGENT_TOKEN}"},
        timeout=60,
    )
    with agent:
        assert agent.post("/v1/suspend", json={"mode": "abort", "timeoutSeconds": 30}).status_code == 200
        rest = [line for line in lines if line]
        context.__exit__(None, None, None)
        http.close()
        error = json.loads(next(line for line in rest if '"error"' in line)[len("data: ") :])
        assert error["error"]["code"] == "aborted" and rest[-1] == "data: [DONE]"
        frontend = f"http://{engine.addresses['frontend']}"
        _wait_for(lambda: httpx.get(f"{frontend}/health", timeout=5).status_code == 503, "health to say suspended")
        assert agent.post("/v1/resume", json={"weightVersion": 3}).status_code == 200
    _wait_for(lambda: _ready(engine), "health to say ready again")
    with _client(engine) as client:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
        models = client.models.list()
    assert raw.headers["X-Megafleet-Weight-Version"] == "3"
    assert (raw.parse().model_extra or {})["weight_version"] == 3
    assert (raw.parse().choices[0].model_extra or {})["weight_version_spans"] == [{"start": 0, "version": 3}]
    assert (models.model_extra or {})["weight_version"] == 3


def test_an_api_server_that_keeps_dying_is_given_up_and_the_port_closes(tmp_path: Path) -> None:
    engine = SplitEngine(engine_command.token_file(tmp_path), api_servers=1)
    try:
        engine.wait_serving()
        killed: set[int] = set()
        deadline = time.monotonic() + 120
        while not any("not restarting it" in line for line in engine.log):
            assert time.monotonic() < deadline, "the core kept restarting its API server"
            for pid in set(engine.api_server_pids()) - killed:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.05)  # polling for the next replacement, with a deadline
        assert len(killed) == 6  # the first start and 5 restarts within a minute
        assert any("closing the frontend port" in line for line in engine.log)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{engine.addresses['frontend']}/health", timeout=5)
        assert engine.process.poll() is None  # the core (agent, metrics) stays up; readiness fails
    finally:
        engine.close()


def test_a_stopping_engine_answers_every_connection_it_accepted(engine: SplitEngine) -> None:
    """SIGTERM (what the kubelet sends when the pod is deleted) while a stream runs and new requests
    keep arriving: the stream ends whole, and every new request is answered (served, or 503) or
    refused at connect (nothing listens any more, so a client tries elsewhere); none is accepted and
    then left unanswered until the process exits."""
    http, context, lines = _stream_first_line(engine, 100)
    frontend = f"http://{engine.addresses['frontend']}"
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
    outcomes: list[str] = []
    engine.process.send_signal(signal.SIGTERM)
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while engine.process.poll() is None:
            try:
                outcomes.append(str(client.post(f"{frontend}/v1/completions", json=body).status_code))
            except httpx.ConnectError:
                outcomes.append("refused")
            except httpx.TransportError as error:
                outcomes.append(repr(error))
    rest = [line for line in lines if line]
    context.__exit__(None, None, None)
    http.close()
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
    assert engine.process.wait(timeout=30) == 0
    assert outcomes and set(outcomes) <= {"200", "503", "refused"}, sorted(set(outcomes))
