"""The ``megafleet-engine`` command as a pod runs it: settings from the environment, one CPU rank
serving the frontend, agent and metrics on the ports it bound, a clean stop on SIGTERM, clear
start-up errors, and two ranks of one shard joining a gloo process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers import engine_command
from helpers import engine_harness as harness

pytestmark = pytest.mark.slow  # each test starts megafleet-engine processes

ALL_SERVERS = {"frontend", "agent", "metrics"}


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    return harness.token_file(tmp_path)


def _env(token_file: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEGAFLEET_")}
    env.update(
        MEGAFLEET_MODEL_SOURCE="tiny://llama",
        MEGAFLEET_SERVED_MODEL_NAME="tiny-cli",
        MEGAFLEET_DTYPE="float32",
        MEGAFLEET_MAX_SEQUENCE_LENGTH="128",
        MEGAFLEET_HOST="127.0.0.1",
        MEGAFLEET_FRONTEND_PORT="0",
        MEGAFLEET_AGENT_PORT="0",
        MEGAFLEET_METRICS_PORT="0",
        MEGAFLEET_AGENT_TOKEN_FILE=str(token_file),
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def engine_processes(*envs: dict[str, str]) -> Iterator[list[engine_command.EngineCommand]]:
    """Start one process per environment, all at once; stop whatever still runs on exit."""
    processes: list[engine_command.EngineCommand] = []
    try:
        for env in envs:
            processes.append(engine_command.EngineCommand(env))
        yield processes
    finally:
        for process in processes:
            process.stop()


def test_engine_command_serves_and_stops_on_sigterm(token_file: Path) -> None:
    with engine_processes(_env(token_file, MEGAFLEET_API_KEY="sk-fleet")) as (engine,):
        addresses = engine.wait_serving(*ALL_SERVERS)
        with httpx.Client(headers={"Authorization": f"Bearer {harness.AGENT_TOKEN}"}, timeout=30) as agent:
            state = agent.get(f"http://{addresses['agent']}/v1/state").json()
        assert state["state"] == "ready" and state["weightVersion"] == 0
        assert state["servedAddress"] == addresses["frontend"]
        frontend = f"http://{addresses['frontend']}/v1"
        assert httpx.get(f"{frontend}/models", timeout=30).status_code == 401, "the API key must be enforced"
        with openai.OpenAI(base_url=frontend, api_key="sk-fleet", max_retries=0) as client:
            assert client.completions.create(model="tiny-cli", prompt="hi", max_tokens=3).usage is not None
        assert httpx.get(f"http://{addresses['metrics']}/metrics", timeout=30).status_code == 200
        engine.process.send_signal(signal.SIGTERM)
        assert engine.process.wait(timeout=60) == 0
    assert any("loading tiny://llama" in line for line in engine.log)
    assert any("rank 0: stopped" in line for line in engine.log)


def test_engine_command_with_deferred_weights_starts_loading(token_file: Path) -> None:
    with engine_processes(_env(token_file, MEGAFLEET_WEIGHTS_INITIAL="refit")) as (engine,):
        addresses = engine.wait_serving(*ALL_SERVERS)
        with httpx.Client(headers={"Authorization": f"Bearer {harness.AGENT_TOKEN}"}, timeout=30) as agent:
            state = agent.get(f"http://{addresses['agent']}/v1/state").json()
            ready = agent.get(f"http://{addresses['agent']}/readyz")
        refused = httpx.post(
            f"http://{addresses['frontend']}/v1/completions", json={"model": "tiny-cli", "prompt": "x"}, timeout=30
        )
    assert (state["state"], state["weightVersion"]) == ("loading", None)
    assert ready.status_code == 503
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "loading"


def test_engine_command_rejects_invalid_settings(token_file: Path, tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    result = subprocess.run(
        [sys.executable, "-m", "megafleet_engine.cli"],
        env=_env(token_file, MEGAFLEET_BACKEND="vllm", MEGAFLEET_TERMINATION_LOG=str(message)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "MEGAFLEET_BACKEND must be one of transformers, megatron" in result.stderr
    # The container's termination message says why, for the pod's status and the operator.
    assert (
        message.read_text()
        == "invalid configuration: MEGAFLEET_BACKEND must be one of transformers, megatron, got 'vllm'"
    )


def test_engine_command_refuses_to_start_without_its_agent_token(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    result = subprocess.run(
        [sys.executable, "-m", "megafleet_engine.cli"],
        env=_env(tmp_path / "missing-token", MEGAFLEET_TERMINATION_LOG=str(message)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert "agent token" in result.stderr and "missing-token" in result.stderr
    assert message.read_text().startswith("rank 0: ") and "missing-token" in message.read_text()


def test_an_engine_that_fails_to_load_its_model_says_why_in_its_termination_message(
    token_file: Path, tmp_path: Path
) -> None:
    message = tmp_path / "termination-log"
    missing = tmp_path / "no-such-checkpoint"
    result = subprocess.run(
        [sys.executable, "-m", "megafleet_engine.cli"],
        env=_env(token_file, MEGAFLEET_MODEL_SOURCE=str(missing), MEGAFLEET_TERMINATION_LOG=str(message)),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode != 0
    assert message.read_text().startswith("rank 0: ") and str(missing) in message.read_text()


def test_two_ranks_join_one_process_group_and_only_the_frontend_rank_serves_clients(token_file: Path) -> None:
    """Two one-rank pods of a TP=2 shard on CPU: both must join the gloo group before serving;
    rank 0 (tp_rank 0) hosts the frontend, rank 1 only its agent and metrics."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master_port = str(probe.getsockname()[1])
    shard = {"MEGAFLEET_WORLD_SIZE": "2", "MEGAFLEET_TENSOR_PARALLEL": "2", "MEGAFLEET_MASTER_PORT": master_port}
    envs = [_env(token_file, MEGAFLEET_RANK=str(rank), **shard) for rank in (0, 1)]
    with engine_processes(*envs) as (rank0, rank1):  # started together: rendezvous waits for both
        addresses0 = rank0.wait_serving(*ALL_SERVERS)
        addresses1 = rank1.wait_serving("agent", "metrics")
        with httpx.Client(headers={"Authorization": f"Bearer {harness.AGENT_TOKEN}"}, timeout=30) as agent:
            state0 = agent.get(f"http://{addresses0['agent']}/v1/state").json()
            state1 = agent.get(f"http://{addresses1['agent']}/v1/state").json()
        for engine in (rank0, rank1):
            engine.process.send_signal(signal.SIGTERM)
        assert rank0.process.wait(timeout=60) == 0 and rank1.process.wait(timeout=60) == 0
    assert (state0["rank"], state0["worldSize"], state0["servedAddress"]) == (0, 2, addresses0["frontend"])
    assert (state1["rank"], state1["worldSize"], state1["servedAddress"]) == (1, 2, None)
    assert not any("serving the frontend" in line for line in rank1.log), "rank 1 is not a frontend rank"
    for engine in (rank0, rank1):
        assert any("joining the shard's process group (gloo, 2 ranks)" in line for line in engine.log)
