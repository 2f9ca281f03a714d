"""Shared harness of the refit tests (it holds no tests): trainers, engines and the agent calls the
operator makes.

* :class:`Trainer`: the tiny Llama with *changed* weights (another seed), its own greedy output, and
  :meth:`Trainer.send_in_background`, a :class:`~megafleet_protocol.refit.sender.WeightSender` on a thread.
* :func:`serve_in_process`: an engine and its servers in this process (so tests can look at the live
  tensors); :class:`EngineProcess`: ``python -m megafleet_engine.cli`` on its own 127.x address.
* :class:`AgentClient`: ``POST /v1/refit/prepare`` and friends, and waiting for the outcome by
  polling ``GET /v1/refit/status`` with a deadline, as the operator does.

A module, not a ``conftest.py`` (the root conftest must stay the only one); test modules import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from helpers import engine_command
from megafleet_engine import backends, engine, metrics, refit_staging, server
from megafleet_engine.backends import transformers_backend, weight_maps
from megafleet_engine.models import tiny
from megafleet_engine.refit_attempts import controller as refit_controller
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import sender as sdk

MODEL = "tiny"
SOURCE = "tiny://llama"
TRAINER_SOURCE = "tiny://llama?seed=7"  # same architecture as the engines, other weights
AGENT_TOKEN = engine_command.AGENT_TOKEN
TRAINER_ADDRESS = "127.0.9.1"
START_TIMEOUT_SECONDS = 120
REFIT_POLL_SECONDS = 0.05
SETTLE_TIMEOUT_SECONDS = 30  # an aborted attempt's thread ends by its deadline


token_file = engine_command.token_file  # one agent token file for every harness


def free_port(host: str = TRAINER_ADDRESS) -> int:
    """A port free on ``host`` now (each refit attempt gets a fresh one)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


# -- the trainer -------------------------------------------------------------------------------------


class Trainer:
    """The trainer's model: the tiny Llama of :data:`TRAINER_SOURCE` (float32, CPU)."""

    def __init__(self, source: str = TRAINER_SOURCE) -> None:
        self.model, self.tokenizer = tiny.build_tiny(source)

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: parameter.detach() for name, parameter in self.model.named_parameters()}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        inputs = torch.tensor([prompt_ids])
        with torch.inference_mode():
            output = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens
            )
        return [int(token) for token in output[0, len(prompt_ids) :]]

    def send_in_background(
        self,
        port: int,
        world_size: int,
        *,
        version: int,
        transport: vocabulary.Transport = "broadcast",
        weights: Mapping[str, torch.Tensor] | None = None,
        timeout_seconds: float = 60.0,
        send: bool = True,
    ) -> Sending:
        """Run the SDK as the trainer's rank 0 on a thread (``send=False``: join, then never send)."""
        tensors = dict(self.weights() if weights is None else weights)

        def run(sender: sdk.WeightSender) -> sdk.SendReport | None:
            sender.init()
            if not send:
                return None
            return sender.send(tensors.items(), bucket_size_mib=1, version=version, transport=transport)

        sender = sdk.WeightSender(port, world_size, address=TRAINER_ADDRESS, timeout_seconds=timeout_seconds)
        return Sending(sender, run)


def open_sender(world_size: int = 2, *, timeout_seconds: float = 30.0) -> tuple[int, sdk.WeightSender]:
    """The trainer's side of a refit on a fresh port of :data:`TRAINER_ADDRESS`, initialised (its
    store listens); the caller closes it."""
    port = free_port()
    sender = sdk.WeightSender(port, world_size, address=TRAINER_ADDRESS, timeout_seconds=timeout_seconds)
    sender.init()
    return port, sender


class Sending:
    """A sender running on a thread; :meth:`result` joins it and returns or raises what it did."""

    def __init__(self, sender: sdk.WeightSender, run: Any) -> None:
        self.sender = sender
        self._outcome: list[sdk.SendReport | BaseException | None] = []
        self._thread = threading.Thread(target=self._main, args=(run,), name="trainer", daemon=True)
        self._thread.start()

    def _main(self, run: Any) -> None:
        try:
            self._outcome.append(run(self.sender))
        except BaseException as error:  # handed to the test thread by result()
            self._outcome.append(error)

    def result(self, timeout: float = 60.0) -> sdk.SendReport | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the trainer did not finish"
        self.sender.close()
        outcome = self._outcome[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


# -- the operator's calls ----------------------------------------------------------------------------


@dataclasses.dataclass
class AgentClient:
    """The agent of one engine pod, called as the operator calls it."""

    url: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {AGENT_TOKEN}"}, timeout=30)

    def prepare(
        self,
        version: int,
        *,
        port: int,
        world_size: int,
        rank_offset: int,
        timeout_seconds: int = 60,
        transport: str = "broadcast",
        suspend_mode: str = "drain",
        bucket_size_mib: int = 1,
        integrity: str = "none",
        kv_cache_mode: str | None = None,
        more: Mapping[str, object] = {},
    ) -> httpx.Response:
        """``more``: further body fields by their wire names (``staging``, ``commit``, ...)."""
        body = {
            **more,
            "version": version,
            "transport": transport,
            "bucketSizeMiB": bucket_size_mib,
            "timeoutSeconds": timeout_seconds,
            "suspendMode": suspend_mode,
            "integrity": integrity,
            "kvCacheMode": kv_cache_mode,
            "rendezvous": {
                "address": TRAINER_ADDRESS,
                "port": port,
                "worldSize": world_size,
                "rankOffset": rank_offset,
                "trainerWorldSize": 1,
            },
        }
        with self.client() as agent:
            return agent.post("/v1/refit/prepare", json=body)

    def status(self) -> dict[str, Any]:
        with self.client() as agent:
            response = agent.get("/v1/refit/status")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def state(self) -> dict[str, Any]:
        with self.client() as agent:
            body: dict[str, Any] = agent.get("/v1/state").json()
        return body

    def wait_finished(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll the refit status until it succeeded or failed (the operator's loop), with a deadline."""
        deadline = time.monotonic() + timeout
        with self.client() as agent:
            while True:
                status: dict[str, Any] = agent.get("/v1/refit/status").json()
                if status["phase"] in ("succeeded", "failed"):
                    return status
                assert time.monotonic() < deadline, f"the refit did not finish within {timeout} s: {status}"
                time.sleep(REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def completion_ids(frontend_url: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Greedy completion token ids from an engine's OpenAI frontend, and its weight version header."""
    with openai.OpenAI(base_url=f"{frontend_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
        )
    completion = raw.parse()
    token_ids = (completion.choices[0].model_extra or {})["token_ids"]
    return [int(token) for token in token_ids], raw.headers["X-Megafleet-Weight-Version"]


# -- engines ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class InProcessEngine:
    engine: engine.Engine
    servers: server.EngineServers
    backend: transformers_backend.TransformersBackend

    @property
    def frontend_url(self) -> str:
        return f"http://{self.servers.address('frontend')}"

    @property
    def agent(self) -> AgentClient:
        return AgentClient(f"http://{self.servers.address('agent')}")

    @property
    def refits(self) -> refit_controller.RefitController:
        listener = next(listener for listener in self.servers.listeners if listener.name == "agent")
        controller: refit_controller.RefitController = listener.app.state.agent.refits
        return controller


def tiny_backend(*, deferred: bool = False) -> transformers_backend.TransformersBackend:
    """A fresh tiny Llama on CPU (refits write into it, so tests never share one)."""
    backend = backends.load_backend(
        "transformers", SOURCE, name=MODEL, max_sequence_length=128, dtype="float32", load_weights=not deferred
    )
    assert isinstance(backend, transformers_backend.TransformersBackend)
    return backend


@contextlib.contextmanager
def serve_in_process(token: Path, *, deferred: bool = False, staging: bool = False) -> Iterator[InProcessEngine]:
    """An engine (weight version 0, or deferred) with frontend and agent on 127.0.0.1, in this process;
    ``staging``: it holds a staging copy, as ``MEGAFLEET_REFIT_STAGING=auto`` gives it with room."""
    backend = tiny_backend(deferred=deferred)
    the_engine = engine.Engine(backend, weight_version=None if deferred else 0)
    if staging:
        backend.prepare_staging()
        the_engine.staging = refit_staging.StagingPlan("auto", bytes=backend.staging_bytes())
    try:
        servers = server.EngineServers(
            the_engine,
            backend.tokenizer,
            metrics.Metrics(the_engine),
            host="127.0.0.1",
            frontend_port=0,
            agent_port=0,
            metrics_port=None,
            agent_token_file=token,
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(servers.serve())
            except BaseException as error:  # reported below
                failure.append(error)

        thread = threading.Thread(target=run, name="engine-servers", daemon=True)
        thread.start()
        served = InProcessEngine(the_engine, servers, backend)
        try:
            _wait_healthy(served.agent.url, lambda: thread.is_alive())
            yield served
            assert served.refits.wait_settled(SETTLE_TIMEOUT_SECONDS), "a refit attempt's thread outlived its test"
            served.refits.close()  # a transfer group parked by the last refit
        finally:
            servers.stop()
            thread.join(timeout=30)
        assert not thread.is_alive() and not failure, f"the servers did not stop cleanly: {failure}"
    finally:
        the_engine.close()


def _wait_healthy(agent_url: str, alive: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            assert alive(), "the servers exited during start-up"
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{agent_url}/healthz").status_code == 200:
                    return
            time.sleep(0.02)  # polling a health endpoint for start-up, with a deadline
    raise AssertionError(f"the agent did not answer within {START_TIMEOUT_SECONDS} s")


class EngineProcess(engine_command.EngineProcess):
    """``python -m megafleet_engine.cli`` bound to ``host`` (its pod IP), as a pod runs it, with the
    calls the operator makes on its agent."""

    @property
    def frontend_url(self) -> str:
        return f"http://{self.addresses['frontend']}"

    @property
    def agent(self) -> AgentClient:
        return AgentClient(f"http://{self.addresses['agent']}")


# -- the tiny model's shape ---------------------------------------------------------------------------


def tiny_shape() -> weight_maps.LlamaShape:
    config = tiny.build_config(tiny.parse(SOURCE), tiny.build_tokenizer())
    return weight_maps.LlamaShape.from_hf_config(config.to_dict())
