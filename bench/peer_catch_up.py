"""Catch-up from a peer against catch-up from a checkpoint, on CPU: time from a new shard's engine start
to serving the fleet's current version.

Processes (``python -m megafleet_engine.cli`` on loopback, the transformers backend, float32):

* the peer: an engine serving ``--source`` (its weights, version 0), started once;
* each round, a new engine started without weights (``MEGAFLEET_WEIGHTS_INITIAL=refit``, as a shard
  added by a scale-out after a refit starts), which catches up with what the operator sends it:
  ``peer``: ``POST /v1/peer/send`` to the peer and ``POST /v1/refit/peer`` to it (gloo, every bucket
  sealed and checked with its ``mf64`` digest); ``checkpoint``: ``POST /v1/refit/checkpoint`` of the same
  weights saved as safetensors (read from the page cache after the first round: the best case of a
  checkpoint on a local or cached volume);
* this process, the driver: the operator's calls, and a greedy request to the new engine once it
  reports the version, the first answer stamped with it ending the round.

Modes alternate (peer, checkpoint, peer, ...) so both see the same machine load. Reported per mode
(medians over ``--rounds``): ``start_to_agent`` (the engine process starts until its agent answers:
the model skeleton built, no weights), ``catch_up`` (the catch-up call until the engine's refit
status says it serves the version: the copy or load and the switch), ``catch_up_to_first_answer``
(until the first answer stamped with it: the frontend's API-server process may still be starting),
``start_to_serving`` (process start until that answer: what a scale-out waits). Without either
source a shard stays Stale until the next refit (no figure). The peer answers a request every
``--probe-seconds`` during the copies; its slowest answer and any failure are reported.

    PYTHONPATH=engine:protocol python3 bench/peer_catch_up.py --out bench/results/peer-catch-up-cpu2-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import benchkit

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "peer-catch-up-bench-token"
SERVING = re.compile(r"serving the (\w+) on http://(\S+)")
PROMPT = [50, 51, 52, 53]
PEER_PORT = 29600  # megafleet_protocol.ports.PEER_PORT


def call(url: str, body: Any = None, *, timeout: float = 60.0) -> tuple[int, Any]:
    """JSON over HTTP with the agent token; ``(0, None)`` when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
    except OSError:
        return 0, None


class Engine:
    """One engine process on ``host``; its servers' addresses read from its log."""

    def __init__(self, host: str, source: str, folder: Path, *, deferred: bool) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("MEGAFLEET_")}
        env.update(
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(ROOT / "engine"), str(ROOT / "protocol"), env.get("PYTHONPATH")])
            ),
            MEGAFLEET_BACKEND="transformers",
            MEGAFLEET_MODEL_SOURCE=source,
            MEGAFLEET_SERVED_MODEL_NAME="bench",
            MEGAFLEET_DTYPE="float32",
            MEGAFLEET_MAX_SEQUENCE_LENGTH="128",
            MEGAFLEET_WEIGHTS_INITIAL="refit" if deferred else "checkpoint",
            MEGAFLEET_HOST=host,
            MEGAFLEET_FRONTEND_PORT="0",
            MEGAFLEET_AGENT_PORT="0",
            MEGAFLEET_METRICS_PORT="0",
            MEGAFLEET_AGENT_TOKEN_FILE=str(folder / "token"),
        )
        self.host = host
        self.log_path = folder / f"engine-{host}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megafleet_engine.cli"], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.addresses: dict[str, str] = {}

    def wait_agent(self, timeout: float = 300.0) -> float:
        """Seconds from the process start until its agent answers."""
        deadline = time.monotonic() + timeout
        while True:
            for match in SERVING.finditer(self.log_path.read_text(errors="replace")):
                self.addresses[match.group(1)] = match.group(2)
            if "agent" in self.addresses and call(f"{self.agent}/healthz", timeout=5)[0] == 200:
                return time.monotonic() - self.started
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine on {self.host} did not start: {self.log_path}")
            time.sleep(0.02)  # polling start-up with a deadline

    @property
    def agent(self) -> str:
        return f"http://{self.addresses['agent']}"

    def completion(self) -> tuple[int, str | None]:
        body = {"model": "bench", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(
            f"http://{self.addresses['frontend']}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers.get("X-Megafleet-Weight-Version")
        except urllib.error.HTTPError as error:
            return error.code, None
        except OSError:
            return 0, None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


def catch_up(mode: str, peer: Engine, new: Engine, checkpoint: Path) -> None:
    """What the operator sends for ``mode``; raises when an agent refuses."""
    refit = {"version": 0, "timeoutSeconds": 300}
    if mode == "peer":
        receive = {
            **refit,
            "bucketSizeMiB": 64,
            "integrity": "checksum",
            "peer": {"address": peer.host, "port": PEER_PORT, "receivers": 1, "index": 1, "shard": 0},
        }
        status, body = call(f"{new.agent}/v1/refit/peer", receive)
        if status == 202:
            send = {"version": 0, "port": PEER_PORT, "timeoutSeconds": 300, "bucketSizeMiB": 64}
            status, body = call(f"{peer.agent}/v1/peer/send", send)
    else:
        status, body = call(f"{new.agent}/v1/refit/checkpoint", {**refit, "path": str(checkpoint)})
    if status != 202:
        raise RuntimeError(f"{mode}: HTTP {status}: {body}")


def one_round(mode: str, peer: Engine, args: argparse.Namespace, folder: Path, checkpoint: Path) -> dict[str, Any]:
    new = Engine(args.host, args.source, folder, deferred=True)
    try:
        start_to_agent = new.wait_agent()
        asked, loaded = time.monotonic(), 0.0
        catch_up(mode, peer, new, checkpoint)
        while True:
            status, body = call(f"{new.agent}/v1/refit/status", timeout=30)
            if status == 200 and body["phase"] == "failed":
                raise RuntimeError(f"{mode}: {body['error']}")
            if status == 200 and body["phase"] == "succeeded":
                loaded = loaded or time.monotonic()
                answered, version = new.completion()
                if answered == 200 and version == "0":
                    break
            if time.monotonic() - asked > 300:
                raise RuntimeError(f"{mode}: no answer of version 0 within 300 s")
            time.sleep(0.01)  # polling the refit status, with a deadline
        served = time.monotonic()
        return {
            "mode": mode,
            "start_to_agent": round(start_to_agent, 3),
            "catch_up": round(loaded - asked, 3),
            "catch_up_to_first_answer": round(served - asked, 3),
            "start_to_serving": round(served - new.started, 3),
            "source": body.get("source"),
            "verification": (body.get("verification") or {}).get("integrity"),
            "bytes": body.get("bytesReceived"),
        }
    finally:
        new.close()


def probe(peer: Engine, stop: threading.Event, answers: list[tuple[float, int]], every: float) -> None:
    """The peer's answers during the run: (seconds, status) of each greedy request."""
    while not stop.is_set():
        began = time.monotonic()
        status, _ = peer.completion()
        answers.append((time.monotonic() - began, status))
        stop.wait(every)  # pacing of the probe, not synchronisation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="tiny://llama?layers=4&hidden=512&heads=8&kv_heads=4&intermediate=2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probe-seconds", type=float, default=0.2)
    parser.add_argument("--peer-host", default="127.0.37.1")
    parser.add_argument("--host", default="127.0.37.2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from safetensors.torch import save_file

    from megafleet_engine.models import tiny

    folder = Path(tempfile.mkdtemp(prefix="peer-catch-up-"))
    (folder / "token").write_text(TOKEN + "\n")
    checkpoint = folder / "checkpoint"
    checkpoint.mkdir()
    weights = {name: tensor.contiguous() for name, tensor in tiny.reference_weights(args.source).items()}
    save_file(weights, str(checkpoint / "model.safetensors"))
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    print(f"{len(weights)} tensors, {nbytes / 2**20:.1f} MiB; logs in {folder}", file=sys.stderr)

    peer = Engine(args.peer_host, args.source, folder, deferred=False)
    stop, answers = threading.Event(), []
    rounds: list[dict[str, Any]] = []
    try:
        peer.wait_agent()
        prober = threading.Thread(target=probe, args=(peer, stop, answers, args.probe_seconds), daemon=True)
        prober.start()
        for index in range(2 * args.rounds):
            mode = ("peer", "checkpoint")[index % 2]
            rounds.append(one_round(mode, peer, args, folder, checkpoint))
            print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        stop.set()
        peer.close()
    summary = {
        mode: {
            key: statistics.median(r[key] for r in rounds if r["mode"] == mode)
            for key in ("start_to_agent", "catch_up", "catch_up_to_first_answer", "start_to_serving")
        }
        for mode in ("peer", "checkpoint")
    }
    result = {
        "benchmark": "peer-catch-up",
        "machine": benchkit.machine(),
        "config": {**vars(args), "out": str(args.out), "tensors": len(weights), "bytes": nbytes},
        "summary_medians_seconds": summary,
        "peer_during_copies": {
            "answers": len(answers),
            "failed": sum(1 for _, status in answers if status != 200),
            "slowest_seconds": round(max((seconds for seconds, _ in answers), default=0.0), 3),
        },
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
