"""Shared by the in-flight refit tests (``tests/e2e/test_refit_inflight.py`` and the operator chaos
drill's keep case): long greedy streams read with the official ``openai`` client, each chunk's tokens
with the weight version that computed them, a Refit that keeps them, and what a fresh model at a
version generates from a prefix (the reference a kept stream is checked against)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import openai
import torch

from helpers import refit_e2e
from megafleet.objects import Object
from megafleet_dev import kube
from megafleet_engine.models import tiny

STREAMS = 8
MAX_TOKENS = 1200
MAX_SEQUENCE_LENGTH = 2048
SWITCH_AFTER = 24  # every stream has produced this many tokens before the Refit is created
OLD_SOURCE = "tiny://llama"
NEW_SOURCE = "tiny://llama?seed=7"


def prompt(index: int) -> list[int]:
    return [1, 40 + index, 41, 42 + 2 * index, 43]


def long_fleet(**refit: str) -> dict[str, Any]:
    """The two-shard tiny fleet with room for :data:`MAX_TOKENS`-token streams (``refit``: its
    ``spec.refit`` settings, e.g. ``staging="auto"``)."""
    manifest = refit_e2e.tiny_fleet()
    manifest["spec"]["model"]["maxSequenceLength"] = MAX_SEQUENCE_LENGTH
    if refit:
        manifest["spec"]["refit"] = {**manifest["spec"].get("refit", {}), **refit}
    return manifest


@dataclasses.dataclass
class Stream:
    """One greedy sequence: its chunks' tokens and their version, and its final spans."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    spans: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def switch(self) -> int:
        """The index of the first token of version 1 (the stream's length if none)."""
        return self.versions.index(1) if 1 in self.versions else len(self.versions)

    def plain_spans(self) -> list[dict[str, Any]]:
        """The final spans without the fields left out (``kv`` of the first span)."""
        assert self.spans is not None, "the stream ended without its spans"
        return [{key: value for key, value in span.items() if value is not None} for span in self.spans]


@dataclasses.dataclass
class ShardLoad:
    """One streaming request with several prompts to one frontend, read with the official client:
    the transformers backend batches statically, so the sequences of one request start together and
    all are mid-generation at once (one request per sequence would run them one batch after another)."""

    url: str
    streams: list[Stream]
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    max_tokens: int = MAX_TOKENS

    def run(self) -> None:
        try:
            with openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=300) as client:
                chunks = client.completions.create(
                    model="tiny",
                    prompt=[stream.prompt for stream in self.streams],
                    max_tokens=self.max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True, "ignore_eos": True},
                )
                for chunk in chunks:
                    for choice in chunk.choices:
                        stream, extra = self.streams[choice.index], choice.model_extra or {}
                        ids = [int(token) for token in extra.get("token_ids") or []]
                        if ids:
                            stream.tokens += ids
                            stream.versions += [int(extra["weight_version"])] * len(ids)
                        if choice.finish_reason is not None:
                            stream.finish_reason = choice.finish_reason
                            stream.spans = extra.get("weight_version_spans")
                    if all(len(stream.tokens) >= SWITCH_AFTER for stream in self.streams):
                        self.started.set()
        except Exception as error:  # reported by the test thread
            for stream in self.streams:
                stream.error = f"{type(error).__name__}: {error}"
        finally:
            self.started.set()


def frontends(kube_admin: kube.Kube, namespace: str, fleet: Object) -> list[str]:
    urls = []
    for shard in fleet["status"]["shards"]:
        pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{shard['pods'][0]}")
        assert pod is not None
        urls.append(f"http://{pod['status']['podIP']}:8000/v1")
    return urls


def start_streams(urls: list[str], max_tokens: int = MAX_TOKENS) -> list[tuple[ShardLoad, threading.Thread]]:
    """:data:`STREAMS` sequences of ``max_tokens`` spread over ``urls``, one request per frontend;
    returns once every sequence produced :data:`SWITCH_AFTER` tokens."""
    running = []
    for offset, url in enumerate(urls):
        streams = [Stream(prompt(index)) for index in range(offset, STREAMS, len(urls))]
        load = ShardLoad(url, streams, max_tokens=max_tokens)
        thread = threading.Thread(target=load.run, daemon=True)
        thread.start()
        running.append((load, thread))
    for load, _ in running:
        assert load.started.wait(refit_e2e.WAIT), "a request produced no tokens"
        assert all(stream.error is None for stream in load.streams), load.streams[0].error
    return running


def finish(running: list[tuple[ShardLoad, threading.Thread]]) -> list[ShardLoad]:
    for _, thread in running:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a stream did not finish"
    return [load for load, _ in running]


def streams_of(loads: list[ShardLoad]) -> list[Stream]:
    return [stream for load in loads for stream in load.streams]


def fresh_continuations(load: ShardLoad) -> list[list[int]]:
    """What the same engine, now serving version 1, generates greedily from each stream's prompt plus
    its tokens before the switch, as one batch (the fresh engine at the new version that a
    ``recompute`` switch must equal: same process, threads and shapes as the kept batch)."""
    with openai.OpenAI(base_url=load.url, api_key="unused", max_retries=0, timeout=300) as client:
        completion = client.completions.create(
            model="tiny",
            prompt=[stream.prompt + stream.tokens[: stream.switch] for stream in load.streams],
            max_tokens=load.max_tokens - min(stream.switch for stream in load.streams),
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    assert completion.model_extra is not None and completion.model_extra.get("weight_version") == 1
    by_index = {choice.index: (choice.model_extra or {})["token_ids"] for choice in completion.choices}
    return [[int(token) for token in by_index[index]] for index in range(len(load.streams))]


def create_refit(kube_admin: kube.Kube, namespace: str, version: int, path: str, **modes: str) -> str:
    """A checkpoint Refit of the fleet ``tiny`` with the in-flight ``modes``; returns its API path."""
    manifest = refit_e2e.refit_manifest("tiny", version, checkpoint=path)
    manifest["spec"].update(modes)
    kube_admin.create(refit_e2e.refits(namespace), manifest)
    return f"{refit_e2e.refits(namespace)}/{manifest['metadata']['name']}"


def continuation(source: str, prefix: list[int], count: int) -> list[int]:
    """What a fresh model at ``source`` generates greedily after ``prefix``."""
    model, _ = tiny.build_tiny(source)
    inputs = torch.tensor([prefix])
    with torch.inference_mode():
        output = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=count,
            min_new_tokens=count,
            eos_token_id=None,
        )
    return [int(token) for token in output[0, len(prefix) :]]


def check_kept(loads: list[ShardLoad], kv: str) -> int:
    """Every stream finished, its versions never go back, its spans say exactly where its switch
    fell, and its tokens before the switch are version 0's greedy output; under ``recompute`` the
    tokens after it are what the engine at version 1 generates afresh from the prompt plus the tokens
    before (:func:`fresh_continuations`). Returns how many streams spanned the switch."""
    spanning = 0
    for load in loads:
        fresh = fresh_continuations(load) if kv == "recompute" else None
        for index, stream in enumerate(load.streams):
            assert stream.error is None, stream.error
            assert stream.finish_reason == "length" and len(stream.tokens) == load.max_tokens
            switch = stream.switch
            assert stream.versions == [0] * switch + [1] * (load.max_tokens - switch)
            expected: list[dict[str, Any]] = [{"start": 0, "version": 0}]
            if switch < load.max_tokens:
                expected.append({"start": switch, "version": 1, "kv": kv})
            assert stream.plain_spans() == expected
            assert stream.tokens[:switch] == continuation(OLD_SOURCE, stream.prompt, switch)
            if SWITCH_AFTER <= switch < load.max_tokens:
                spanning += 1
                if fresh is not None:
                    after = stream.tokens[switch:]
                    assert after == fresh[index][: len(after)], f"stream {index}: after its switch at {switch}"
    return spanning
