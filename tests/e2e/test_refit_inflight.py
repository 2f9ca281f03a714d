"""In-flight refits end to end (docs/proposals/0003-in-flight-refits.md): a Refit with
``inFlight: keep`` lands while eight long greedy streams are mid-generation on the two-shard tiny
CPU fleet, against the real control plane, the operator and engine pods run by the local runner.

No stream fails; every streamed chunk's tokens carry the version that computed them and each
stream's final spans say exactly where its switch fell. Under ``kvCacheMode: recompute`` the tokens
after the switch are what a fresh model at the new version generates greedily from the prompt plus
the tokens before it, and the tokens before it are the old version's own greedy output. A keep
Refit that fails (its checkpoint does not exist) leaves every stream running on the old version.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import openai
import pytest
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


@dataclasses.dataclass
class Stream:
    """One greedy stream read with the official client: each chunk's tokens and their version."""

    url: str
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    spans: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    error: str | None = None
    started: threading.Event = dataclasses.field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            with openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=300) as client:
                chunks = client.completions.create(
                    model="tiny",
                    prompt=self.prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True, "ignore_eos": True},
                )
                for chunk in chunks:
                    for choice in chunk.choices:
                        extra = choice.model_extra or {}
                        ids = [int(token) for token in extra.get("token_ids") or []]
                        if ids:
                            self.tokens += ids
                            self.versions += [int(extra["weight_version"])] * len(ids)
                        if choice.finish_reason is not None:
                            self.finish_reason = choice.finish_reason
                            self.spans = extra.get("weight_version_spans")
                    if len(self.tokens) >= SWITCH_AFTER:
                        self.started.set()
        except Exception as error:  # reported by the test thread
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.started.set()


def start_streams(kube_admin: kube.Kube, namespace: str, fleet: Object) -> list[tuple[Stream, threading.Thread]]:
    urls = []
    for shard in fleet["status"]["shards"]:
        pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{shard['pods'][0]}")
        assert pod is not None
        urls.append(f"http://{pod['status']['podIP']}:8000/v1")
    running = []
    for index in range(STREAMS):
        stream = Stream(urls[index % len(urls)], prompt(index))
        thread = threading.Thread(target=stream.run, daemon=True)
        thread.start()
        running.append((stream, thread))
    for stream, _ in running:
        assert stream.started.wait(refit_e2e.WAIT), "a stream produced no tokens"
        assert stream.error is None, stream.error
    return running


def finish(running: list[tuple[Stream, threading.Thread]]) -> list[Stream]:
    for _, thread in running:
        thread.join(timeout=300)
        assert not thread.is_alive(), "a stream did not finish"
    return [stream for stream, _ in running]


def keep_refit(kube_admin: kube.Kube, namespace: str, version: int, path: str, **modes: str) -> Object:
    manifest = refit_e2e.refit_manifest("tiny", version, checkpoint=path)
    manifest["spec"].update(modes)
    kube_admin.create(refit_e2e.refits(namespace), manifest)
    done = kube_admin.wait(
        f"{refit_e2e.refits(namespace)}/{manifest['metadata']['name']}",
        refit_e2e.refit_ended,
        timeout=refit_e2e.WAIT,
        what=f"the keep refit to version {version}",
    )
    assert done is not None
    return done


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


@pytest.fixture
def fleet(operator: object, kube_admin: kube.Kube, namespace: str) -> Object:
    manifest = refit_e2e.tiny_fleet()
    manifest["spec"]["model"]["maxSequenceLength"] = MAX_SEQUENCE_LENGTH
    kube_admin.create(refit_e2e.fleets(namespace), manifest)
    ready = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
    assert ready is not None and ready["status"]["weightVersion"] == 0
    return ready


def test_a_keep_refit_lands_mid_generation_and_every_stream_continues_on_the_new_weights(
    fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    running = start_streams(kube_admin, namespace, fleet)

    result = keep_refit(kube_admin, namespace, 1, NEW_SOURCE, inFlight="keep", kvCacheMode="recompute")
    streams = finish(running)

    status = result["status"]
    assert status["phase"] == "Succeeded", status
    assert status["inFlight"]["effective"] == "keep" and status["inFlight"]["kvCacheMode"] == "recompute"
    assert status["inFlight"]["kept"] >= 1 and status["inFlight"]["aborted"] == 0
    assert status["inFlight"]["recomputedTokens"] > 0
    assert status["pause"]["stallMaxMilliseconds"] >= 0
    assert (kube.condition(result, "KeepUnavailable") or {}).get("status", "False") == "False"
    spanning = 0
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.finish_reason == "length" and len(stream.tokens) == MAX_TOKENS
        switch = stream.versions.index(1) if 1 in stream.versions else len(stream.versions)
        # versions never go back, and the spans say exactly where the switch fell
        assert stream.versions == [0] * switch + [1] * (MAX_TOKENS - switch)
        expected_spans: list[dict[str, Any]] = [{"start": 0, "version": 0}]
        if switch < MAX_TOKENS:
            expected_spans.append({"start": switch, "version": 1, "kv": "recompute"})
        assert stream.spans is not None
        assert [{k: v for k, v in span.items() if v is not None} for span in stream.spans] == expected_spans
        assert stream.tokens[:switch] == continuation(OLD_SOURCE, stream.prompt, switch)
        if SWITCH_AFTER <= switch < MAX_TOKENS:
            spanning += 1
            after = MAX_TOKENS - switch
            assert stream.tokens[switch:] == continuation(NEW_SOURCE, stream.prompt + stream.tokens[:switch], after)
    assert spanning == STREAMS  # the refit landed while every stream was mid-generation


def test_a_keep_refit_that_fails_leaves_every_stream_on_the_old_version(
    fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    running = start_streams(kube_admin, namespace, fleet)

    result = keep_refit(kube_admin, namespace, 1, "/nonexistent/megafleet-checkpoint", inFlight="keep", staging="auto")
    streams = finish(running)

    assert result["status"]["phase"] == "Failed", result["status"]
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.finish_reason == "length" and stream.versions == [0] * MAX_TOKENS
        assert stream.tokens == continuation(OLD_SOURCE, stream.prompt, MAX_TOKENS)
    after = kube_admin.get(f"{refit_e2e.fleets(namespace)}/tiny")
    assert after is not None and after["status"]["weightVersion"] == 0
