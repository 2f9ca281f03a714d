"""Refit bandwidth over NCCL, trainer GPU to engine GPU, against NCCL's own broadcast bandwidth.

One engine process (``python -m megafleet_engine.cli``, the ``megafleet-engine`` command's code path,
configured by ``MEGAFLEET_*`` variables: megatron backend, ``random://llama-8b``, bf16, the engine's
GPU only visible, agent on loopback with a token file) receives weight versions from this process,
the trainer, which holds the full set of Hugging Face-named bf16 tensors of the same shape on its GPU
and sends them with :class:`megafleet_protocol.refit.sender.WeightSender` after ``POST /v1/refit/prepare``, as
the operator and an RL trainer do. Measured in the same run:

1. NCCL broadcast bandwidth trainer GPU -> engine GPU (``torch.distributed`` between this process and
   a helper process on the engine's GPU: this script run with ``--peer``), before and after the
   refits;
2. full refits (several per bucket size, over one trainer session each, as an RL loop keeps its
   sender open): the first refit of a series builds the transfer group (store, group, handshake),
   the following ones keep it (the engine's status says ``reused``). Reported apart: the headline is
   the reused-group refits (the steady state of a training run), the first refit next to it. For
   each: end to end (prepare call -> the agent reports the new version served), transport only (the
   sender's ``transfer`` phase, the receiver's ``receive``), every phase of both ends, bytes, GB/s
   and the ratio to (1);
3. the refit's fixed cost: the wire protocol cannot send an empty version (the SDK refuses an empty
   tensor set and every receiver requires all of its parameters), so this reports the fixed phases
   of the real refits and full refits of a second, ~6 MB engine started alongside.

Each refit is checked: the status succeeded with every byte, ``/v1/state`` and a greedy completion
through the OpenAI frontend report the new version, and the completion's tokens match those of every
earlier version that was sent the same tensors (odd and even versions get two different tensor sets)
and differ from the other set's.

Run on a machine with two GPUs (megatron-core installed; see bench/README.md)::

    PYTHONPATH=engine:operator:protocol python3 bench/refit_nccl.py --out bench/results/

``--cpu`` runs the same code path on CPU (gloo, transformers backend, ``tiny://llama``) in well
under a minute: a smoke test of the script itself, no figure of interest.

``--integrity none,checksum`` alternates the refits of every series between those integrities (ABAB;
``checksum``: the engine asks for ``mf64``-sealed buckets and checks every trailer, the trainer seals
them) and reports each integrity's medians and the cost of digests, (with - without) / without, of the
reused-group refits; pass ``--repeats`` of at least 21 for ten of each after the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import http.client
import importlib.metadata
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # TCPStore: torch.distributed re-exports it untyped

from megafleet_engine.backends import megatron, weight_maps
from megafleet_protocol import engine_settings, vocabulary
from megafleet_protocol import env as protocol_env
from megafleet_protocol.refit import errors as refit_errors
from megafleet_protocol.refit import sender as sdk

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
ADDRESS = "127.0.0.1"
AGENT_TOKEN = "refit-bench-agent-token"
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off, as this workplace's two-GPU machines need (bench/README.md)."""
PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # <|bos|> then "Hello, world" as bytes
NEW_TOKENS = 16
SEEDS = (202, 101)  # tensors of even and odd versions; the engine's own (version 0) come from seed 0
STORE_TIMEOUT = datetime.timedelta(seconds=900)
SERVING = re.compile(r"serving the (\w+) on http://(\S+)")
"""The engine's log line for each server it started (what tests/helpers/engine_command.py reads too)."""
READY_POLL_SECONDS = 0.5
PROGRESS_EVERY_SECONDS = 5.0
ENGINE_OPTION_FIELDS = {
    "max_batch_size": "MAX_BATCH_SIZE",
    "cuda_graphs": "CUDA_GRAPHS",
    "kv_cache_gib": "KV_CACHE_GIB",
}
"""Engine settings this benchmark sets (settings field -> ``MEGAFLEET_*`` suffix); each is passed only
when this checkout's :class:`megafleet_protocol.engine_settings.Settings` has the field (the CLI's way to
megatron's ``EngineOptions`` is recent), and reported as not read otherwise."""

STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {message}", flush=True)


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why."""


# -- configuration ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
    """What differs between the GPU benchmark and the CPU smoke run; the code path is the same."""

    name: Literal["gpu", "cpu"]
    machine: str  # in the result file's name
    backend: vocabulary.CollectiveBackend  # the refit's and the baseline's
    engine_backend: vocabulary.BackendName
    dtype: Literal["bfloat16", "float32"]
    source: str
    tiny_source: str
    nccl_sizes_mib: str
    bucket_sizes_mib: str

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype


GPU = Mode(
    name="gpu",
    machine="h200x2",
    backend="nccl",
    engine_backend="megatron",
    dtype="bfloat16",
    source="random://llama-8b",
    # ~6 MB with the 8B model's head size (128): the smallest refit the protocol can do
    tiny_source="random://llama-8b?layers=1&hidden=512&heads=4&kv_heads=2&intermediate=1024&vocab=512",
    nccl_sizes_mib="1024,4096",
    bucket_sizes_mib="1024,512,2048",
)
CPU = Mode(
    name="cpu",
    machine="cpu",
    backend="gloo",
    engine_backend="transformers",
    dtype="float32",
    source="tiny://llama",
    tiny_source="tiny://llama?layers=1&hidden=16&heads=2&kv_heads=1&intermediate=32",
    nccl_sizes_mib="16",
    bucket_sizes_mib="1,4",
)


def sizes(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def integrities(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values or any(value not in ("none", "checksum") for value in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"expected distinct integrities (none, checksum) separated by commas, got {text!r}"
        )
    return values


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback address now."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((ADDRESS, 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def device_of(mode: Mode, gpu: int) -> torch.device:
    return torch.device("cuda", gpu) if mode.name == "gpu" else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Sequence[float], digits: int = 4) -> float | None:
    """The rounded median, or ``None`` for no values (JSON has no NaN)."""
    return round(statistics.median(values), digits) if values else None


# -- machine ---------------------------------------------------------------------------------------


def machine(mode: Mode) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def command(*argv: str) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            return f"{argv[0]} failed: {error}"

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron_core": version("megatron-core"),
        "transformers": version("transformers"),
    }
    if mode.name == "gpu":
        nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        info["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        info["gpus"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        info["nvidia_smi"] = command(
            "nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,pci.bus_id", "--format=csv,noheader"
        )
        info["topology"] = command("nvidia-smi", "topo", "-m")
        info["nccl_environment"] = {key: os.environ.get(key) for key in sorted(NVLS_OFF)}
    return info


# -- the engine processes --------------------------------------------------------------------------


def engine_option_env(requested: dict[str, str | None]) -> tuple[dict[str, str], dict[str, str]]:
    """The ``MEGAFLEET_*`` variables for ``requested`` engine options (field -> value; ``None``: the
    engine's default) that this checkout's engine reads, and those it does not (reported, not passed)."""
    fields = {field.name for field in dataclasses.fields(engine_settings.Settings)}
    passed: dict[str, str] = {}
    ignored: dict[str, str] = {}
    for field, value in requested.items():
        if value is None:
            continue
        variable = protocol_env.PREFIX + ENGINE_OPTION_FIELDS[field]
        (passed if field in fields else ignored)[variable] = value
    return passed, ignored


class EngineProcess:
    """One ``python -m megafleet_engine.cli`` on loopback, its output in ``log_path``."""

    def __init__(
        self,
        name: str,
        source: str,
        *,
        mode: Mode,
        gpu: int,
        token_file: Path,
        log_path: Path,
        max_sequence_length: int,
        extra_env: dict[str, str],
        nccl_debug: bool,
    ) -> None:
        self.name = name
        self.source = source
        env = {key: value for key, value in os.environ.items() if not key.startswith(protocol_env.PREFIX)}
        env.update(
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(ROOT / "engine"), str(ROOT / "protocol"), os.environ.get("PYTHONPATH")])
            ),
            PYTHONUNBUFFERED="1",
            MEGAFLEET_BACKEND=mode.engine_backend,
            MEGAFLEET_MODEL_SOURCE=source,
            MEGAFLEET_SERVED_MODEL_NAME=name,
            MEGAFLEET_DTYPE=mode.dtype,
            MEGAFLEET_MAX_SEQUENCE_LENGTH=str(max_sequence_length),
            MEGAFLEET_WEIGHTS_INITIAL="checkpoint",
            MEGAFLEET_HOST=ADDRESS,
            MEGAFLEET_FRONTEND_PORT="0",  # any free port, read back from the log: never a race for one
            MEGAFLEET_AGENT_PORT="0",
            MEGAFLEET_METRICS_PORT="0",
            MEGAFLEET_AGENT_TOKEN_FILE=str(token_file),
            MEGAFLEET_LOCAL_GPUS="1" if mode.name == "gpu" else "0",
            CUDA_VISIBLE_DEVICES=str(gpu) if mode.name == "gpu" else "",
        )
        if nccl_debug and mode.name == "gpu":
            env.setdefault("NCCL_DEBUG", "INFO")  # its "via P2P/..." lines name the transport used
            env.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
        env.update(extra_env)
        self.env = {key: value for key, value in env.items() if key.startswith(protocol_env.PREFIX)}
        self.addresses: dict[str, str] = {}  # server name -> host:port, from the log's "serving the ..." lines
        self.log_path = log_path
        self._log = log_path.open("w")
        self.started = time.monotonic()
        self.ready_seconds: float | None = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megafleet_engine.cli"], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self._shown = 0
        self._agent: Http | None = None

    def new_log_lines(self) -> list[str]:
        """Lines the engine logged since the last call (noting the addresses its servers bound)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        fresh, self._shown = lines[self._shown :], len(lines)
        for line in fresh:
            if match := SERVING.search(line):
                self.addresses[match.group(1)] = match.group(2)
        return fresh

    @property
    def frontend_url(self) -> str:
        return f"http://{self.addresses['frontend']}"

    @property
    def agent_url(self) -> str:
        return f"http://{self.addresses['agent']}"

    def tail(self, count: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-count:])

    def agent(self) -> Http:
        """The agent's client: one kept-alive connection for the engine's life."""
        if self._agent is None or self._agent.base_url != self.agent_url:
            self._agent = Http(self.agent_url, AGENT_TOKEN)
        return self._agent

    def state(self) -> str:
        """The engine's state as its agent reports it (``loading`` before the agent is up)."""
        if "agent" not in self.addresses:
            return "loading (agent not up yet)"
        status, body = self.agent().call("GET", "/v1/state", quiet=True)
        if status == 0:
            return "loading (agent not up yet)"
        return str(body.get("state", status)) if isinstance(body, dict) else str(status)

    def terminate(self) -> None:
        """Ask the engine to stop (SIGTERM: it stops its servers gracefully); :meth:`wait` for it."""
        if self.process.poll() is None:
            self.process.terminate()

    def wait(self, timeout: float = 30.0) -> None:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)
        self._log.close()


def wait_ready(engines: Sequence[EngineProcess], timeout: float) -> None:
    """Poll every engine's ``/readyz`` until all answer ready, printing progress and their logs."""
    deadline = time.monotonic() + timeout
    last_progress = 0.0
    pending = list(engines)
    while pending:
        for engine in list(pending):
            for line in engine.new_log_lines():
                if "NCCL INFO" not in line:  # NCCL_DEBUG=INFO lines stay in the log
                    say(f"  [{engine.name}] {line[:240]}")
            if engine.process.poll() is not None:
                raise BenchError(f"engine {engine.name} exited ({engine.process.returncode}):\n{engine.tail()}")
            if "agent" not in engine.addresses:
                continue  # still loading: the servers start once the model is built
            status, _ = engine.agent().call("GET", "/readyz", quiet=True)
            if status == 200:
                engine.ready_seconds = time.monotonic() - engine.started
                say(f"engine {engine.name} ready after {engine.ready_seconds:.1f} s")
                pending.remove(engine)
        if not pending:
            return
        now = time.monotonic()
        if now > deadline:
            raise BenchError(f"engines {[e.name for e in pending]} not ready within {timeout:.0f} s")
        if now - last_progress >= PROGRESS_EVERY_SECONDS:
            last_progress = now
            states = ", ".join(f"{e.name} {e.state()}" for e in pending)
            say(f"waiting for the engines ({states})")
        time.sleep(READY_POLL_SECONDS)  # polling start-up with a deadline


class Http:
    """JSON over HTTP with the standard library, over one kept-alive loopback connection (as the
    operator's HTTP client keeps its connections to the agents), opened again when the server
    closed it. No proxy is ever involved (``http.client`` reads no proxy settings)."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        self.base_url = base_url
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.last_headers: dict[str, str] = {}
        self._connection: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Any = None, *, quiet: bool = False) -> tuple[int, Any]:
        """``(status, parsed body)``; ``quiet``: a refused connection is ``(0, None)``, not an error.
        A kept connection the server closed meanwhile is opened again once (every call here is
        idempotent: a repeated prepare is answered with the attempt it started)."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):
            connection = self._connection
            if connection is None:
                connection = http.client.HTTPConnection(self._host, self._port, timeout=5 if quiet else 120)
                self._connection = connection
            try:
                connection.request(method, path, body=data, headers=self.headers)
                response = connection.getresponse()
                payload = response.read()
            except (http.client.HTTPException, OSError) as error:
                connection.close()
                self._connection = None
                stale = isinstance(error, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if attempt == 1 and stale:
                    continue
                if quiet:
                    return 0, None
                raise
            self.last_headers = dict(response.getheaders())
            try:
                return response.status, json.loads(payload or b"null")
            except json.JSONDecodeError:
                return response.status, payload.decode(errors="replace")
        raise AssertionError("unreachable")


# -- the broadcast baseline ------------------------------------------------------------------------


def broadcast_round(
    sizes_mib: Sequence[int], warmup: int, iterations: int, device: torch.device
) -> list[dict[str, Any]]:
    """Broadcast from rank 0 of the default group, per size: ``warmup`` untimed, then ``iterations``
    timed back to back and closed by a one-element all-reduce (so rank 0's clock stops only once the
    peer has everything). Both ranks run it; rank 0's figures are the ones reported."""
    results = []
    flag = torch.zeros(1, device=device)
    for size_mib in sizes_mib:
        buffer = torch.full((size_mib * MIB,), 7, dtype=torch.uint8, device=device)
        for _ in range(warmup):
            dist.broadcast(buffer, src=0)
        dist.all_reduce(flag)
        synchronize(device)
        started = time.perf_counter()
        for _ in range(iterations):
            dist.broadcast(buffer, src=0)
        dist.all_reduce(flag)
        synchronize(device)
        seconds = (time.perf_counter() - started) / iterations
        results.append(
            {
                "size_mib": size_mib,
                "warmup": warmup,
                "iterations": iterations,
                "ms_per_broadcast": round(seconds * 1e3, 3),
                "gb_per_s": round(size_mib * MIB / seconds / 1e9, 1),
            }
        )
        del buffer
    return results


class Peer:
    """The broadcast baseline's second rank: this script with ``--peer`` on the engine's GPU."""

    def __init__(self, mode: Mode, gpu: int, args: argparse.Namespace, log_path: Path) -> None:
        self.port = free_ports(1)[0]
        self.store = c10d.TCPStore(ADDRESS, self.port, 2, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        spec = {
            "backend": mode.backend,
            "port": self.port,
            "device": "cuda:0" if mode.name == "gpu" else "cpu",
            "sizes_mib": args.nccl_sizes_mib,
            "warmup": args.nccl_warmup,
            "iterations": args.nccl_iterations,
            "rounds": ["before", "after"],
        }
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=str(gpu) if mode.name == "gpu" else "")
        if args.nccl_debug and mode.name == "gpu":
            env.setdefault("NCCL_DEBUG", "INFO")
            env.setdefault("NCCL_DEBUG_SUBSYS", "INIT")
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--peer", json.dumps(spec)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.finished_rounds = False  # set once the trainer ran the peer's last round with it

    def join(self, backend: vocabulary.CollectiveBackend) -> None:
        dist.init_process_group(backend, store=self.store, rank=0, world_size=2, timeout=STORE_TIMEOUT)

    def release(self, round_name: str) -> None:
        """Let the peer start round ``round_name`` (it waits for this, idle, in between)."""
        self.store.set(f"round/{round_name}", "go")

    def finish(self) -> int | None:
        """Wait for the peer to end after its last round; stop it at once if that round never came."""
        if not self.finished_rounds:
            self.process.kill()
        try:
            return self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return None
        finally:
            self._log.close()

    def transports(self) -> list[str]:
        return nccl_transports(self.log_path)


def nccl_transports(log_path: Path) -> list[str]:
    """The distinct NCCL channel transports in a log (``NCCL_DEBUG=INFO`` lines ``... via P2P/...``)."""
    found = set()
    for line in log_path.read_text(errors="replace").splitlines():
        if "NCCL INFO Channel" in line and " via " in line:
            found.add(line.split(" via ", 1)[1].strip())
    return sorted(found)


def peer_main(spec: dict[str, Any]) -> int:
    """The ``--peer`` process: rank 1 of the baseline's group; one round per name in ``rounds``."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = c10d.TCPStore(ADDRESS, int(spec["port"]), 2, False, timeout=STORE_TIMEOUT)
    dist.init_process_group(spec["backend"], store=store, rank=1, world_size=2, timeout=STORE_TIMEOUT)
    for index, name in enumerate(spec["rounds"]):
        if index:
            store.wait([f"round/{name}"])  # idle (no kernel queued) while the refits run
        broadcast_round(spec["sizes_mib"], spec["warmup"], spec["iterations"], device)
        print(f"peer: round {name} done", flush=True)
    # the group is left to process exit: destroy_process_group() can hang here
    # (docs/incidents.md#nccl-destroy-hang)
    return 0


# -- the trainer's tensors ---------------------------------------------------------------------------


def shape_of(source: str) -> weight_maps.LlamaShape:
    return megatron.parse_source(source).shape


def trainer_tensors(shape: weight_maps.LlamaShape, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every HF tensor the engine's weight maps expect, full shape, allocated once."""
    return {name: torch.empty(size, dtype=dtype, device=device) for name, size in weight_maps.hf_shapes(shape).items()}


@torch.no_grad()
def fill(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """Values of weight set ``seed``, in place: matrices N(0, 0.02), norms N(1, 0.05)."""
    generator = torch.Generator(device=next(iter(tensors.values())).device).manual_seed(seed)
    for tensor in tensors.values():
        if tensor.dim() == 1:
            tensor.normal_(1.0, 0.05, generator=generator)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


# -- one refit -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """An engine the trainer refits, with its own tensors and version counter."""

    engine: EngineProcess
    tensors: dict[str, torch.Tensor]
    version: int = 0
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # version -> greedy tokens
    sender: sdk.WeightSender | None = None  # kept open across the refits of a series

    def close_sender(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


def refit(
    target: Target,
    *,
    bucket_mib: int,
    backend: vocabulary.CollectiveBackend,
    device: torch.device,
    poll_seconds: float,
    timeout_seconds: int,
    fresh: bool,
    integrity: str = "none",
) -> dict[str, Any]:
    """One refit to the next version, timed the way the operator and the trainer see it: over the
    target's open sender (the group kept), or, ``fresh``, a new sender on a new port (a new session
    and group, as the first refit of a training run); ``integrity`` is the prepare body's."""
    version = target.version + 1
    fill(target.tensors, SEEDS[version % 2])
    synchronize(device)
    agent = target.engine.agent()
    if fresh:
        target.close_sender()
    sender = target.sender
    port = free_ports(1)[0] if sender is None else sender.rendezvous.port
    body = {
        "version": version,
        "transport": "broadcast",
        "bucketSizeMiB": bucket_mib,
        "timeoutSeconds": timeout_seconds,
        "rendezvous": {"address": ADDRESS, "port": port, "worldSize": 2, "rankOffset": 1, "trainerWorldSize": 1},
        "integrity": integrity,
    }
    started = time.perf_counter()
    code, answer = agent.call("POST", "/v1/refit/prepare", body)
    if code != 202:
        raise BenchError(f"prepare answered {code}: {answer}")
    prepared = time.perf_counter()
    try:
        if sender is None:
            sender = sdk.WeightSender(
                port, 2, backend=backend, address=ADDRESS, device=device, timeout_seconds=float(timeout_seconds)
            )
            target.sender = sender
            sender.init()  # the store and the session (the group is built by the first send)
        joined = time.perf_counter()
        report = sender.send(target.tensors.items(), bucket_size_mib=bucket_mib, version=version)
        sent = time.perf_counter()
        _, first_status = agent.call("GET", "/v1/refit/status")  # the engine acknowledged only once it served N
        status = wait_published(agent, version, poll_seconds, timeout_seconds, first=first_status)
        published = time.perf_counter()
    except (refit_errors.RefitError, BenchError) as error:
        target.close_sender()  # a failed send leaves the sender unusable; the next refit starts a session
        _, status = agent.call("GET", "/v1/refit/status")
        raise BenchError(f"refit to version {version} failed: {error}; engine status: {status}") from error
    target.version = version
    _, state = agent.call("GET", "/v1/state")
    payload = nbytes(target.tensors)
    end_to_end = sent - started
    phases = {phase["name"]: phase["milliseconds"] / 1e3 for phase in status["phases"]}
    return {
        "engine_name": target.engine.name,
        "version": version,
        "bucket_mib": bucket_mib,
        "integrity": integrity,
        "verified": report.verified,
        "verification": status.get("verification"),
        "tensors": report.tensors,
        "buckets": report.buckets,
        "payload_bytes": payload,
        "bytes_sent": report.bytes_sent,
        "bytes_received": status["bytesReceived"],
        "tensors_written": status["tensorsWritten"],
        "group": "reused" if report.reused else "fresh",
        "engine_reused": status.get("reused"),
        "manifest_sent": report.manifest_sent,
        "published_when_send_returned": published_now(first_status, version),
        "end_to_end_s": round(end_to_end, 4),
        "trainer": {
            "prepare_http_s": round(prepared - started, 4),
            "init_s": round(joined - prepared, 4),
            "send_s": round(report.seconds, 4),
            "send_phases_s": {name: round(seconds, 4) for name, seconds in report.phases.items()},
            "status_read_s": round(published - sent, 4),
        },
        "engine": {
            "duration_s": status["durationMilliseconds"] / 1e3,
            "phases_s": phases,
            "fixed_s": round(sum(phases.get(name, 0.0) for name in ("suspend", "join", "resume")), 3),
        },
        "gb_per_s": {
            "end_to_end": round(payload / end_to_end / 1e9, 2),
            "transfer_sender": round(payload / report.phases["transfer"] / 1e9, 2),
            "receive_engine": round(payload / phases["receive"] / 1e9, 2) if phases.get("receive") else None,
        },
        "state_after": {"state": state["state"], "weight_version": state["weightVersion"]},
    }


def published_now(status: Any, version: int) -> bool:
    """Whether a ``/v1/refit/status`` body shows the attempt succeeded and the engine serving ``version``."""
    return (
        isinstance(status, dict)
        and status.get("phase") == "succeeded"
        and status.get("weightVersion") == version
        and status.get("state") == "ready"
    )


def wait_published(
    agent: Http, version: int, poll_seconds: float, timeout: float, *, first: Any = None
) -> dict[str, Any]:
    """Poll ``/v1/refit/status`` until the attempt succeeded and the engine serves ``version``
    (``first``: a status already read, looked at before polling)."""
    deadline = time.monotonic() + timeout
    status = first
    while True:
        if status is None:
            code, status = agent.call("GET", "/v1/refit/status")
            if code != 200:
                raise BenchError(f"refit status answered {code}: {status}")
        if status["phase"] == "failed":
            raise BenchError(f"refit to version {version} failed: {status['error']}")
        if published_now(status, version):
            result: dict[str, Any] = status
            return result
        status = None
        if time.monotonic() > deadline:
            raise BenchError(f"version {version} not published within {timeout:.0f} s: {status}")
        time.sleep(poll_seconds)  # polling the agent's status with a deadline, as the operator does


def complete(engine: EngineProcess) -> dict[str, Any]:
    """A greedy completion through the OpenAI frontend: its tokens and the version that produced them."""
    frontend = Http(engine.frontend_url)
    body = {
        "model": engine.name,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    code, answer = frontend.call("POST", "/v1/completions", body)
    if code != 200:
        raise BenchError(f"completion answered {code}: {answer}")
    header = {key.lower(): value for key, value in frontend.last_headers.items()}
    return {
        "weight_version": answer.get("weight_version"),
        "header_weight_version": header.get("x-megafleet-weight-version"),
        "token_ids": [int(token) for token in answer["choices"][0]["token_ids"]],
    }


def checked_refit(target: Target, results: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """:func:`refit`, then the checks: version everywhere, every byte, tokens of the right weight set."""
    run = refit(target, **options)
    version = run["version"]
    completion = complete(target.engine)
    target.tokens[version] = completion["token_ids"]
    same_set = [v for v in target.tokens if v and v % 2 == version % 2 and v != version]
    other_set = [v for v in target.tokens if v and v % 2 != version % 2]
    run["checks"] = {
        "status_succeeded_with_version": True,  # wait_published returned
        "published_when_send_returned": run["published_when_send_returned"],
        "state_serves_version": run["state_after"]["weight_version"] == version
        and run["state_after"]["state"] == "ready",
        "completion_weight_version": completion["weight_version"] == version
        and completion["header_weight_version"] == str(version),
        "every_byte_received": run["bytes_received"] == run["bytes_sent"],
        "verified_as_asked": run["verified"] == (run["integrity"] == "checksum")
        and (run["verification"] or {}).get("method", "none")
        == ("trainerDigest" if run["integrity"] == "checksum" else "none"),
        "engine_and_trainer_agree_on_the_group": run["engine_reused"] == (run["group"] == "reused"),
        "tokens_equal_same_weights": all(target.tokens[v] == completion["token_ids"] for v in same_set),
        "tokens_differ_other_weights": all(target.tokens[v] != completion["token_ids"] for v in other_set),
        "tokens_differ_engine_own_weights": target.tokens.get(0) != completion["token_ids"],
    }
    run["completion_tokens"] = completion["token_ids"]
    results.append(run)
    failed = [name for name, ok in run["checks"].items() if not ok]
    say(
        f"  version {version} ({run['group']} group): end to end {run['end_to_end_s'] * 1e3:.1f} ms "
        f"({run['gb_per_s']['end_to_end']} GB/s), transfer {run['trainer']['send_phases_s']['transfer'] * 1e3:.1f} ms "
        f"({run['gb_per_s']['transfer_sender']} GB/s), engine phases "
        + ", ".join(f"{name} {seconds * 1e3:.0f}" for name, seconds in run["engine"]["phases_s"].items())
        + " ms"
        + (f"; CHECKS FAILED: {failed}" if failed else "; checks passed")
    )
    return run


def summary(runs: Sequence[dict[str, Any]], nccl_gb_per_s: float | None) -> dict[str, Any]:
    """Medians over ``runs`` (one bucket size) and the ratios to the broadcast baseline."""
    if not runs:
        return {}

    def med(path: Sequence[str]) -> float | None:
        values = []
        for run in runs:
            value: Any = run
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, int | float):
                values.append(float(value))
        return median(values)

    phase_names = sorted({name for run in runs for name in run["engine"]["phases_s"]})
    send_names = sorted({name for run in runs for name in run["trainer"]["send_phases_s"]})
    result: dict[str, Any] = {
        "runs": len(runs),
        "payload_bytes": runs[0]["payload_bytes"],
        "end_to_end_s": med(["end_to_end_s"]),
        "transfer_sender_s": med(["trainer", "send_phases_s", "transfer"]),
        "receive_engine_s": med(["engine", "phases_s", "receive"]),
        "engine_fixed_s": med(["engine", "fixed_s"]),
        "engine_duration_s": med(["engine", "duration_s"]),
        "trainer_init_s": med(["trainer", "init_s"]),
        "engine_phases_s": {name: med(["engine", "phases_s", name]) for name in phase_names},
        "send_phases_s": {name: med(["trainer", "send_phases_s", name]) for name in send_names},
    }
    rates = {key: med(["gb_per_s", key]) for key in ("end_to_end", "transfer_sender", "receive_engine")}
    result["gb_per_s"] = rates
    if nccl_gb_per_s:
        ratios = {key: None if value is None else round(value / nccl_gb_per_s, 3) for key, value in rates.items()}
        result["ratio_to_nccl_broadcast"] = {**ratios, "goal_end_to_end": 0.75}
    return result


DEFINITIONS = {
    "nccl_broadcast.gb_per_s": "bytes of one broadcast / its time: torch.distributed.broadcast from this "
    "process (trainer GPU) to a helper process on the engine GPU, back to back after warm-up, closed by a "
    "one-element all-reduce; algorithm bandwidth (= bus bandwidth for two ranks), GB = 1e9 bytes",
    "group": "fresh: the refit built the transfer group (a new sender: store, session, NCCL communicator, "
    "handshake), as the first refit of a training run; reused: it kept the group of the previous refit of the "
    "series (the same open WeightSender, the engine's parked communicator; its status says reused), as every "
    "later refit of a training run. Each series (bucket size) starts with one fresh refit; the headline and "
    "each series' median are over the reused refits, first_refit over the fresh ones",
    "end_to_end_s": "trainer clock, from just before POST /v1/refit/prepare (over the agent client's kept-alive "
    "connection, as the operator's client keeps one) to WeightSender.send() returning: send returns once every "
    "receiver acknowledged, and a receiver acknowledges only after its engine resumed serving version N "
    "(suspend, join, transfer, in-place writes, resume, version published). The /v1/refit/status read right "
    "after must already show phase succeeded, weightVersion N and state ready (check "
    "published_when_send_returned; trainer.status_read_s is that read, not counted)",
    "manifest_sent": "whether the round exchanged the manifest (manifest, verdicts, go); false when the engine "
    "still held the previous refit's manifest and the trainer's decision confirmed it (same tensors, shapes, "
    "dtypes, bucket size and transport)",
    "trainer.init_s": "WeightSender.init() of a fresh refit: the TCPStore and the session id (0 when reused)",
    "trainer.send_phases_s": "SendReport.phases: join (every receiver's hello, the group decision; fresh: the "
    "NCCL group and the handshake), verdicts (manifest published to every verdict + go; ~0 when the manifest was "
    "held), transfer (bucket k+1 packed into the second staging buffer on a side stream while bucket k is "
    "broadcast; until the last broadcast completed), acknowledgements (waiting for the engine's done: its last "
    "writes, the in-place check, resume)",
    "engine.phases_s": "the agent's /v1/refit/status phases (ms resolution): suspend (runs alongside the join; "
    "nothing is received before it ended), join (reused: session check on the parked store client, hello, the "
    "trainer's decision; fresh: connect to the store, build the group, handshake; then, unless the manifest was "
    "held, manifest check, verdict, go), receive and apply (pipelined: bucket k is written on "
    "a side stream while bucket k+1 is received; receive = time waiting for bucket data, apply = time "
    "waiting for writes, so receive + apply is the wall time of the transfer)",
    "engine.fixed_s": "suspend + join + resume: the phases whose cost does not depend on the bytes",
    "engine.duration_s": "the agent's own durationMilliseconds (prepare accepted to outcome)",
    "gb_per_s": "payload bytes (every tensor's bytes, what the engine installs) / end_to_end_s, / the sender's "
    "transfer phase, / the engine's receive phase",
    "ratio_to_nccl_broadcast": "gb_per_s / the broadcast baseline's GB/s at --ratio-size-mib measured before "
    "the refits; goal end_to_end >= 0.75 (the refit issue's stretch tier)",
    "integrity": "--integrity: the refits of each series alternate these integrities (ABAB), the prepare body's "
    "integrity; checksum: the engine asks the trainer for mf64-sealed buckets and checks every bucket's trailer "
    "as it lands (on its receive stream, one read of the outcome after the last write). Each series' median and "
    "the headline are the first integrity's reused-group refits; by_integrity has each integrity's medians and "
    "integrity_cost (with - without) / without of the transfer (sender's phase; engine receive + apply) and end "
    "to end",
    "zero_byte": "an empty refit cannot be sent: WeightSender.send() refuses an empty tensor set and every "
    "receiver requires all of its parameters in the manifest (receiver.check_manifest). Reported instead: "
    "(a) full refits of a second engine of a ~6 MB model, started alongside on the same GPU (same code path, "
    "same timings); (b) the fixed phases of the full-size refits (engine.fixed_s, trainer.init_s)",
}


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="smoke run on CPU: gloo, transformers, tiny://llama")
    parser.add_argument("--out", help="result file, or a folder (existing, or ending in /) for the default name")
    parser.add_argument("--log-dir", type=Path, help="engine and helper logs (default: a temporary folder)")
    parser.add_argument("--source", help="the engine's model source")
    parser.add_argument("--tiny-source", help="the small engine's model source (zero-byte equivalent)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the small engine")
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--engine-gpu", type=int, default=1)
    parser.add_argument("--bucket-sizes-mib", type=sizes, help="first one is the headline")
    parser.add_argument(
        "--repeats", type=int, default=6, help="refits per bucket size over one sender (the first builds the group)"
    )
    parser.add_argument("--tiny-repeats", type=int, default=4)
    parser.add_argument("--nccl-sizes-mib", type=sizes)
    parser.add_argument("--ratio-size-mib", type=int, help="baseline size for the ratios (default: the first)")
    parser.add_argument("--nccl-warmup", type=int, default=3)
    parser.add_argument("--nccl-iterations", type=int, default=10)
    parser.add_argument("--no-nccl-debug", dest="nccl_debug", action="store_false", help="no NCCL_DEBUG=INFO logs")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="status polls once the sender returned")
    parser.add_argument("--refit-timeout-s", type=int, default=120)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--max-sequence-length", type=int, default=1024)
    parser.add_argument("--max-batch-size", default="16", help="MEGAFLEET_MAX_BATCH_SIZE (fewer graphs to capture)")
    parser.add_argument("--cuda-graphs", choices=["true", "false"], help="MEGAFLEET_CUDA_GRAPHS (default: engine's)")
    parser.add_argument("--kv-cache-gib", help="MEGAFLEET_KV_CACHE_GIB of the main engine (default: engine's)")
    parser.add_argument("--tiny-kv-cache-gib", default="2", help="MEGAFLEET_KV_CACHE_GIB of the small engine")
    parser.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE", help="extra engine env")
    parser.add_argument("--max-seconds", type=float, default=480.0, help="give up (saving what was measured)")
    parser.add_argument(
        "--integrity",
        type=integrities,
        default=["none"],
        help="integrities the refits of each series alternate (ABAB), e.g. none,checksum; the first is the baseline",
    )
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mode = CPU if args.cpu else GPU
    args.mode = mode
    args.source = args.source or mode.source
    args.tiny_source = args.tiny_source or mode.tiny_source
    args.bucket_sizes_mib = args.bucket_sizes_mib or sizes(mode.bucket_sizes_mib)
    args.nccl_sizes_mib = args.nccl_sizes_mib or sizes(mode.nccl_sizes_mib)
    args.ratio_size_mib = args.ratio_size_mib or args.nccl_sizes_mib[0]
    if args.ratio_size_mib not in args.nccl_sizes_mib:
        parser.error("--ratio-size-mib must be one of --nccl-sizes-mib")
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    name = f"refit-nccl-{mode.machine}-{date}.json"
    if args.out is None:
        args.out = (ROOT / "bench" / "results" if mode.name == "gpu" else Path(tempfile.gettempdir())) / name
    elif args.out.endswith("/") or Path(args.out).is_dir():
        args.out = Path(args.out) / name
    else:
        args.out = Path(args.out)
    return args


class Run:
    """The result being built, saved after every step (a partial file survives a failure)."""

    def __init__(self, path: Path, result: dict[str, Any]) -> None:
        self.path = path
        self.result = result
        self.lock = threading.Lock()

    def save(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.result, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer:
        return peer_main(json.loads(args.peer))
    mode: Mode = args.mode
    if mode.name == "gpu":
        for key, value in NVLS_OFF.items():
            os.environ.setdefault(key, value)
        if torch.cuda.device_count() < 2:
            raise SystemExit("needs two CUDA devices (or --cpu for the smoke run)")
    options = {"max_batch_size": args.max_batch_size, "cuda_graphs": args.cuda_graphs}
    main_env, options_not_read = engine_option_env(options | {"kv_cache_gib": args.kv_cache_gib})
    tiny_env, _ = engine_option_env(options | {"kv_cache_gib": args.tiny_kv_cache_gib})
    for item in args.engine_env:
        key, _, value = item.partition("=")
        main_env[key] = tiny_env[key] = value
    result: dict[str, Any] = {
        "benchmark": "refit-nccl",
        "mode": mode.name,
        "machine": machine(mode),
        "config": {
            "source": args.source,
            "tiny_source": None if args.no_tiny else args.tiny_source,
            "dtype": mode.dtype,
            "backend": mode.backend,
            "engine_backend": mode.engine_backend,
            "transport": "broadcast",
            "trainer_device": str(device_of(mode, args.trainer_gpu)),
            "engine_gpu": args.engine_gpu if mode.name == "gpu" else None,
            "bucket_sizes_mib": args.bucket_sizes_mib,
            "repeats": args.repeats,
            "integrity": args.integrity,
            "nccl_sizes_mib": args.nccl_sizes_mib,
            "ratio_size_mib": args.ratio_size_mib,
            "poll_ms": args.poll_ms,
            "engine_options_passed": {"main": main_env, "tiny": tiny_env},
            "engine_options_not_read_by_this_engine": options_not_read,
            "max_sequence_length": args.max_sequence_length,
        },
        "definitions": DEFINITIONS,
        "errors": {},
    }
    run = Run(args.out, result)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="refit-nccl-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"refit benchmark ({mode.name}): results to {args.out}, logs in {log_dir}")
    if options_not_read:
        say(f"this engine does not read {sorted(options_not_read)}; its defaults apply")
    children: list[EngineProcess] = []
    peer_box: list[Peer] = []

    def give_up() -> None:
        say(f"giving up after {args.max_seconds:.0f} s (--max-seconds); stacks follow")
        faulthandler.dump_traceback(all_threads=True)
        result["errors"]["timeout"] = f"gave up after {args.max_seconds:.0f} s"
        run.save()
        for child in children:
            child.process.kill()
        for peer in peer_box:
            peer.process.kill()
        os._exit(3)

    watchdog = threading.Timer(args.max_seconds, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        status = bench(args, mode, run, log_dir, {"main": main_env, "tiny": tiny_env}, children, peer_box)
    except (BenchError, refit_errors.RefitError, RuntimeError, ValueError) as error:
        say(f"FAILED: {type(error).__name__}: {error}")
        result["errors"]["fatal"] = f"{type(error).__name__}: {error}"
        status = 1
    finally:
        watchdog.cancel()
        say(f"stopping the engines ({', '.join(child.name for child in children)})")
        for child in children:
            child.terminate()
        for child in children:
            child.wait()
        for peer in peer_box:
            peer.finish()
        result["wall_s"] = round(time.monotonic() - STARTED, 1)
        run.save()
    say(f"wrote {args.out}")
    return status


def bench(
    args: argparse.Namespace,
    mode: Mode,
    run: Run,
    log_dir: Path,
    engine_env: dict[str, dict[str, str]],
    children: list[EngineProcess],
    peer_box: list[Peer],
) -> int:
    """Every step in order; ``children`` and ``peer_box`` collect the processes started (the caller
    stops them whatever happens)."""
    result = run.result
    device = device_of(mode, args.trainer_gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    main_target, tiny_target, peer = start(args, mode, run, log_dir, engine_env, children, peer_box, device)

    say(f"broadcast baseline ({mode.backend}), before the refits: {args.nccl_sizes_mib} MiB")
    peer.join(mode.backend)
    baseline = {"before": broadcast_round(args.nccl_sizes_mib, args.nccl_warmup, args.nccl_iterations, device)}
    result["nccl_broadcast"] = baseline
    for row in baseline["before"]:
        say(f"  {row['size_mib']} MiB: {row['ms_per_broadcast']} ms, {row['gb_per_s']} GB/s")
    reference = next(row["gb_per_s"] for row in baseline["before"] if row["size_mib"] == args.ratio_size_mib)
    run.save()

    refits = Refits(run, mode, device, args)
    result["refits"] = {}
    for bucket in args.bucket_sizes_mib:
        say(f"refits of engine 'main' with {bucket} MiB buckets ({args.repeats} times)")
        result["refits"][f"bucket_{bucket}_mib"] = refits.series(main_target, bucket, args.repeats, reference)
    zero: dict[str, Any] = {"what": DEFINITIONS["zero_byte"]}
    result["zero_byte"] = zero
    if tiny_target is not None:
        say(f"refits of engine 'tiny' ({nbytes(tiny_target.tensors) / 1e6:.1f} MB, {args.tiny_repeats} times)")
        zero["tiny_refits"] = refits.series(tiny_target, args.bucket_sizes_mib[0], args.tiny_repeats, None)
    headline_group = result["refits"][f"bucket_{args.bucket_sizes_mib[0]}_mib"]["median"].get("group")
    headline_runs = [
        r for r in result["refits"][f"bucket_{args.bucket_sizes_mib[0]}_mib"]["runs"] if r["group"] == headline_group
    ]
    if not headline_runs:
        raise BenchError(f"no refit with {args.bucket_sizes_mib[0]} MiB buckets succeeded: {refits.failures}")
    zero["fixed_phases_of_full_refits"] = {
        "engine_fixed_s_median": median([r["engine"]["fixed_s"] for r in headline_runs]),
        "engine_phases_s_median": summary(headline_runs, None)["engine_phases_s"],
        "trainer_init_s_median": median([r["trainer"]["init_s"] for r in headline_runs]),
        "verdicts_s_median": median([r["trainer"]["send_phases_s"]["verdicts"] for r in headline_runs]),
    }
    run.save()

    say("broadcast baseline, after the refits")
    peer.release("after")
    baseline["after"] = broadcast_round(args.nccl_sizes_mib, args.nccl_warmup, args.nccl_iterations, device)
    peer.finished_rounds = True
    for row in baseline["after"]:
        say(f"  {row['size_mib']} MiB: {row['ms_per_broadcast']} ms, {row['gb_per_s']} GB/s")
    if args.nccl_debug and mode.name == "gpu":
        result["nccl_transports"] = {
            "baseline": peer.transports(),
            "refit": nccl_transports(main_target.engine.log_path),
        }
    conclude(result, args.bucket_sizes_mib[0], reference, refits.failures)
    run.save()
    print_summary(result)
    return 0 if result["verification"]["passed"] else 1


def start(
    args: argparse.Namespace,
    mode: Mode,
    run: Run,
    log_dir: Path,
    engine_env: dict[str, dict[str, str]],
    children: list[EngineProcess],
    peer_box: list[Peer],
    device: torch.device,
) -> tuple[Target, Target | None, Peer]:
    """Start the engines and the helper, build the trainer's tensors meanwhile, wait until ready."""
    result = run.result
    token_file = log_dir / "agent-token"
    token_file.write_text(AGENT_TOKEN + "\n")
    where = f"GPU {args.engine_gpu}" if mode.name == "gpu" else "CPU"
    say(f"starting engine 'main' ({args.source}, {mode.engine_backend}, {mode.dtype}) on {where}")
    common: dict[str, Any] = {
        "mode": mode,
        "gpu": args.engine_gpu,
        "token_file": token_file,
        "max_sequence_length": args.max_sequence_length,
        "nccl_debug": args.nccl_debug,
    }
    main_engine = EngineProcess(
        "main", args.source, log_path=log_dir / "engine-main.log", extra_env=engine_env["main"], **common
    )
    children.append(main_engine)
    tiny_engine: EngineProcess | None = None
    if not args.no_tiny:
        say(f"starting engine 'tiny' ({args.tiny_source}) alongside, for the fixed cost of a refit")
        tiny_engine = EngineProcess(
            "tiny", args.tiny_source, log_path=log_dir / "engine-tiny.log", extra_env=engine_env["tiny"], **common
        )
        children.append(tiny_engine)
    say(f"starting the broadcast baseline's helper process ({where})")
    peer = Peer(mode, args.engine_gpu, args, log_dir / "peer.log")
    peer_box.append(peer)
    result["config"]["engine_env"] = {engine.name: engine.env for engine in children}

    say(f"building the trainer's tensors of {args.source} on {device}")
    started = time.perf_counter()
    main_target = Target(main_engine, trainer_tensors(shape_of(args.source), mode.torch_dtype, device))
    fill(main_target.tensors, SEEDS[1])
    synchronize(device)
    result["trainer_tensors"] = {
        "count": len(main_target.tensors),
        "bytes": nbytes(main_target.tensors),
        "build_s": round(time.perf_counter() - started, 3),
    }
    say(f"  {len(main_target.tensors)} tensors, {nbytes(main_target.tensors) / 1e9:.2f} GB")
    tiny_target = None
    if tiny_engine is not None:
        tiny_target = Target(tiny_engine, trainer_tensors(shape_of(args.tiny_source), mode.torch_dtype, device))
    run.save()

    say("waiting for the engines to report ready (/readyz)")
    wait_ready(children, args.ready_timeout_s)
    result["engine_ready_s"] = {engine.name: round(engine.ready_seconds or 0.0, 1) for engine in children}
    for target in filter(None, (main_target, tiny_target)):
        target.tokens[0] = complete(target.engine)["token_ids"]  # version 0: the engine's own weights
    run.save()
    return main_target, tiny_target, peer


class Refits:
    """Series of checked refits; a failed refit is recorded and the next one goes on (a complete
    refit repairs the engine)."""

    def __init__(self, run: Run, mode: Mode, device: torch.device, args: argparse.Namespace) -> None:
        self.run = run
        self.options: dict[str, Any] = {
            "backend": mode.backend,
            "device": device,
            "poll_seconds": args.poll_ms / 1e3,
            "timeout_seconds": args.refit_timeout_s,
        }
        self.integrities: list[str] = args.integrity
        self.failures: list[str] = []

    def series(self, target: Target, bucket_mib: int, repeats: int, reference: float | None) -> dict[str, Any]:
        """``repeats`` refits over one sender: the first builds the group, the others keep it.
        ``median`` is over the reused-group refits (over the fresh ones when there are none, with
        ``group`` saying so); ``first_refit`` over the fresh ones."""
        runs: list[dict[str, Any]] = []
        entry: dict[str, Any] = {"runs": runs}
        for index in range(repeats):
            try:
                integrity = self.integrities[index % len(self.integrities)]  # ABAB across the series
                checked_refit(
                    target, runs, bucket_mib=bucket_mib, fresh=index == 0, integrity=integrity, **self.options
                )
            except (BenchError, refit_errors.RefitError) as error:
                self.failures.append(f"{target.engine.name}, {bucket_mib} MiB: {type(error).__name__}: {error}")
                self.run.result["errors"][f"refit_{len(self.failures)}"] = self.failures[-1]
                say(f"  REFIT FAILED: {self.failures[-1]}")
            self.run.save()
        target.close_sender()
        baseline = self.integrities[0]  # the median, and so the headline, are the first integrity's refits
        reused = [run for run in runs if run["group"] == "reused" and run["integrity"] == baseline]
        fresh = [run for run in runs if run["group"] == "fresh"]
        entry["median"] = {"group": "reused" if reused else "fresh", **summary(reused or fresh, reference)}
        entry["first_refit"] = {"group": "fresh", **summary(fresh, reference)} if fresh else {}
        if len(self.integrities) > 1:
            entry["by_integrity"] = {
                mode: summary([r for r in runs if r["group"] == "reused" and r["integrity"] == mode], reference)
                for mode in self.integrities
            }
            entry["integrity_cost"] = integrity_cost(entry["by_integrity"], baseline)
        return entry


def integrity_cost(by_integrity: dict[str, dict[str, Any]], baseline: str) -> dict[str, Any]:
    """(with - without) / without of each integrity's medians against ``baseline``'s: the transfer
    (the sender's phase; the engine's receive + apply, where the trailers are checked) and end to end."""
    base = by_integrity.get(baseline) or {}
    costs: dict[str, Any] = {}
    for mode, row in by_integrity.items():
        if mode == baseline or not row or not base:
            continue
        costs[mode] = {}
        for name, key in (("transfer_sender", "transfer_sender_s"), ("end_to_end", "end_to_end_s")):
            if row.get(key) and base.get(key):
                costs[mode][name] = round(row[key] / base[key] - 1, 4)
        phases, base_phases = row.get("engine_phases_s", {}), base.get("engine_phases_s", {})
        engine = (phases.get("receive") or 0) + (phases.get("apply") or 0)
        base_engine = (base_phases.get("receive") or 0) + (base_phases.get("apply") or 0)
        if engine and base_engine:
            costs[mode]["receive_apply_engine"] = round(engine / base_engine - 1, 4)
    return costs


def conclude(result: dict[str, Any], bucket_mib: int, reference: float, failures: list[str]) -> None:
    """The verification verdict over every refit and the headline figures."""
    refits = result["refits"]
    zero = result["zero_byte"]
    all_runs = [r for entry in refits.values() for r in entry["runs"]] + zero.get("tiny_refits", {}).get("runs", [])
    failed = {
        f"{r['engine_name']} version {r['version']} ({r['bucket_mib']} MiB)": [
            k for k, ok in r["checks"].items() if not ok
        ]
        for r in all_runs
    }
    failed = {key: value for key, value in failed.items() if value}
    result["verification"] = {
        "refits": len(all_runs),
        "failed_refits": len(failures),
        "passed": not failed and not failures,
        "failed_checks": failed,
    }
    headline = refits[f"bucket_{bucket_mib}_mib"]["median"]
    first = refits[f"bucket_{bucket_mib}_mib"]["first_refit"]
    tiny = zero.get("tiny_refits", {}).get("median")
    tiny = tiny if tiny and "end_to_end_s" in tiny else None
    result["headline"] = {
        "group": headline["group"],
        "bucket_mib": bucket_mib,
        "payload_gb": round(headline["payload_bytes"] / 1e9, 3),
        "nccl_broadcast_gb_per_s": reference,
        "end_to_end_ms": round(headline["end_to_end_s"] * 1e3, 1),
        "transfer_sender_ms": round(headline["transfer_sender_s"] * 1e3, 1),
        "receive_engine_ms": round(headline["receive_engine_s"] * 1e3, 1),
        "gb_per_s": headline["gb_per_s"],
        "ratio_to_nccl_broadcast": headline.get("ratio_to_nccl_broadcast"),
        "tiny_refit_end_to_end_ms": round(tiny["end_to_end_s"] * 1e3, 1) if tiny else None,
        "integrity": refits[f"bucket_{bucket_mib}_mib"].get("integrity_cost"),
        "first_refit": {
            "end_to_end_ms": round(first["end_to_end_s"] * 1e3, 1),
            "transfer_sender_ms": round(first["transfer_sender_s"] * 1e3, 1),
            "engine_phases_ms": {
                name: None if seconds is None else round(seconds * 1e3, 1)
                for name, seconds in first["engine_phases_s"].items()
            },
            "ratio_to_nccl_broadcast": first.get("ratio_to_nccl_broadcast"),
        }
        if first
        else None,
    }


def print_summary(result: dict[str, Any]) -> None:
    say("summary (medians)")
    for name, entry in result["refits"].items():
        median_row = entry["median"]
        if "end_to_end_s" not in median_row:
            say(f"  {name}: no refit succeeded")
            continue
        ratio = median_row.get("ratio_to_nccl_broadcast", {})
        first = entry.get("first_refit") or {}
        if first:
            say(
                f"  {name}, first refit (fresh group): end to end {first['end_to_end_s'] * 1e3:.1f} ms "
                f"({first.get('ratio_to_nccl_broadcast', {}).get('end_to_end')} of NCCL), engine phases "
                + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in first["engine_phases_s"].items() if v is not None)
                + " ms"
            )
        say(
            f"  {name}, {median_row['group']} group (median of {median_row['runs']}): "
            f"end to end {median_row['end_to_end_s'] * 1e3:.1f} ms "
            f"({median_row['gb_per_s']['end_to_end']} GB/s, {ratio.get('end_to_end')} of NCCL), "
            f"transfer {median_row['transfer_sender_s'] * 1e3:.1f} ms ({median_row['gb_per_s']['transfer_sender']} "
            f"GB/s, {ratio.get('transfer_sender')}), engine fixed {median_row['engine_fixed_s'] * 1e3:.0f} ms, "
            f"trainer init {median_row['trainer_init_s'] * 1e3:.0f} ms"
        )
    for name, entry in result["refits"].items():
        if entry.get("integrity_cost"):
            say(f"  {name}, cost of digests (reused group, medians): {entry['integrity_cost']}")
    tiny = result["zero_byte"].get("tiny_refits")
    if tiny and "end_to_end_s" in tiny["median"]:
        row = tiny["median"]
        say(f"  tiny engine: end to end {row['end_to_end_s'] * 1e3:.1f} ms ({row['payload_bytes']} bytes)")
    verification = result["verification"]
    say(f"  checks: {'all passed' if verification['passed'] else verification['failed_checks']}")


if __name__ == "__main__":
    exit_status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: process groups are never destroyed here (destroy_process_group() can
    # hang, docs/incidents.md#nccl-destroy-hang), and the result file is already written.
    os._exit(exit_status)
