"""Shared test helper (it holds no tests): real ``megafleet-engine`` processes on loopback and the tiny
model's own greedy generation to compare them with.

* :class:`EngineCommand`: ``python -m megafleet_engine.cli`` (the ``megafleet-engine`` command) with
  the ``MEGAFLEET_*`` variables a test gives, its log, where its servers listen and a clean stop.
* :class:`EngineProcess`: that command serving the tiny Llama on CPU, bound to a 127.x address with
  free ports; :meth:`EngineProcess.requests` reads its Prometheus counter of frontend requests, so a
  test can see which engine a client really talked to.
* :class:`Reference`: the same tiny model in this process, for the greedy tokens an engine must return.

A module, not a ``conftest.py`` (the root conftest must stay the only one); test modules import it
(``tests/`` is on ``sys.path`` because the root conftest lives there).
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from megafleet_engine.models import tiny

MODEL = "tiny"
SOURCE = "tiny://llama"
AGENT_TOKEN = "engine-helper-agent-token"
START_TIMEOUT_SECONDS = 120
SERVING = re.compile(r"serving the (\w+) on http://(\S+)")


def token_file(folder: Path) -> Path:
    path = folder / "agent-token"
    path.write_text(AGENT_TOKEN + "\n")
    return path


class EngineCommand:
    """``python -m megafleet_engine.cli`` with ``env`` over this process's environment (whose own
    ``MEGAFLEET_*`` variables are dropped); its stderr is read by a thread into :attr:`log` (and
    echoed to this process's stderr, prefixed, with ``echo``)."""

    def __init__(self, env: Mapping[str, str], *, echo: str | None = None) -> None:
        full = {key: value for key, value in os.environ.items() if not key.startswith("MEGAFLEET_")}
        full.update(env)
        self.echo = echo
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megafleet_engine.cli"],
            env=full,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.log: list[str] = []
        self.served: list[tuple[str, str]] = []  # (server name, host:port) in the order logged
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if self.echo is not None:
                sys.stderr.write(f"[{self.echo}] {line}")
            self._lines.put(line)
        self._lines.put(None)

    def wait_serving(self, *names: str, timeout: float = START_TIMEOUT_SECONDS) -> dict[str, str]:
        """Block until the log said where each of ``names`` listens (a name given twice: two servers
        of that name, e.g. the agents of two ranks); the first address of each name."""
        wanted = collections.Counter(names)
        deadline = time.monotonic() + timeout
        while wanted - collections.Counter(name for name, _ in self.served):
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, "the engine exited during start-up:\n" + "".join(self.log[-40:])
            if match := SERVING.search(line):
                self.served.append((match.group(1), match.group(2)))
        return {name: next(address for served, address in self.served if served == name) for name in wanted}

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s; the exit status (negative: killed by a signal)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(timeout=30)
        self._reader.join(timeout=30)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return code


class EngineProcess(EngineCommand):
    """One engine process on ``host`` (frontend, agent and metrics on free ports)."""

    def __init__(
        self, host: str, token: Path, *, source: str = SOURCE, deferred: bool = False, env: Mapping[str, str] = {}
    ) -> None:
        super().__init__(
            {
                **env,
                "MEGAFLEET_MODEL_SOURCE": source,
                "MEGAFLEET_SERVED_MODEL_NAME": MODEL,
                "MEGAFLEET_DTYPE": "float32",
                "MEGAFLEET_MAX_SEQUENCE_LENGTH": "128",
                "MEGAFLEET_HOST": host,
                "MEGAFLEET_FRONTEND_PORT": "0",
                "MEGAFLEET_AGENT_PORT": "0",
                "MEGAFLEET_METRICS_PORT": "0",
                "MEGAFLEET_AGENT_TOKEN_FILE": str(token),
                "MEGAFLEET_WEIGHTS_INITIAL": "refit" if deferred else "checkpoint",
            }
        )
        self.host = host
        self.addresses: dict[str, str] = {}

    def wait_serving(self, *names: str, timeout: float = START_TIMEOUT_SECONDS) -> dict[str, str]:
        """Block until the process logged where its three servers listen (it binds before it logs)."""
        self.addresses = super().wait_serving(*(names or ("frontend", "agent", "metrics")), timeout=timeout)
        return self.addresses

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, as a fleet's status would publish it."""
        return f"http://{self.addresses['frontend']}/v1"

    def requests(self, endpoint: str = "/v1/completions") -> int:
        """Frontend requests to ``endpoint`` this engine counted (any status), from its metrics."""
        text = httpx.get(f"http://{self.addresses['metrics']}/metrics", timeout=30).text
        return int(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "megafleet_requests_total" and sample.labels.get("endpoint") == endpoint
            )
        )

    def close(self) -> None:
        self.stop()


class Reference:
    """The tiny model of ``source`` in this process: what an engine serving it must generate."""

    def __init__(self, source: str = SOURCE) -> None:
        self.model, self.tokenizer = tiny.build_tiny(source)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False) -> list[int]:
        """Greedy tokens after ``prompt_ids``; EOS ends them (and is the last) unless ``ignore_eos``."""
        inputs = torch.tensor([list(prompt_ids)])
        stop = {"eos_token_id": None} if ignore_eos else {}
        with torch.inference_mode():
            output = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens, **stop
            )
        return [int(token) for token in output[0, len(prompt_ids) :]]
