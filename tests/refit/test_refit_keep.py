"""A refit that keeps the sequences in flight, over the real megafleet wire: the trainer's SDK sends over
gloo on a thread, the operator's call is ``POST /v1/refit/prepare`` with ``suspendMode: keep``, and a
completion streams through the engine's own frontend meanwhile. The stream never fails; its chunks
carry version 0 up to the switch and the new version after it (never both in one chunk), its last
chunk's spans say exactly that, with the KV-cache mode on the later span, and under ``recompute`` its
tokens after the switch are the trainer's model's greedy continuation of the prefix.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import refit_harness as harness

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [40, 41, 42, 43, 44]
MAX_TOKENS = 120  # the harness's engines hold 128 tokens per sequence


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


class Stream:
    """A greedy token-id completion streamed on a thread: per chunk, its weight version and tokens."""

    def __init__(self, frontend_url: str) -> None:
        self.chunks: list[tuple[int, list[int]]] = []
        self.spans: list[dict[str, Any]] | None = None
        self.started = threading.Event()
        self.error: BaseException | None = None
        self._url = frontend_url
        self._thread = threading.Thread(target=self._read, name="stream", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        body = {
            "model": harness.MODEL,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        try:
            with (
                httpx.Client(timeout=60) as client,
                client.stream("POST", f"{self._url}/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line.removeprefix("data: "))["choices"]:
                        if choice.get("token_ids"):
                            self.chunks.append((choice["weight_version"], choice["token_ids"]))
                            self.started.set()
                        if choice.get("finish_reason") is not None:
                            self.spans = choice["weight_version_spans"]
        except BaseException as error:  # handed to the test by join()
            self.error = error
        finally:
            self.started.set()

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("kv_cache_mode", ["persist", "recompute"])
def test_a_stream_goes_on_across_a_keep_refit_with_two_spans(
    served: harness.InProcessEngine, kv_cache_mode: str
) -> None:
    trainer = harness.Trainer()
    stream = Stream(served.frontend_url)
    assert stream.started.wait(30)
    port = harness.free_port()
    sending = trainer.send_in_background(port, 2, version=5)
    accepted = served.agent.prepare(
        5, port=port, world_size=2, rank_offset=1, suspend_mode="keep", kv_cache_mode=kv_cache_mode
    )
    assert accepted.status_code == 202, accepted.text
    status = served.agent.wait_finished()
    assert sending.result() is not None
    stream.join()

    assert status["phase"] == "succeeded", status
    assert status["inFlight"] == {
        "requested": "keep",
        "effective": "keep",
        "kvCacheMode": kv_cache_mode,
        "reason": None,
        "kept": 1,
        "drained": 0,
        "aborted": 0,
        "abortedTokens": 0,
        "recomputedTokens": status["inFlight"]["recomputedTokens"],
    }
    assert status["staging"] == {"requested": "off", "effective": "inPlace", "reason": None, "bytes": 0}
    assert status["pause"]["stallMilliseconds"] > 0 and status["pause"]["gateClosedMilliseconds"] == 0
    assert [phase["name"] for phase in status["phases"]] == ["pause", "join", "receive", "apply", "switch"]
    versions = [version for version, _ in stream.chunks]
    assert versions == sorted(versions) and set(versions) == {0, 5}, "version 0 up to the switch, 5 after"
    before = [token for version, tokens in stream.chunks if version == 0 for token in tokens]
    after = [token for version, tokens in stream.chunks if version == 5 for token in tokens]
    assert len(before) + len(after) == MAX_TOKENS, "the kept stream lost no token"
    assert stream.spans == [{"start": 0, "version": 0}, {"start": len(before), "version": 5, "kv": kv_cache_mode}]
    if kv_cache_mode == "recompute":
        assert status["inFlight"]["recomputedTokens"] == len(PROMPT) + len(before)
        assert after == trainer.greedy(PROMPT + before, len(after))
    assert served.agent.state()["weightVersion"] == 5
