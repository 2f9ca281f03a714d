"""Refits under load: tokens/s, the pause of every refit and the version spans of every answer, for
each way a refit treats the sequences in flight (drain, abort, keep; in place or staged).

Processes, laid out as in ``refit_nccl.py``:

* one engine process (``python -m megafleet_engine.cli``, configured by ``MEGAFLEET_*``, agent on
  loopback with a token file);
* a trainer process (this script with ``--peer trainer``) holding two full sets of the model's
  Hugging Face tensors, A for odd versions and B for even ones, on the GPU or in (pinned) CPU memory
  (``--trainer-device``); it sends each version with ``WeightSender`` over gloo, one sender kept
  open across the refits (its group is built once, by the first refit);
* this process, the driver, which plays the client and the operator.

Each mode of ``--modes`` runs on its own closed loop: (1) a preflight refit on the idle engine
(modes that refit): an agent that answers 409 ``refit_mode_unsupported`` gives the mode a row
``supported: false`` with the agent's message and the run goes on; (2) the load starts: ``--batch``
sequences kept in flight, random ``--prompt-tokens`` prompts, ``max_tokens`` ``--new-tokens``,
``ignore_eos``, temperature 1, token ids only; ``--span-probes`` of them are streamed (requests of
``--probe-request-size`` prompts, read chunk by chunk), the rest go in batched completions of
``--bulk-request-size`` prompts; starts are spread over ``--stagger-s`` (on the transformers
backend, whose batches are static, the whole batch is one streaming request); (3) ``--warmup``
seconds, then the window of ``--duration`` seconds with ``POST /v1/refit/prepare`` every
``--refit-every`` seconds (the next one at once when the previous took longer); (4) wind-down: no
new request, every sequence in flight finishes, the engine is idle again. ``none`` is the baseline
(no refit); when it comes first it is run last too.

Modes: ``none``, ``drain``, ``abort``, ``keep-persist``, ``keep-recompute``, ``keep-offload``
(megatron), each refitting mode also ``-staged`` (``staging: auto``, or ``--staged-as required``).
``--integrity checksum`` asks every refit to verify its buckets.

Reported per mode (the JSON's ``definitions`` say exactly how): tokens/s over the window (the
engine's ``megafleet_generated_tokens_total``) and its ratio to the baseline; per refit the stall,
the time the gate was closed, the recompute and switch time (p50/p99/max; from the agent's refit
status ``pause`` when it reports one, else the stall is the longest gap between chunks the probes
saw across the refit), the transfer time and every engine phase; the sequences that failed and the
tokens generated for nothing; the span check over every answer. The run's JSON is rewritten after
every mode, so a run cut short keeps what it measured.

CPU (the tiny model; a drain waits for the longest stream in flight)::

    PYTHONPATH=engine:protocol python3 bench/inflight_refit.py --backend transformers \\
        --source tiny://llama --dtype float32 --batch 8 --new-tokens 2000 --refit-every 2 \\
        --duration 20 --modes none,drain,abort --out bench/results/

One GPU (bench/README.md, ``inflight_refit.py``: the device procedure)::

    python3 bench/inflight_refit.py --backend megatron --source random://llama-8b --dtype bfloat16 \\
        --batch 256 --kv-cache-gib 50 --modes keep-persist-staged --baseline-from none.json --out $OUT/
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime
import faulthandler
import http.client
import inspect
import itertools
import json
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import benchkit
import refit_nccl

from megafleet_protocol import engine_settings, vocabulary
from megafleet_protocol import env as protocol_env

ROOT = Path(__file__).resolve().parents[1]
ADDRESS = refit_nccl.ADDRESS
MODEL = "bench"
TRAINER_LINE = "@trainer "
"""The prefix of the trainer process's protocol lines on its stdout (anything else there is logged)."""
SEEDS = (202, 101)  # weight set B (even versions) and A (odd versions)
UNSUPPORTED = "refit_mode_unsupported"
PROGRESS_SECONDS = 5.0
IDLE_TIMEOUT_SECONDS = 120.0

say = refit_nccl.say


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why."""


# -- modes ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of refitting under load (``none``: no refit, the baseline)."""

    name: str
    in_flight: vocabulary.InFlightMode | None
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staged: bool = False

    @property
    def refits(self) -> bool:
        return self.in_flight is not None

    @property
    def keeps(self) -> bool:
        return self.in_flight == "keep"

    def request_fields(self, staging: vocabulary.StagingMode, integrity: vocabulary.Integrity) -> dict[str, Any]:
        """The refit body's fields for this mode (the agent API's ``_RefitBody``, camelCase)."""
        fields: dict[str, Any] = {
            "suspendMode": self.in_flight,
            "staging": staging if self.staged else "off",
            "integrity": integrity,
        }
        if self.kv_cache_mode is not None:
            fields["kvCacheMode"] = self.kv_cache_mode
        return fields


def parse_mode(name: str) -> Mode:
    """``none``, ``drain``, ``abort`` or ``keep-<persist|recompute|offload>``, each but ``none`` with an
    optional ``-staged``."""
    parts = name.strip().split("-")
    staged = parts[-1] == "staged"
    if staged:
        parts = parts[:-1]
    head, rest = parts[0], parts[1:]
    if head == "none" and not rest and not staged:
        return Mode(name, None)
    if head == "drain" and not rest:
        return Mode(name, "drain", staged=staged)
    if head == "abort" and not rest:
        return Mode(name, "abort", staged=staged)
    kv_modes: tuple[vocabulary.KvCacheMode, ...] = get_args(vocabulary.KvCacheMode)
    kv = next((mode for mode in kv_modes if rest == [mode]), None)
    if head == "keep" and kv is not None:
        return Mode(name, "keep", kv, staged=staged)
    raise argparse.ArgumentTypeError(
        f"unknown mode {name!r}: none, drain, abort, keep-<{'|'.join(kv_modes)}>, each refitting one with -staged"
    )


def parse_modes(text: str) -> list[Mode]:
    modes = [parse_mode(part) for part in text.split(",") if part.strip()]
    if not modes:
        raise argparse.ArgumentTypeError("name at least one mode")
    return modes


# -- the trainer process ----------------------------------------------------------------------------


def trainer_main(spec: dict[str, Any]) -> int:
    """``--peer trainer``: build weight sets A and B, open one sender, then send the versions the driver
    asks for (one JSON line each on stdin), answering each with one protocol line on stdout."""
    import torch

    from megafleet_protocol.refit import sender as sdk

    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    started = time.perf_counter()
    sets = [weight_set(spec["source"], dtype, device, seed) for seed in SEEDS]
    built = time.perf_counter() - started
    integrity = sender_integrity(sdk.WeightSender, spec["integrity"])

    def open_sender() -> Any:
        port = refit_nccl.free_ports(1)[0]
        sender = sdk.WeightSender(
            port,
            2,
            backend="gloo",
            address=ADDRESS,
            device="cpu",
            timeout_seconds=float(spec["timeout_s"]),
            **integrity["init"],
        )
        sender.init()
        return sender

    sender = open_sender()
    current = [sender]
    signal.signal(signal.SIGUSR1, lambda *_: current[0].abort())  # the driver saw the engine's attempt fail
    tell(
        event="ready",
        port=sender.rendezvous.port,
        tensors=len(sets[0]),
        bytes=refit_nccl.nbytes(sets[0]),
        build_s=round(built, 2),
        device=str(device),
        pinned=bool(device.type == "cpu" and next(iter(sets[0].values())).is_pinned()),
        integrity_passed_to_sender=integrity["passed"],
    )
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "quit":
            break
        version = int(order["version"])
        try:
            report = sender.send(
                sets[version % 2].items(), bucket_size_mib=int(spec["bucket_mib"]), version=version, **integrity["send"]
            )
        except Exception as error:  # the driver records it; a failed sender is replaced by a new one
            sender.close()
            sender = current[0] = open_sender()
            tell(event="sent", ok=False, error=f"{type(error).__name__}: {error}", port=sender.rendezvous.port)
            continue
        tell(
            event="sent",
            ok=True,
            port=sender.rendezvous.port,
            seconds=round(report.seconds, 4),
            phases_s={name: round(value, 4) for name, value in report.phases.items()},
            reused=report.reused,
            buckets=report.buckets,
            bytes_sent=report.bytes_sent,
            verified=getattr(report, "verified", None),
        )
    return 0


def weight_set(source: str, dtype: Any, device: Any, seed: int) -> dict[str, Any]:
    """Every Hugging Face tensor of ``source``'s shape, values of set ``seed`` (matrices N(0, 0.02),
    norms N(1, 0.05)). CPU sets are pinned where CUDA exists (the copy to the GPU's side of gloo is
    then a DMA) and drawn on the GPU, one tensor at a time, which is far faster than on the CPU."""
    import torch

    from megafleet_engine.backends import weight_maps

    draw_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    generator = torch.Generator(device=draw_on).manual_seed(seed)
    pin = device.type == "cpu" and torch.cuda.is_available()
    tensors: dict[str, torch.Tensor] = {}
    for name, size in weight_maps.hf_shapes(refit_nccl.shape_of(source)).items():
        drawn = torch.empty(size, dtype=dtype, device=draw_on)
        if len(size) == 1:
            drawn.normal_(1.0, 0.05, generator=generator)
        else:
            drawn.normal_(0.0, 0.02, generator=generator)
        if drawn.device == device:
            tensors[name] = drawn
        else:
            tensors[name] = torch.empty(size, dtype=dtype, device=device, pin_memory=pin)
            tensors[name].copy_(drawn)
    if draw_on.type == "cuda":
        torch.cuda.synchronize()
    return tensors


def sender_integrity(sender_class: type, integrity: str) -> dict[str, Any]:
    """How this checkout's ``WeightSender`` takes ``--integrity``: a keyword ``integrity`` of its
    constructor or of ``send``, passed either way; a sender built before bucket digests takes
    neither (``passed`` false, which matters only for ``checksum``)."""
    found: dict[str, Any] = {"init": {}, "send": {}, "passed": integrity == "none"}
    for where, function in (("init", sender_class), ("send", getattr(sender_class, "send", None))):
        if function is not None and "integrity" in inspect.signature(function).parameters:
            found[where] = {"integrity": integrity}
            found["passed"] = True
            break
    return found


def tell(**fields: Any) -> None:
    print(TRAINER_LINE + json.dumps(fields), flush=True)


class Trainer:
    """The driver's end of the trainer process: orders on its stdin, answers read by a thread."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], log_path: Path) -> None:
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--peer", "trainer", "--peer-spec", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="trainer-answers").start()
        self.ready: dict[str, Any] = {}
        self.port = 0

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        self.ready = self.answer(timeout)
        self.port = int(self.ready["port"])
        return self.ready

    def order(self, version: int) -> None:
        """Start sending ``version`` (its answer comes once the engine acknowledged it, or it failed)."""
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": "send", "version": version}) + "\n")
        stdin.flush()

    def abort_send(self) -> None:
        """Give the send in progress up (the engine's attempt failed: no receiver will acknowledge)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    def answer(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise BenchError(f"the trainer did not answer within {timeout:.0f} s") from None
        if answer is None:
            raise BenchError(f"the trainer process ended ({self.process.wait()}); its log: {self._log.name}")
        if "port" in answer:
            self.port = int(answer["port"])
        return answer

    def _read(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith(TRAINER_LINE):
                self._answers.put(json.loads(line[len(TRAINER_LINE) :]))
            else:
                self._log.write(line)
                self._log.flush()
        self._answers.put(None)

    def stop(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
        self.process.wait()


# -- the load ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    """One sequence as the client saw it."""

    kind: Literal["probe", "bulk"]
    sent: float
    ended: float
    tokens: int
    finish_reason: str | None
    error: str | None
    spans: list[tuple[int, int | None]] | None
    response_version: int | None
    chunks: list[tuple[float, int, int | None]] = dataclasses.field(default_factory=list)
    """Probes: every chunk with tokens as ``(arrival, token count, its weight_version)``."""
    request_first: int | None = None
    """Batched requests: the earliest first-span version of the request's choices, which the
    top-level ``weight_version`` (the request's first step's) must equal; probes: their own."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason == "length"


class Load:
    """The closed loop: ``units`` threads, each sending its next request as soon as its last answered."""

    def __init__(
        self, url: str, args: argparse.Namespace, vocab: int, seed: int, *, new_tokens: int = 0, rounds: int = 0
    ) -> None:
        """``new_tokens``: instead of ``--new-tokens``; ``rounds``: requests per unit (0: until :meth:`stop`)."""
        parsed = url.removeprefix("http://").rsplit(":", 1)
        self._host, self._port = parsed[0], int(parsed[1])
        self._args = args
        self._vocab = vocab
        self._seed = seed
        self._new_tokens = new_tokens or args.new_tokens
        self._rounds = rounds
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.answers: list[Answer] = []
        probes = min(args.span_probes, args.batch)
        self.probe_sizes = split(probes, args.probe_request_size)
        self.bulk_sizes = split(args.batch - probes, args.bulk_request_size)

    def start(self, stagger_s: float) -> None:
        units: list[tuple[Literal["probe", "bulk"], int]] = [("probe", size) for size in self.probe_sizes]
        units += [("bulk", size) for size in self.bulk_sizes]
        order = list(range(len(units)))
        random.Random(self._seed).shuffle(order)  # probes spread among the bulk requests' start times
        for position, index in enumerate(order):
            kind, size = units[index]
            delay = stagger_s * position / len(units)
            thread = threading.Thread(
                target=self._unit,
                args=(kind, size, delay, self._seed * 1000 + index),
                daemon=True,
                name=f"load-{index}",
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """No new request from now on; those in flight run to their end."""
        self._stopping.set()

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    def _unit(self, kind: Literal["probe", "bulk"], size: int, delay: float, seed: int) -> None:
        rng = random.Random(seed)
        if self._stopping.wait(delay):  # staggered start
            return
        connection = http.client.HTTPConnection(self._host, self._port, timeout=3600)
        sent = 0
        while not self._stopping.is_set() and not (self._rounds and sent == self._rounds):
            sent += 1
            prompts = [[rng.randrange(self._vocab) for _ in range(self._args.prompt_tokens)] for _ in range(size)]
            try:
                if kind == "probe":
                    self.answers.extend(self._stream(connection, prompts))
                else:
                    self.answers.extend(self._batched(connection, prompts))
            except (OSError, http.client.HTTPException, ValueError) as error:
                connection.close()
                connection = http.client.HTTPConnection(self._host, self._port, timeout=3600)
                now = time.perf_counter()
                failed = Answer(kind, now, now, 0, None, f"{type(error).__name__}: {error}", None, None)
                self.answers.extend([failed] * size)
        connection.close()

    def _body(self, prompt: Any, *, stream: bool) -> bytes:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self._new_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "detokenize": False,
            "stream": stream,
        }
        return json.dumps(body).encode()

    def _batched(self, connection: http.client.HTTPConnection, prompts: list[list[int]]) -> list[Answer]:
        sent = time.perf_counter()
        connection.request("POST", "/v1/completions", self._body(prompts, stream=False), JSON_HEADERS)
        response = connection.getresponse()
        payload = response.read()
        ended = time.perf_counter()
        if response.status != 200:
            error = f"HTTP {response.status}: {payload[:300].decode(errors='replace')}"
            return [Answer("bulk", sent, ended, 0, None, error, None, None) for _ in prompts]
        body = json.loads(payload)
        answers = []
        for choice in sorted(body["choices"], key=lambda choice: choice["index"]):
            answers.append(
                Answer(
                    "bulk",
                    sent,
                    ended,
                    len(choice.get("token_ids") or []),
                    choice.get("finish_reason"),
                    None,
                    spans_of(choice.get("weight_version_spans")),
                    body.get("weight_version"),
                )
            )
        firsts = [answer.spans[0][1] for answer in answers if answer.spans and answer.spans[0][1] is not None]
        for answer in answers:
            answer.request_first = min(firsts, default=None)
        return answers

    def _stream(self, connection: http.client.HTTPConnection, prompts: list[list[int]]) -> list[Answer]:
        """One streaming request of ``prompts`` (a choice each), read chunk by chunk."""
        sent = time.perf_counter()
        body = self._body(prompts if len(prompts) > 1 else prompts[0], stream=True)
        connection.request("POST", "/v1/completions", body, JSON_HEADERS)
        response = connection.getresponse()
        if response.status != 200:
            refused = f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
            return [Answer("probe", sent, time.perf_counter(), 0, None, refused, None, None) for _ in prompts]
        answers = [Answer("probe", sent, sent, 0, None, None, None, None) for _ in prompts]
        version: list[int | None] = []  # the request's weight_version, from its first event
        error: str | None = None
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            version = version or [event.get("weight_version")]
            if "error" in event:
                error = f"stream error: {event['error'].get('code')}: {event['error'].get('message')}"
            for choice in event.get("choices") or []:
                answer = answers[choice["index"]]
                count = len(choice.get("token_ids") or [])
                if count:
                    answer.chunks.append((now, count, choice.get("weight_version")))
                    answer.tokens += count
                if choice.get("finish_reason") is not None:
                    answer.finish_reason = choice["finish_reason"]
                    answer.spans = spans_of(choice.get("weight_version_spans"))
        ended = time.perf_counter()
        firsts = [answer.spans[0][1] for answer in answers if answer.spans and answer.spans[0][1] is not None]
        for answer in answers:
            answer.ended, answer.response_version = ended, (version or [None])[0]
            answer.request_first = min(firsts, default=None)
            if answer.finish_reason is None:  # an error event ends every choice still running
                answer.error = error or "the stream ended before this choice finished"
        return answers


def split(count: int, size: int) -> list[int]:
    """``count`` sequences in requests of at most ``size`` prompts."""
    return [min(size, count - start) for start in range(0, count, size)]


JSON_HEADERS = {"Content-Type": "application/json"}


def spans_of(spans: Any) -> list[tuple[int, int | None]] | None:
    if spans is None:
        return None
    return [(int(span["start"]), span.get("version")) for span in spans]


# -- refits -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Versions:
    """The versions sent so far: when each prepare went out, and which ones the engine now serves."""

    initial: int
    current: int
    prepared_at: dict[int, float] = dataclasses.field(default_factory=dict)
    succeeded: set[int] = dataclasses.field(default_factory=set)

    def next(self) -> int:
        return max([self.current, *self.prepared_at]) + 1


class Refitter:
    """Refits of one mode: the preflight, then one every ``--refit-every`` seconds of the window,
    on a thread of its own (the driver reads the engine's counter on time whatever a refit does)."""

    def __init__(self, engine: Any, trainer: Trainer, versions: Versions, args: argparse.Namespace, mode: Mode) -> None:
        self._engine = engine
        self._trainer = trainer
        self._versions = versions
        self._args = args
        self._mode = mode
        self._agent = refit_nccl.Http(engine.agent_url, refit_nccl.AGENT_TOKEN)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.records: list[dict[str, Any]] = []
        self.late = 0

    def refit(self, origin: float) -> dict[str, Any]:
        """One refit to the next version, timed from the driver: prepare, the trainer's send, the
        status polled until the attempt ended."""
        mode, args, versions = self._mode, self._args, self._versions
        version = versions.next()
        body = {
            "version": version,
            "transport": "broadcast",
            "bucketSizeMiB": args.bucket_mib,
            "timeoutSeconds": args.refit_timeout_s,
            "collective": "gloo",  # the trainer's group (NCCL cannot connect two ranks on one GPU)
            "rendezvous": {
                "address": ADDRESS,
                "port": self._trainer.port,
                "worldSize": 2,
                "rankOffset": 1,
                "trainerWorldSize": 1,
            },
            **mode.request_fields(args.staged_as, args.integrity),
        }
        record: dict[str, Any] = {"version": version, "mode": mode.name}
        started = time.perf_counter()
        record["sent_at_s"] = round(started - origin, 3)
        code, answer = self._agent.call("POST", "/v1/refit/prepare", body)
        record["prepare_http"] = code
        if code == 409 and error_code(answer) == UNSUPPORTED:
            record.update(outcome="unsupported", error=error_message(answer))
            return record
        if code != 202:
            record.update(outcome="refused", error=f"prepare answered {code}: {answer}")
            return record
        versions.prepared_at[version] = started
        self._trainer.order(version)
        status = self._wait(version)
        ended = time.perf_counter()
        if status["phase"] == "failed":
            self._trainer.abort_send()
        sent = self._trainer.answer(timeout=self._args.refit_timeout_s + 60)
        record["trainer"] = {key: value for key, value in sent.items() if key not in ("event", "port")}
        record["end_to_end_ms"] = round((ended - started) * 1e3, 1)
        record["ended_at_s"] = round(ended - origin, 3)
        record["_prepared"], record["_ended"] = started, ended  # this clock (not saved)
        record.update(status_fields(status))
        if record["outcome"] == "succeeded":
            versions.current = version
            versions.succeeded.add(version)
        return record

    def _wait(self, version: int) -> dict[str, Any]:
        deadline = time.monotonic() + self._args.refit_timeout_s + 30
        while True:
            code, status = self._agent.call("GET", "/v1/refit/status")
            if code == 200 and status.get("version") == version and status["phase"] in ("succeeded", "failed"):
                result: dict[str, Any] = status
                return result
            if time.monotonic() > deadline:
                raise BenchError(f"refit to version {version} did not end within its timeout: {status}")
            time.sleep(self._args.poll_ms / 1e3)  # polling the agent's status, as the operator does

    def start(self, origin: float, until: float) -> None:
        """Refits from ``origin + refit_every`` until ``until`` (none starts after it)."""
        self._thread = threading.Thread(target=self._schedule, args=(origin, until), daemon=True, name="refits")
        self._thread.start()

    def join(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _schedule(self, origin: float, until: float) -> None:
        every = self._args.refit_every
        due = origin + every
        while due < until:
            if self._stopping.wait(max(0.0, due - time.perf_counter())):
                return
            now = time.perf_counter()
            record = self.refit(origin)
            record["late_s"] = round(max(0.0, now - due), 3)
            self.records.append(record)
            say(refit_line(record))
            if record["outcome"] in ("unsupported", "refused"):
                return
            due += every
            if due < time.perf_counter():
                self.late += 1
                due = time.perf_counter()  # the refit took longer than the interval: the next goes at once


def error_code(answer: Any) -> str | None:
    detail = answer.get("error") if isinstance(answer, dict) else None
    code = detail.get("code") if isinstance(detail, dict) else None
    return code if isinstance(code, str) else None


def error_message(answer: Any) -> str:
    detail = answer.get("error") if isinstance(answer, dict) else None
    return str(detail.get("message") if isinstance(detail, dict) else answer)


def status_fields(status: dict[str, Any]) -> dict[str, Any]:
    """What a refit record keeps of the agent's final ``/v1/refit/status``."""
    phases = {phase["name"]: phase["milliseconds"] for phase in status.get("phases") or []}
    return {
        "outcome": status["phase"],
        "error": status.get("error"),
        "duration_ms": status.get("durationMilliseconds"),
        "phases_ms": phases,
        "reused": status.get("reused"),
        "bytes_received": status.get("bytesReceived"),
        "pause": status.get("pause"),
        "in_flight": status.get("inFlight"),
        "staging": status.get("staging"),
        "verification": status.get("verification"),
        "state_after": status.get("state"),
        "weight_version_after": status.get("weightVersion"),
    }


def refit_line(record: dict[str, Any]) -> str:
    if record["outcome"] in ("unsupported", "refused"):
        return f"  refit v{record['version']}: {record['outcome']}: {record['error']}"
    phases = ", ".join(f"{name} {ms}" for name, ms in record.get("phases_ms", {}).items())
    pause = record.get("pause") or {}
    stall = f", stall {pause.get('stallMilliseconds')} ms (agent)" if pause else ""
    transfer = (record.get("trainer") or {}).get("phases_s", {}).get("transfer")
    return (
        f"  refit v{record['version']} at {record['sent_at_s']:.1f} s: {record['outcome']} in "
        f"{record.get('end_to_end_ms')} ms (engine phases {phases} ms{stall}; trainer transfer "
        f"{None if transfer is None else round(transfer * 1e3, 1)} ms)"
        + (f"; ERROR {record['error']}" if record.get("error") else "")
    )


# -- the checks -------------------------------------------------------------------------------------


def span_problems(answer: Answer, mode: Mode, versions: Versions) -> list[str]:
    """What is wrong with one answer's version spans (empty: nothing). Spans start at 0, strictly
    increasing, versions strictly increasing and each one the engine served; the top-level
    ``weight_version`` is the first span's; without keep a sequence never spans a refit; a probe's
    spans equal those its chunks' ``weight_version`` draw, and no token of version v arrived before
    the prepare of v was sent."""
    if not answer.ok:
        return []
    spans = answer.spans
    if not spans:
        return ["no weight_version_spans"]
    problems = []
    starts = [start for start, _ in spans]
    versions_seen = [version for _, version in spans]
    if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= answer.tokens:
        problems.append(f"span starts {starts} not 0 < ... < {answer.tokens} tokens")
    numbered = [version for version in versions_seen if version is not None]
    if len(numbered) < len(versions_seen) or any(b <= a for a, b in itertools.pairwise(numbered)):
        problems.append(f"span versions {versions_seen} not strictly increasing")
    known = versions.succeeded | {versions.initial}
    if not set(versions_seen) <= known:
        problems.append(f"span versions {versions_seen} outside the versions served {sorted(known)}")
    first = versions_seen[0] if answer.request_first is None else answer.request_first
    if answer.response_version != first:
        problems.append(f"weight_version {answer.response_version} is not the first span's {first}")
    if not mode.keeps and len(spans) > 1:
        problems.append(f"{len(spans)} spans under {mode.name}: a sequence spanned a refit")
    if answer.kind == "probe":
        problems += chunk_problems(answer, spans, versions)
    return problems


def chunk_problems(answer: Answer, spans: list[tuple[int, int | None]], versions: Versions) -> list[str]:
    drawn: list[tuple[int, int | None]] = []
    position = 0
    for arrival, count, version in answer.chunks:
        if not drawn or drawn[-1][1] != version:
            drawn.append((position, version))
            prepared = versions.prepared_at.get(version) if version is not None else None
            if position and prepared is not None and arrival < prepared:
                return [f"a token of version {version} arrived before its refit was prepared"]
        position += count
    if drawn != spans:
        return [f"spans {spans} differ from the chunks' versions {drawn}"]
    return []


def probe_gap_ms(arrivals: list[float], start: float, end: float) -> float | None:
    """The longest gap between two chunks (of any probe) that overlaps ``[start, end]``."""
    if len(arrivals) < 2:
        return None
    first = max(1, bisect.bisect_left(arrivals, start))
    last = min(len(arrivals) - 1, bisect.bisect_right(arrivals, end))
    gaps = [arrivals[i] - arrivals[i - 1] for i in range(first, last + 1)]
    return round(max(gaps) * 1e3, 1) if gaps else None


def switch_skew_ms(probes: list[Answer], version: int) -> float | None:
    """Across the probes that went from an older version to ``version``: the last older chunk's
    arrival minus the first ``version`` chunk's (at or below 0: every probe switched between the
    same two steps, as far as delivery shows)."""
    last_old: list[float] = []
    first_new: list[float] = []
    for probe in probes:
        before = [arrival for arrival, _, v in probe.chunks if v is not None and v < version]
        after = [arrival for arrival, _, v in probe.chunks if v == version]
        if before and after:
            last_old.append(max(before))
            first_new.append(min(after))
    if not first_new:
        return None
    return round((max(last_old) - min(first_new)) * 1e3, 1)


# -- one mode ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What every mode of a run shares."""

    args: argparse.Namespace
    engine: Any  # refit_nccl.EngineProcess
    trainer: Trainer | None
    versions: Versions
    vocab: int
    metrics: refit_nccl.Http
    state: refit_nccl.Http


def generated_tokens(metrics: refit_nccl.Http) -> float:
    code, text = metrics.call("GET", "/metrics")
    match = re.search(r"^megafleet_generated_tokens_total (\S+)$", str(text), re.MULTILINE)
    if code != 200 or match is None:
        raise BenchError(f"/metrics answered {code} without megafleet_generated_tokens_total")
    return float(match.group(1))


def wait_idle(context: Context) -> dict[str, Any]:
    """Until the engine is ready with nothing queued (between modes)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_SECONDS
    while True:
        code, state = context.state.call("GET", "/v1/state")
        if code == 200 and state["state"] == "ready" and state["queueDepth"] == 0:
            result: dict[str, Any] = state
            return result
        if time.monotonic() > deadline:
            raise BenchError(f"the engine is not idle after {IDLE_TIMEOUT_SECONDS:.0f} s: {code} {state}")
        time.sleep(0.2)  # polling the engine's state between modes


def run_mode(context: Context, mode: Mode, index: int) -> dict[str, Any]:
    args = context.args
    say(f"mode {index + 1}: {mode.name}")
    state = wait_idle(context)
    row: dict[str, Any] = {"mode": mode.name, **mode_settings(mode, args), "capabilities": state.get("capabilities")}
    refitter = None
    if mode.refits:
        assert context.trainer is not None
        refitter = Refitter(context.engine, context.trainer, context.versions, args, mode)
        preflight = refitter.refit(time.perf_counter())
        say(refit_line(preflight))
        row["preflight_refit"] = preflight
        if preflight["outcome"] == "unsupported":
            say(f"  {mode.name}: unsupported by this engine (the agent answered 409 {UNSUPPORTED})")
            return {**row, "supported": False, "unsupported_reason": preflight["error"]}
        if preflight["outcome"] != "succeeded":
            return {**row, "supported": True, "error": f"preflight refit {preflight['outcome']}: {preflight['error']}"}
        refitter = Refitter(context.engine, context.trainer, context.versions, args, mode)
    load = Load(context.engine.frontend_url, args, context.vocab, args.seed + index)
    tokens_before_load = generated_tokens(context.metrics)
    load.start(args.stagger_s)
    say(f"  load: {len(load.probe_sizes)} streams, {len(load.bulk_sizes)} batched requests; warm-up {args.warmup} s")
    time.sleep(args.warmup)  # the load generator's warm-up (not a wait for a condition)
    window = measure_window(context, load, refitter)
    say("  window over; wind-down: no new requests, waiting for those in flight")
    load.stop()
    if refitter is not None:
        refitter.join()
    if not load.join(args.wind_down_timeout_s):
        raise BenchError(f"sequences still in flight {args.wind_down_timeout_s} s after the window")
    wait_idle(context)
    tokens_after_load = generated_tokens(context.metrics)
    row.update(supported=True, **window)
    in_window = [a for a in load.answers if a.ok and window["window"]["_start"] <= a.ended <= window["window"]["_end"]]
    completed = sum(answer.tokens for answer in in_window)
    row["window"]["completed_tok_per_s"] = round(completed / window["window"]["seconds"], 1)
    row["load_average"] = os.getloadavg()
    row.update(summarize(mode, load.answers, refitter.records if refitter else [], context.versions))
    delivered = sum(answer.tokens for answer in load.answers if answer.ok)
    row["sequences"]["generated_tokens_whole_load"] = int(tokens_after_load - tokens_before_load)
    row["sequences"]["delivered_tokens_whole_load"] = delivered
    row["sequences"]["thrown_away_tokens"] = int(tokens_after_load - tokens_before_load) - delivered
    say(mode_line(row))
    return row


def mode_settings(mode: Mode, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "in_flight": mode.in_flight,
        "kv_cache_mode": mode.kv_cache_mode,
        "staging": (args.staged_as if mode.staged else "off") if mode.refits else None,
        "integrity": args.integrity if mode.refits else None,
    }


def measure_window(context: Context, load: Load, refitter: Refitter | None) -> dict[str, Any]:
    """The window: the engine's counter read at its start and end (on time), refits meanwhile."""
    args = context.args
    origin = time.perf_counter()
    until = origin + args.duration
    counter = generated_tokens(context.metrics)
    first = counter
    if refitter is not None:
        refitter.start(origin, until)
    progress: list[dict[str, float | None]] = []
    last, last_at = counter, origin
    while (now := time.perf_counter()) < until:
        time.sleep(min(PROGRESS_SECONDS, until - now))  # the window's clock
        counter, at = generated_tokens(context.metrics), time.perf_counter()
        rate = (counter - last) / (at - last_at)
        memory = gpu_memory_used_mib() if args.backend == "megatron" else None
        progress.append({"at_s": round(at - origin, 2), "tok_per_s": round(rate, 1), "gpu_memory_used_mib": memory})
        answered = sum(1 for answer in load.answers if answer.ended >= origin)
        say(f"  {at - origin:5.1f} s: {rate:8.1f} tok/s, {answered} sequences answered in the window")
        last, last_at = counter, at
    memories = [tick["gpu_memory_used_mib"] for tick in progress if tick["gpu_memory_used_mib"] is not None]
    seconds = last_at - origin
    return {
        "window": {
            "_start": origin,
            "_end": last_at,
            "seconds": round(seconds, 3),
            "tokens": int(last - first),
            "tok_per_s": round((last - first) / seconds, 1),
            "gpu_memory_used_mib_max": max(memories, default=None),
            "progress": progress,
        }
    }


def gpu_memory_used_mib() -> float | None:
    """The GPU's memory in use now (engine and trainer together), from ``nvidia-smi``."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return float(done.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 1)

    return {"count": len(ordered), "p50": round(statistics.median(ordered), 1), "p99": at(0.99), "max": ordered[-1]}


def summarize(mode: Mode, answers: list[Answer], records: list[dict[str, Any]], versions: Versions) -> dict[str, Any]:
    """The refits' figures, the sequences' and the span check of one mode."""
    probes = [answer for answer in answers if answer.kind == "probe"]
    arrivals = sorted(arrival for probe in probes for arrival, _, _ in probe.chunks)
    for record in records:
        pause_figures(record, arrivals, probes, mode)
    done = [r for r in records if r["outcome"] == "succeeded"]

    def series(key: str) -> dict[str, Any]:
        values = [r[key] for r in done if r.get(key) is not None]
        return {**percentiles(values), "source": sorted({r[f"{key}_source"] for r in done if r.get(key) is not None})}

    transfers = [r["trainer"]["phases_s"]["transfer"] for r in done if r.get("trainer", {}).get("phases_s")]
    problems = {id(answer): span_problems(answer, mode, versions) for answer in answers}
    failing = [answer for answer in answers if problems[id(answer)]]
    failed = [answer for answer in answers if not answer.ok]
    return {
        "refits": {
            "count": len(records),
            "succeeded": len(done),
            "failed": [f"v{r['version']}: {r['outcome']}: {r.get('error')}" for r in records if r not in done],
            "late": sum(1 for r in records if r.get("late_s", 0) > 0),
            "stall_ms": series("stall_ms"),
            "gate_closed_ms": series("gate_closed_ms"),
            "recompute_ms": series("recompute_ms"),
            "switch_ms": series("switch_ms"),
            "suspend_phase_ms": percentiles([r["phases_ms"]["suspend"] for r in done if "suspend" in r["phases_ms"]]),
            "end_to_end_ms": percentiles([r["end_to_end_ms"] for r in done]),
            "transfer_s": percentiles([round(t, 4) for t in transfers]) | {"unit": "s"},
            "engine_transfer_ms": percentiles([r["engine_transfer_ms"] for r in done if r.get("engine_transfer_ms")]),
            "kept": sum((r.get("in_flight") or {}).get("kept", 0) for r in done),
            "recomputed_tokens": sum((r.get("in_flight") or {}).get("recomputedTokens", 0) for r in done),
            "aborted_tokens_reported": sum((r.get("in_flight") or {}).get("abortedTokens", 0) for r in done),
            "staging_effective": count_of([(r.get("staging") or {}).get("effective") for r in done]),
            "runs": records,
        },
        "sequences": {
            "answered": len(answers),
            "completed": len(answers) - len(failed),
            "failed": len(failed),
            "failures": count_of([(answer.error or f"finish_reason {answer.finish_reason}")[:90] for answer in failed]),
            "spanning_a_refit": sum(1 for answer in answers if answer.ok and answer.spans and len(answer.spans) > 1),
        },
        "spans": {
            "checked": sum(1 for answer in answers if answer.ok),
            "probes_checked": sum(1 for answer in probes if answer.ok),
            "mismatches": len(failing),
            "passed": not failing,
            "examples": [problems[id(answer)][0] for answer in failing[:5]],
            "switch_skew_ms": {str(r["version"]): r.get("switch_skew_ms") for r in done if mode.keeps},
        },
    }


def pause_figures(record: dict[str, Any], arrivals: list[float], probes: list[Answer], mode: Mode) -> None:
    """One refit's stall, gate-closed, recompute and switch times: the agent's ``pause`` when it
    reports one; else the stall is the probes' longest gap across the refit and the gate was closed
    for the whole attempt (drain and abort close it at the prepare and open it at the resume)."""
    if record["outcome"] != "succeeded":
        return
    record["probe_gap_ms"] = probe_gap_ms(arrivals, record["_prepared"], record["_ended"])
    phases = record.get("phases_ms") or {}
    record["engine_transfer_ms"] = phases.get("receive", 0) + phases.get("apply", 0) or None
    pause = record.get("pause")
    if pause:
        record.update(
            stall_ms=pause.get("stallMilliseconds"),
            stall_ms_source="agent pause",
            gate_closed_ms=pause.get("gateClosedMilliseconds"),
            gate_closed_ms_source="agent pause",
            recompute_ms=pause.get("recomputeMilliseconds"),
            recompute_ms_source="agent pause",
            switch_ms=pause.get("switchMilliseconds"),
            switch_ms_source="agent pause",
        )
    else:
        record.update(stall_ms=record["probe_gap_ms"], stall_ms_source="probes' longest gap")
        if not mode.keeps:
            record.update(gate_closed_ms=record.get("duration_ms"), gate_closed_ms_source="attempt duration")
    if mode.keeps:
        record["switch_skew_ms"] = switch_skew_ms(probes, record["version"])


def count_of(values: Sequence[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def mode_line(row: dict[str, Any]) -> str:
    refits = row["refits"]
    return (
        f"  {row['mode']}: {row['window']['tok_per_s']} tok/s; refits {refits['succeeded']}/{refits['count']}, "
        f"stall p50/p99/max {fmt(refits['stall_ms'])} ms, gate closed {fmt(refits['gate_closed_ms'])} ms, "
        f"suspend phase {fmt(refits['suspend_phase_ms'])} ms; sequences failed {row['sequences']['failed']}, "
        f"tokens thrown away {row['sequences']['thrown_away_tokens']}; spans "
        + ("ok" if row["spans"]["passed"] else f"{row['spans']['mismatches']} MISMATCHES {row['spans']['examples']}")
    )


def fmt(figure: dict[str, Any]) -> str:
    return f"{figure['p50']}/{figure['p99']}/{figure['max']}"


def verdict(row: dict[str, Any]) -> dict[str, Any]:
    """A supported mode passes when every refit succeeded, the spans check out and no sequence failed
    (abort fails the sequences it ends: there, failures are the figure, not a fault)."""
    why = []
    if row.get("error"):
        why.append(row["error"])
    if "refits" in row:
        if row["refits"]["failed"]:
            why.append(f"refits failed: {row['refits']['failed'][:3]}")
        if not row["spans"]["passed"]:
            why.append(f"span mismatches: {row['spans']['examples']}")
        if row["in_flight"] != "abort" and row["sequences"]["failed"]:
            why.append(f"{row['sequences']['failed']} sequences failed: {row['sequences']['failures']}")
    return {"passed": not why, "why": why}


# -- the run ----------------------------------------------------------------------------------------


def baseline_figures(rows: list[dict[str, Any]], files: Sequence[Path]) -> dict[str, Any]:
    """The no-refit tokens/s: this run's ``none`` windows, else those of ``--baseline-from`` files."""
    own = [row["window"]["tok_per_s"] for row in rows if row["mode"] == "none" and "window" in row]
    source = "the none rows of this result"
    values = own
    if not own and files:
        values = []
        for path in files:
            for row in json.loads(path.read_text()).get("modes", []):
                if row.get("mode") == "none" and "window" in row:
                    values.append(row["window"]["tok_per_s"])
        source = ", ".join(str(path) for path in files)
    if not values:
        return {"tok_per_s": None, "runs": [], "source": None}
    mean = statistics.fmean(values)
    drift = (values[-1] - values[0]) / values[0] if len(values) > 1 and values[0] else None
    return {
        "tok_per_s": round(mean, 1),
        "runs": values,
        "drift_last_vs_first": None if drift is None else round(drift, 4),
        "source": source,
    }


def conclude(result: dict[str, Any], files: Sequence[Path]) -> None:
    rows = result["modes"]
    baseline = baseline_figures(rows, files)
    result["baseline"] = baseline
    headline = []
    for row in rows:
        row["verdict"] = verdict(row)
        if not row.get("supported", True) or "window" not in row:
            note = row.get("unsupported_reason") or row.get("error")
            headline.append({"mode": row["mode"], "supported": row.get("supported", True), "note": note})
            continue
        ratio = row["window"]["tok_per_s"] / baseline["tok_per_s"] if baseline["tok_per_s"] else None
        row["ratio_to_baseline"] = None if ratio is None else round(ratio, 4)
        refits = row["refits"]
        headline.append(
            {
                "mode": row["mode"],
                "supported": True,
                "tok_per_s": row["window"]["tok_per_s"],
                "ratio_to_baseline": row["ratio_to_baseline"],
                "completed_tok_per_s": row["window"].get("completed_tok_per_s"),
                "refits": refits["succeeded"],
                "stall_ms_p50_p99_max": [refits["stall_ms"][key] for key in ("p50", "p99", "max")],
                "gate_closed_ms_p50_p99_max": [refits["gate_closed_ms"][key] for key in ("p50", "p99", "max")],
                "recompute_ms_max": refits["recompute_ms"]["max"],
                "suspend_phase_ms_max": refits["suspend_phase_ms"]["max"],
                "engine_transfer_ms_p50": refits["engine_transfer_ms"]["p50"],
                "failed_sequences": row["sequences"]["failed"],
                "thrown_away_tokens": row["sequences"]["thrown_away_tokens"],
                "span_mismatches": row["spans"]["mismatches"],
                "passed": row["verdict"]["passed"],
            }
        )
    result["headline"] = headline
    result["passed"] = all(row["verdict"]["passed"] for row in rows)


def public(value: Any) -> Any:
    """``value`` without the driver's own keys (those starting with ``_``), for the JSON."""
    if isinstance(value, dict):
        return {key: public(item) for key, item in value.items() if not str(key).startswith("_")}
    if isinstance(value, list):
        return [public(item) for item in value]
    return value


class Output:
    """The result file, rewritten after every mode (a run cut short keeps what it measured)."""

    def __init__(self, path: Path, result: dict[str, Any]) -> None:
        self.path = path
        self.result = result
        self._lock = threading.Lock()

    def save(self) -> None:
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(public(self.result), indent=2) + "\n")


def engine_env(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """The ``MEGAFLEET_*`` variables for the engine options this run sets, split into those this
    checkout's engine reads (a :class:`~megafleet_protocol.engine_settings.Settings` field of that name, or a
    pod variable of :mod:`megafleet_protocol.env`) and those it does not (reported, not passed)."""
    keep_kv = {mode.kv_cache_mode for mode in args.modes if mode.keeps}
    kv_mode = args.engine_kv_cache_mode
    if kv_mode is None and keep_kv:
        kv_mode = "offload" if "offload" in keep_kv else ("recompute" if keep_kv == {"recompute"} else None)
    staging = args.engine_staging or ("auto" if any(mode.staged for mode in args.modes) else None)
    requested: dict[str, str | None] = {
        "max_batch_size": str(max(args.batch, args.max_batch_size or 0)),
        "max_sequence_length": str(args.max_sequence_length),
        "refit_wait_seconds": str(args.refit_wait_seconds),
        "kv_cache_gib": args.kv_cache_gib,
        "cuda_graphs": args.cuda_graphs,
        "kv_cache_mode": kv_mode,
        "refit_staging": staging,
        "api_servers": args.api_servers,
    }
    fields = {field.name for field in dataclasses.fields(engine_settings.Settings)}
    passed: dict[str, str] = {}
    not_read: dict[str, str] = {}
    for field, value in requested.items():
        if value is not None:
            read = field in fields or hasattr(protocol_env, field.upper())  # a setting, or a pod variable
            (passed if read else not_read)[protocol_env.PREFIX + field.upper()] = value
    for item in args.engine_env:
        key, _, value = item.partition("=")
        passed[key] = value
    return passed, not_read


def run(args: argparse.Namespace) -> int:
    passed_env, not_read = engine_env(args)
    result: dict[str, Any] = {
        "benchmark": "inflight-refit",
        "machine": benchkit.machine(),
        "config": {
            key: (value if not isinstance(value, list | Path) else str(value))
            for key, value in vars(args).items()
            if key not in ("modes", "peer", "peer_spec", "out", "log_dir", "baseline_from")
        }
        | {
            "modes": [mode.name for mode in args.modes],
            "baseline_from": [str(path) for path in args.baseline_from],
            "engine_env": passed_env,
            "engine_options_not_read_by_this_engine": not_read,
        },
        "definitions": DEFINITIONS,
        "modes": [],
        "errors": {},
    }
    output = Output(args.out, result)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="inflight-refit-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"in-flight refit benchmark, modes {[mode.name for mode in args.modes]}: {args.out}, logs in {log_dir}")
    if not_read:
        say(f"this engine does not read {sorted(not_read)}: its defaults apply")
    children: list[Any] = []

    def give_up() -> None:
        say(f"giving up after {args.max_seconds:.0f} s (--max-seconds); stacks follow")
        faulthandler.dump_traceback(all_threads=True)
        result["errors"]["timeout"] = f"gave up after {args.max_seconds:.0f} s"
        output.save()
        for child in children:
            child.process.kill()
        os._exit(3)

    watchdog = threading.Timer(args.max_seconds, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        bench(args, output, log_dir, passed_env, children)
    except (BenchError, OSError, ValueError, KeyError) as error:
        say(f"FAILED: {type(error).__name__}: {error}")
        result["errors"]["fatal"] = f"{type(error).__name__}: {error}"
    finally:
        watchdog.cancel()
        result["peak_rss_mib"] = {name: peak_rss_mib(pid) for name, pid in result.get("_pids", {}).items()}
        for child in children:
            child.stop() if isinstance(child, Trainer) else child.terminate()
        for child in children:
            if not isinstance(child, Trainer):
                child.wait()
        result["wall_s"] = round(time.monotonic() - refit_nccl.STARTED, 1)
        conclude(result, args.baseline_from)
        output.save()
    print_summary(result)
    say(f"wrote {args.out}")
    return 0 if result["passed"] and not result["errors"] else 1


def bench(args: argparse.Namespace, output: Output, log_dir: Path, env: dict[str, str], children: list[Any]) -> None:
    """Start the engine and the trainer, then run every mode in order."""
    result = output.result
    token_file = log_dir / "agent-token"
    token_file.write_text(refit_nccl.AGENT_TOKEN + "\n")
    gpu = args.backend == "megatron"
    engine_mode = dataclasses.replace(
        refit_nccl.GPU if gpu else refit_nccl.CPU, engine_backend=args.backend, dtype=args.dtype, source=args.source
    )
    say(f"starting the engine ({args.source}, {args.backend}, {args.dtype}, batch {args.batch})")
    engine = refit_nccl.EngineProcess(
        MODEL,
        args.source,
        mode=engine_mode,
        gpu=args.gpu,
        token_file=token_file,
        log_path=log_dir / "engine.log",
        max_sequence_length=args.max_sequence_length,
        extra_env=env,
        nccl_debug=False,
    )
    children.append(engine)
    trainer = None
    if any(mode.refits for mode in args.modes):
        say(f"starting the trainer process (weight sets A and B on {args.trainer_device})")
        spec = {
            "source": args.source,
            "dtype": args.dtype,
            "device": "cuda" if args.trainer_device == "cuda" else "cpu",
            "bucket_mib": args.bucket_mib,
            "timeout_s": args.refit_timeout_s,
            "integrity": args.integrity,
        }
        trainer_env = dict(os.environ, PYTHONUNBUFFERED="1")
        trainer_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "engine"), str(ROOT / "protocol"), os.environ.get("PYTHONPATH")])
        )
        if gpu:
            trainer_env["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
        trainer = Trainer(spec, trainer_env, log_dir / "trainer.log")
        children.append(trainer)
    vocab = refit_nccl.shape_of(args.source).vocab  # while the engine loads (it imports the model's code)
    refit_nccl.wait_ready([engine], args.ready_timeout_s)
    result["engine_ready_s"] = round(engine.ready_seconds or 0.0, 1)
    result["_pids"] = {"engine": engine.process.pid}
    if trainer is not None:
        ready = trainer.wait_ready(args.ready_timeout_s)
        result["trainer"] = {key: value for key, value in ready.items() if key not in ("event", "port")}
        result["_pids"]["trainer"] = trainer.process.pid
        size = f"{ready['tensors']} tensors, {ready['bytes'] / 1e9:.3f} GB per set"
        say(f"trainer ready: {size}, built in {ready['build_s']} s")
    metrics = refit_nccl.Http(f"http://{engine.addresses['metrics']}")
    state_client = refit_nccl.Http(engine.agent_url, refit_nccl.AGENT_TOKEN)
    _, state = state_client.call("GET", "/v1/state")
    initial = int(state.get("weightVersion") or 0)
    versions = Versions(initial=initial, current=initial)
    context = Context(args, engine, trainer, versions, vocab, metrics, state_client)
    result["engine_warmup_s"] = warm_engine(context)
    output.save()
    for index, mode in enumerate(args.modes):
        try:
            row = run_mode(context, mode, index)
        except BenchError as error:
            say(f"  {mode.name} FAILED: {error}")
            result["modes"].append({"mode": mode.name, **mode_settings(mode, args), "error": str(error)})
            result["errors"][f"mode {index + 1} ({mode.name})"] = str(error)
            conclude(result, args.baseline_from)
            output.save()
            raise
        result["modes"].append(row)
        conclude(result, args.baseline_from)
        output.save()


def warm_engine(context: Context) -> float:
    """One short round of the whole batch (streams and batched completions, as the load sends them)
    before the first mode: a fresh engine's first steps are slow (first forwards, the API-server
    process's first requests), which would count against whichever mode comes first."""
    args = context.args
    started = time.perf_counter()
    warm = Load(context.engine.frontend_url, args, context.vocab, -1, new_tokens=min(16, args.new_tokens), rounds=1)
    warm.start(0.0)
    if not warm.join(args.wind_down_timeout_s):
        raise BenchError("the engine's warm-up requests did not finish")
    failed = [answer.error for answer in warm.answers if not answer.ok]
    if failed:
        raise BenchError(f"warm-up requests failed: {failed[:3]}")
    seconds = time.perf_counter() - started
    say(f"engine warmed up ({seconds:.1f} s)")
    return round(seconds, 2)


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def print_summary(result: dict[str, Any]) -> None:
    baseline = result.get("baseline") or {}
    say(f"summary (baseline {baseline.get('tok_per_s')} tok/s from {baseline.get('source')})")
    for row in result.get("headline", []):
        if not row["supported"]:
            say(f"  {row['mode']:<24} unsupported by this engine: {row.get('note')}")
            continue
        if "tok_per_s" not in row:
            say(f"  {row['mode']:<24} FAILED: {row.get('note')}")
            continue
        say(
            f"  {row['mode']:<24} {row['tok_per_s']:>9} tok/s (x{row['ratio_to_baseline']}; completed "
            f"{row['completed_tok_per_s']}), refits {row['refits']}, "
            f"stall p50/p99/max {row['stall_ms_p50_p99_max']} ms, gate closed {row['gate_closed_ms_p50_p99_max']} ms, "
            f"failed {row['failed_sequences']}, thrown away {row['thrown_away_tokens']} tokens, "
            f"span mismatches {row['span_mismatches']}{'' if row['passed'] else ' FAILED'}"
        )


DEFINITIONS = {
    "window.tok_per_s": "the engine's megafleet_generated_tokens_total (tokens delivered to sequences, read from "
    "/metrics) at the end of the window minus at its start, over the window's seconds; the window starts after "
    "--warmup seconds of load",
    "window.completed_tok_per_s": "tokens of the sequences answered completely (finish_reason length) whose answer "
    "arrived within the window, over the window's seconds: what reached the client (abort throws the rest away; "
    "noisy when a generation is not much shorter than the window)",
    "load_average": "os.getloadavg() at the end of the mode (the machine may be shared)",
    "ratio_to_baseline": "window.tok_per_s / baseline.tok_per_s: the mean of the no-refit ('none') windows of this "
    "run (run first and last), or of --baseline-from files",
    "refits.runs": "every refit of the window: prepare sent (sent_at_s, from the window's start), the trainer's "
    "send (its SendReport: seconds, phases_s, reused group), the agent's final /v1/refit/status (outcome, "
    "duration_ms, phases_ms, pause, inFlight, staging, verification); late_s: how late it went out (the previous "
    "refit took longer than --refit-every). The preflight refit (on the idle engine, before the load) is apart",
    "stall_ms": "per refit: the agent's pause.stallMilliseconds (the engine's last step before the refit to its "
    "first after) when the status has a pause; else the longest gap between two stream chunks (any probe) that "
    "overlaps [prepare sent, attempt ended]: what the probes saw of the engine not stepping (source says which)",
    "gate_closed_ms": "per refit: the agent's pause.gateClosedMilliseconds; else, under drain and abort, the "
    "attempt's durationMilliseconds (the gate closes at the suspend that starts the attempt and opens at the "
    "resume that ends it)",
    "recompute_ms, switch_ms": "the agent's pause.recomputeMilliseconds and switchMilliseconds (absent without a "
    "pause report)",
    "suspend_phase_ms": "the agent's suspend phase: under drain, the wait for every sequence in flight to finish",
    "transfer_s": "the trainer's SendReport.phases['transfer'] (pack and send every bucket, waiting for the "
    "receiver: in place under drain it includes the drain, which runs before the engine receives); "
    "engine_transfer_ms: the agent's receive + apply phases (the transfer as the engine saw it)",
    "p50, p99, max": "over the window's succeeded refits; p99 is nearest-rank (with fewer than 100 refits it is the "
    "largest but one at most)",
    "sequences.failed": "sequences whose request failed (a non-200 answer: all prompts of a batched request), whose "
    "stream carried an error event, or that ended with a finish_reason other than length",
    "sequences.thrown_away_tokens": "the engine's generated-tokens counter from just before the load started to "
    "the engine idle after the wind-down, minus the tokens of every sequence answered completely: tokens generated "
    "for sequences that failed",
    "spans": "every completed answer's weight_version_spans: starting at 0, starts and versions strictly "
    "increasing, every version one the engine served, the top-level weight_version equal to the first span's; "
    "without keep, one span per sequence (none spans a refit); probes also: the spans equal those drawn from "
    "each chunk's weight_version (each later span starts exactly at the first token the engine streamed with "
    "that version), and no token of version v arrived before the prepare of v was sent. mismatches counts "
    "answers with any problem (examples: the first five)",
    "switch_skew_ms": "keep modes, per version: across the probes that switched to it, the arrival of the last "
    "chunk of an older version minus that of the first chunk of this one (<= 0: every probe switched between the "
    "same two steps as far as delivery shows)",
    "unsupported": "a mode whose preflight refit the agent answered with 409 refit_mode_unsupported: the engine "
    "does not do it yet; the row carries the agent's message and no figures",
}


# -- arguments --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--backend", choices=["megatron", "transformers"], default="megatron")
    add("--source", help="model source (default: random://llama-8b; tiny://llama with transformers)")
    add("--dtype", help="default: bfloat16; float32 with transformers")
    add("--modes", type=parse_modes, default=parse_modes("none,drain,keep-persist-staged"), help="comma-separated")
    add("--no-baseline-last", action="store_true", help="do not run 'none' again at the end when it comes first")
    add("--baseline-from", type=Path, action="append", default=[], help="a result whose 'none' rows are the baseline")
    add("--batch", type=int, default=256, help="sequences kept in flight")
    add("--prompt-tokens", type=int, default=128)
    add("--new-tokens", type=int, default=2048, help="max_tokens of every sequence (ignore_eos)")
    add("--span-probes", type=int, help="sequences of the batch streamed (default 16, at most half; all: transformers)")
    add("--probe-request-size", type=int, help="prompts per streaming request (default 1; all: transformers)")
    add("--bulk-request-size", type=int, default=16, help="prompts per batched completion")
    add("--refit-every", type=float, default=30.0, help="seconds between refits in the window")
    add("--warmup", type=float, help="seconds of load before the window (default: 60; 5 with transformers)")
    add("--duration", type=float, default=300.0, help="the window, in seconds")
    add("--stagger-s", type=float, help="spread the load's starts over this (default: --warmup; 0 with transformers)")
    add("--staged-as", choices=["auto", "required"], default="auto", help="the staging field of '-staged' modes")
    add("--integrity", choices=list(get_args(vocabulary.Integrity)), default="none")
    add("--bucket-mib", type=int, default=1024)
    add("--trainer-device", choices=["cpu", "cuda"], help="where the weight sets live (default: cuda with megatron)")
    add("--gpu", type=int, default=0, help="the GPU of the engine and the trainer")
    add("--kv-cache-gib", help="MEGAFLEET_KV_CACHE_GIB (megatron)")
    add("--cuda-graphs", choices=["true", "false"], help="MEGAFLEET_CUDA_GRAPHS")
    add("--engine-kv-cache-mode", choices=list(get_args(vocabulary.KvCacheMode)), help="default: from the modes")
    add("--engine-staging", choices=list(get_args(vocabulary.StagingMode)), help="default: auto with a staged mode")
    add("--api-servers", help="MEGAFLEET_API_SERVERS (default: the engine's)")
    add("--max-batch-size", type=int, help="MEGAFLEET_MAX_BATCH_SIZE (default: --batch)")
    add("--max-sequence-length", type=int, help="default: prompt + new tokens")
    add("--refit-wait-seconds", type=int, default=600, help="MEGAFLEET_REFIT_WAIT_SECONDS: held requests' bound")
    add("--engine-env", action="append", default=[], metavar="KEY=VALUE", help="further engine variables")
    add("--refit-timeout-s", type=int, default=600, help="each refit's timeoutSeconds and the sender's bound")
    add("--poll-ms", type=float, default=5.0, help="refit status polls")
    add("--ready-timeout-s", type=float, default=420.0)
    add("--wind-down-timeout-s", type=float, default=300.0)
    add("--max-seconds", type=float, default=570.0, help="give up (saving what was measured)")
    add("--seed", type=int, default=0)
    add("--machine-label", help="in the default result name (default: cpu, or the GPU's model)")
    add("--out", help="result file, or a folder (existing, or ending in /) for the default name")
    add("--log-dir", type=Path, help="engine and trainer logs (default: a temporary folder)")
    add("--combine", type=Path, nargs="+", metavar="RESULT", help="merge earlier results into --out, and stop")
    add("--peer", choices=["trainer"], help=argparse.SUPPRESS)
    add("--peer-spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer:
        return args
    tiny = args.backend == "transformers"
    args.source = args.source or ("tiny://llama" if tiny else "random://llama-8b")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    args.warmup = args.warmup if args.warmup is not None else (5.0 if tiny else 60.0)
    # the transformers backend batches statically (a batch runs until its last sequence ends): staggered
    # starts would only split the batch; megatron's engine admits sequences into the running batch
    args.stagger_s = args.stagger_s if args.stagger_s is not None else (0.0 if tiny else args.warmup)
    args.trainer_device = args.trainer_device or ("cpu" if tiny else "cuda")
    args.max_sequence_length = args.max_sequence_length or args.prompt_tokens + args.new_tokens
    # the transformers backend batches statically: whatever is queued when a batch starts runs to its end
    # together, so the whole batch goes as one streaming request (else the first request to arrive would
    # start a batch of its own and the rest wait for it); megatron's engine admits into the running batch
    default_probes = args.batch if tiny else min(16, max(1, args.batch // 2))
    args.span_probes = args.span_probes if args.span_probes is not None else default_probes
    args.probe_request_size = args.probe_request_size or (max(1, args.span_probes) if tiny else 1)
    first, last = args.modes[0].name, args.modes[-1].name
    if first == "none" and len(args.modes) > 1 and last != "none" and not args.no_baseline_last:
        args.modes.append(args.modes[0])
    if not 0 <= args.span_probes <= args.batch or min(args.bulk_request_size, args.probe_request_size) < 1:
        parser.error("--span-probes must be within --batch, --bulk-request-size and --probe-request-size at least 1")
    args.out = output_path(args)
    return args


def output_path(args: argparse.Namespace) -> Path:
    label = args.machine_label or machine_label(args.backend)
    name = f"inflight-refit-{label}-{datetime.datetime.now(datetime.UTC).date().isoformat()}.json"
    if args.out is None:
        return Path(tempfile.gettempdir()) / name
    if args.out.endswith("/") or Path(args.out).is_dir():
        return Path(args.out) / name
    return Path(args.out)


def machine_label(backend: str) -> str:
    if backend != "megatron":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((model for model in ("h200", "h100", "b200", "a100") if model in name), "gpu")


def combine(files: Sequence[Path], out: Path) -> int:
    """One result from the results of several runs (each mode its own command on the GPU machine):
    their rows in order, the baseline over every ``none`` row, the ratios and the verdicts again."""
    results = [json.loads(path.read_text()) for path in files]
    combined: dict[str, Any] = {
        "benchmark": "inflight-refit",
        "combined_from": [str(path) for path in files],
        "machine": results[0]["machine"],
        "config": results[0]["config"],
        "definitions": DEFINITIONS,
        "modes": [
            row | {"from_file": str(path)}
            for path, result in zip(files, results, strict=True)
            for row in result["modes"]
        ],
        "errors": {
            f"{path}: {key}": value
            for path, result in zip(files, results, strict=True)
            for key, value in result["errors"].items()
        },
    }
    conclude(combined, [])
    Output(out, combined).save()
    print_summary(combined)
    say(f"wrote {out}")
    return 0 if combined["passed"] and not combined["errors"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer == "trainer":
        return trainer_main(json.loads(args.peer_spec))
    if args.combine:
        return combine(args.combine, args.out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses stop the children
    return run(args)


if __name__ == "__main__":
    exit_status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the trainer never destroys its process group (docs/incidents.md#nccl-destroy-hang) and the driver's
    # load threads are daemons: leave without the interpreter's teardown, the result file is written
    os._exit(exit_status)
