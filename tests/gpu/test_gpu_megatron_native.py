"""Megatron-native refits on a GPU: megatron-core's own ``prepare_swap_model_weights`` and
``swap_model_weights`` between a megatron-core trainer process and a megafleet megatron engine,
through the agent's ``POST /v1/refit/megatron/join`` and ``POST /v1/refit/megatron``.

The trainer is a second process (this file run as a script) playing NeMo RL's Megatron synchronizer
on its own torch.distributed world: it builds the tiny model as a megatron-core ``GPTModel`` (TP1)
with deterministic weights, hosts the refit group's store at ``port + 1``
(:func:`helpers.megatron_trainer.refit_group`), runs ``prepare_swap_model_weights`` as the source
(``src_rank_offset`` 0, ``dst_rank_offset`` its world size), then one ``swap_model_weights`` per
weight version it is told to send. The engine (the backend served in this process) joins as rank 1.

With ``copyBackend: gloo`` this runs on one GPU. ``nccl`` needs two (two processes on one GPU
cannot form an NCCL group: NCCL refuses a duplicate GPU), so it is skipped on a one-GPU machine.
With ``MEGAFLEET_GPU_REPORT=FILE`` set, the test appends what it measured to ``FILE``.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch

from helpers import engine_harness, gpu, megatron_trainer, refit_harness
from megafleet_engine.backends import base, megatron
from megafleet_protocol.refit import digest, parameter_digests

ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu.GPU_SKIP is not None, reason=gpu.GPU_SKIP or ""),
    pytest.mark.filterwarnings("default"),  # megatron-core's and the kernels' own warnings
]
pytestmark = ON_GPU

SESSION = "native-gpu"
PROMPT = [40, 41, 42, 43, 44, 45]
NEW_TOKENS = 12
WAIT_SECONDS = 120.0
SAID = "trainer> "
"""The prefix of the trainer's protocol lines on its stdout."""
VERSIONS = ((1, 1), (2, 0))  # (weight version, the trainer's weight seed): version 2 is the start's weights again


class TrainerProcess:
    """The trainer script in its own process: lines in on stdin, lines out on stdout."""

    def __init__(self, port: int, copy_backend: str, device: int, log: Path) -> None:
        env = {**os.environ, **gpu.NCCL_SAFE, "CUDA_VISIBLE_DEVICES": str(device), "PYTHONUNBUFFERED": "1"}
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(port), copy_backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Queue the trainer's protocol lines; anything else on its stdout (a library printing there)
        goes to its log instead of being taken for an answer."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(SAID):
                self._lines.put(line[len(SAID) :].strip())
            else:
                self._log.write(line)
                self._log.flush()

    def expect(self, word: str, timeout: float = WAIT_SECONDS) -> str:
        """The next line, which must start with ``word``; returns the rest."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the trainer said nothing for {timeout} s (expected {word!r})") from None
        head, _, rest = line.partition(" ")
        assert head == word, f"the trainer said {line!r}, expected {word!r}"
        return rest

    def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()  # the trainer exits by os._exit; a stuck one is ended here
        self.process.wait(30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


@pytest.fixture(scope="module")
def backend() -> Iterator[megatron.MegatronBackend]:
    """The tiny model on this process's GPU, serving the scaled weights of seed 0."""
    loaded = megatron.load(
        gpu.SOURCE,
        name=engine_harness.MODEL,
        max_sequence_length=gpu.MAX_SEQUENCE_LENGTH,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        options=megatron.EngineOptions(max_batch_size=8, kv_buffer_gb=1.0, max_step_tokens=2048),
    )
    loaded.write_weights(gpu.scaled_reference_weights(seed=0))
    yield loaded
    loaded.close()


def wait_joined(agent: httpx.Client) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        world: dict[str, Any] = agent.get("/v1/refit/status").json()["world"] or {}
        if world.get("phase") in ("joined", "failed", "left"):
            return world
        assert time.monotonic() < deadline, f"the join did not finish: {world}"
        time.sleep(0.1)  # polling the agent's status with a deadline, as the operator does


@pytest.mark.parametrize("copy_backend", ["gloo", "nccl"])
def test_the_engine_receives_two_versions_by_megatron_cores_swap(
    backend: megatron.MegatronBackend, copy_backend: str, tmp_path: Path
) -> None:
    if copy_backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("the nccl copy service needs two GPUs: two processes on one GPU cannot form an NCCL group")
    port = refit_harness.free_port() - 1  # the group's store listens at port + 1
    trainer_device = 1 if copy_backend == "nccl" else torch.cuda.current_device()
    trainer = TrainerProcess(port, copy_backend, trainer_device, tmp_path / "trainer.log")
    served_backend = cast(Any, backend)  # the harness serves any backend with a tokenizer
    try:
        with (
            engine_harness.serve(served_backend, engine_harness.token_file(tmp_path)) as served,
            served.agent() as agent,
        ):
            before, version = refit_harness.completion_ids(served.frontend_url, PROMPT, NEW_TOKENS)
            assert version == "0"
            initial = megatron_trainer.checksum(backend.model)
            trainer.expect("built")
            started = time.monotonic()
            rendezvous = {
                "address": "127.0.0.1",
                "port": port,
                "worldSize": 2,
                "rankOffset": 1,
                "trainerWorldSize": 1,
            }
            join = agent.post(
                "/v1/refit/megatron/join",
                json={
                    "session": SESSION,
                    "rendezvous": rendezvous,
                    "copyBackend": copy_backend,
                    "timeoutSeconds": 90,
                },
            )
            assert join.status_code == 202, join.text
            trainer.expect("prepared")
            world = wait_joined(agent)
            join_seconds = time.monotonic() - started
            assert world["phase"] == "joined" and world["protocol"] == "megatron" and world["rank"] == 1, world
            served_tokens = {0: before}
            measured: dict[str, Any] = {"join_seconds": round(join_seconds, 3)}
            for weight_version, seed in VERSIONS:
                trainer.tell(f"swap {seed}")
                sent = trainer.expect("checksum")
                refit = agent.post(
                    "/v1/refit/megatron", json={"version": weight_version, "session": SESSION, "timeoutSeconds": 90}
                )
                assert refit.status_code == 202, refit.text
                status = refit_harness.AgentClient(served.agent_url).wait_finished(WAIT_SECONDS)
                assert status["phase"] == "succeeded", status
                trainer.expect("swapped")
                assert megatron_trainer.checksum(backend.model) == sent, "the engine's weights equal the trainer's"
                tokens, served_version = refit_harness.completion_ids(served.frontend_url, PROMPT, NEW_TOKENS)
                assert served_version == str(weight_version)
                served_tokens[weight_version] = tokens
                measured[f"v{weight_version}"] = {
                    "phases_ms": {phase["name"]: phase["milliseconds"] for phase in status["phases"]},
                    "bytes": status["bytesReceived"],
                    "tensors": status["tensorsWritten"],
                }
            left = agent.post("/v1/refit/megatron/leave", json={"session": SESSION})
            assert left.status_code == 200 and left.json()["world"]["phase"] == "left"
        trainer.tell("exit")
    finally:
        trainer.close()
    gpu.report(f"megatron_native_{copy_backend}", **measured, tokens=served_tokens)
    assert served_tokens[1] != served_tokens[0], "version 1 (other weights) changes the greedy tokens"
    assert served_tokens[2] == served_tokens[0], "version 2 (the start's weights again) serves the start's tokens"
    assert megatron_trainer.checksum(backend.model) == initial


def test_swaps_with_integrity_report_each_ranks_parameter_digests_as_numpy_computes_them(
    backend: megatron.MegatronBackend, tmp_path: Path
) -> None:
    """``integrity: checksum`` on a megatron-native refit: after megatron-core's swap the rank digests
    its parameters on the GPU (the Triton kernel when Triton is installed) and reports them
    (``verification.method: agreement``, for the operator to compare across shards). The digests equal
    numpy's over the same bytes, differ for another version, and come back for the start's weights."""
    port = refit_harness.free_port() - 1  # the group's store listens at port + 1
    trainer = TrainerProcess(port, "gloo", torch.cuda.current_device(), tmp_path / "trainer.log")
    served_backend = cast(Any, backend)
    reported: dict[int, list[str]] = {}
    try:
        with (
            engine_harness.serve(served_backend, engine_harness.token_file(tmp_path)) as served,
            served.agent() as agent,
        ):
            initial = parameter_digests.reference(backend.parameters())
            trainer.expect("built")
            rendezvous = {"address": "127.0.0.1", "port": port, "worldSize": 2, "rankOffset": 1, "trainerWorldSize": 1}
            join = agent.post(
                "/v1/refit/megatron/join",
                json={"session": SESSION, "rendezvous": rendezvous, "copyBackend": "gloo", "timeoutSeconds": 90},
            )
            assert join.status_code == 202, join.text
            trainer.expect("prepared")
            assert wait_joined(agent)["phase"] == "joined"
            for weight_version, seed in VERSIONS:
                trainer.tell(f"swap {seed}")
                trainer.expect("checksum")
                body = {"version": weight_version, "session": SESSION, "timeoutSeconds": 90, "integrity": "checksum"}
                refit = agent.post("/v1/refit/megatron", json=body)
                assert refit.status_code == 202, refit.text
                status = refit_harness.AgentClient(served.agent_url).wait_finished(WAIT_SECONDS)
                assert status["phase"] == "succeeded", status
                trainer.expect("swapped")
                verification = status["verification"]
                assert (verification["integrity"], verification["method"]) == ("checksum", "agreement"), verification
                assert verification["bucketDigests"] == parameter_digests.reference(backend.parameters())
                reported[weight_version] = verification["bucketDigests"]
            agent.post("/v1/refit/megatron/leave", json={"session": SESSION})
        trainer.tell("exit")
    finally:
        trainer.close()
    assert reported[1] != initial, "version 1 (other weights) has other digests"
    assert reported[2] == initial, "version 2 (the start's weights again) has the start's digests"
    if importlib.util.find_spec("triton") is not None:
        assert digest._kernel() is not None, "on CUDA with Triton the digests take the kernel"
    parameters = backend.parameters()
    torch.cuda.synchronize()
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        parameter_digests.digest_tensors(parameters)
        timings.append(time.perf_counter() - started)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in parameters.values())
    gpu.report("megatron_native_digests", bytes=nbytes, digest_ms=[round(t * 1000, 3) for t in timings])


# -- the trainer process ---------------------------------------------------------------------------


def _say(line: str) -> None:
    """One line to the test (the trainer's stdout is the test's pipe)."""
    sys.stdout.write(SAID + line + "\n")
    sys.stdout.flush()


def _trainer(port: int, copy_backend: str) -> None:
    """NeMo RL's Megatron synchronizer on the trainer's side, on its own world of one rank."""
    faulthandler.dump_traceback_later(240, exit=True)  # a hang prints every thread's stack and ends
    from megafleet_engine.backends.megatron import build, live_weights, model_sources

    torch.cuda.set_device(0)
    parsed = model_sources.parse_source(gpu.SOURCE)
    layout, _ = build.init_parallel(base.Parallel(), seed=0)
    model = build.build_model(parsed.shape, layout, torch.bfloat16, gpu.MAX_SEQUENCE_LENGTH, megatron.EngineOptions())
    writer = live_weights.Weights(model, parsed.shape, layout)
    writer.write(gpu.scaled_reference_weights(seed=7))  # neither version's weights until told
    _say("built")
    refit = build.megatron_core("resharding.refit")
    services = build.megatron_core("resharding.copy_services")
    trainer_world = torch.distributed.get_world_size()
    store, group = megatron_trainer.refit_group("127.0.0.1", port, trainer_world + 1, 0, refit_backend=copy_backend)
    service = services.NCCLCopyService(group=group) if copy_backend == "nccl" else services.GlooCopyService(group=group)
    refit.prepare_swap_model_weights(model, None, group=group, src_rank_offset=0, dst_rank_offset=trainer_world)
    _say("prepared")
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command != "swap":
            break
        writer.write(gpu.scaled_reference_weights(seed=int(argument)))
        torch.cuda.synchronize()
        _say(f"checksum {megatron_trainer.checksum(model)}")
        refit.swap_model_weights(
            model, None, refit_method=service, group=group, src_rank_offset=0, dst_rank_offset=trainer_world
        )
        _say("swapped")
    del store
    os._exit(0)  # no process-group teardown: it can hang (see test_gpu_megatron's TP worker)


if __name__ == "__main__":
    _trainer(int(sys.argv[1]), sys.argv[2])
