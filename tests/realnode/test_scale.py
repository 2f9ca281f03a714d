"""Scaling the tiny fleet on the real node: up adds a shard that serves, down drains the removed
shard, and requests streaming from it when the scale-down is asked for all finish whole (the
operator's drain through the agent, then its pod and its port on the frontends Service go)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import real_node_fleet
from megafleet_dev import kube, realnode

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
WAIT = 240
# Short enough to end well inside the operator's drain timeout (30 s, after which the pod goes
# anyway): on two shared cores four streams of 200 tokens took 42 s.
STREAMS = 2
MAX_TOKENS = 64


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def is_ready(obj: dict[str, Any] | None) -> bool:
    return (kube.condition(obj, "Ready") or {}).get("status") == "True"


class Stream(threading.Thread):
    """One streamed greedy completion; records when each chunk arrived and how it finished."""

    def __init__(self, url: str, started: threading.Semaphore) -> None:
        super().__init__(daemon=True)
        self.url, self.started = url, started
        self.arrivals: list[float] = []
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "hello",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with (
                httpx.Client(timeout=WAIT) as client,
                client.stream("POST", f"{self.url}/completions", json=body) as response,
            ):
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    self.arrivals.append(time.monotonic())
                    if len(self.arrivals) == 1:
                        self.started.release()
                    for choice in chunk.get("choices") or []:
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
        except BaseException as error:  # reported by the test, in its thread
            self.error = error
            self.started.release()


def test_scaling_up_serves_and_scaling_down_drains_without_failing_a_request(
    operator: Path, kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace = kube_admin.create_namespace("t")
    kube_admin.patch(
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    try:
        manifest = real_node_fleet.tiny(replicas=1)
        kube_admin.create(fleets(namespace), manifest)
        path = f"{fleets(namespace)}/tiny"
        assert kube_admin.wait(path, is_ready, timeout=WAIT, what="1 shard Ready") is not None

        kube_admin.patch(f"{path}/scale", {"spec": {"replicas": 2}})
        grown = kube_admin.wait(
            path,
            lambda o: is_ready(o) and (o or {}).get("status", {}).get("readyReplicas") == 2,
            timeout=WAIT,
            what="2 shards Ready",
        )
        assert grown is not None and len(grown["status"]["endpoints"]) == 2
        removed = grown["status"]["shards"][1]["pods"][0]
        pod = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{removed}")
        assert pod is not None and pod["spec"]["nodeName"] == realnode.NODE_NAME
        url = f"http://{pod['status']['podIP']}:8000/v1"

        # Streams in flight on the shard a scale-down removes (the highest index) ...
        started = threading.Semaphore(0)
        streams = [Stream(url, started) for _ in range(STREAMS)]
        for stream in streams:
            stream.start()
        for _ in streams:
            assert started.acquire(timeout=WAIT)
        assert [stream.error for stream in streams] == [None] * STREAMS
        asked = time.monotonic()
        kube_admin.patch(f"{path}/scale", {"spec": {"replicas": 1}})
        for stream in streams:
            stream.join(timeout=WAIT)
            assert not stream.is_alive()
        # ... every one finishes whole; the engine may run them one after another, so it is enough
        # that some were still streaming when the scale-down was asked.
        timings = [(round(s.arrivals[0] - asked, 2), round(s.arrivals[-1] - asked, 2)) for s in streams]
        assert [stream.error for stream in streams] == [None] * STREAMS, timings
        assert [(s.finish_reason, s.completion_tokens) for s in streams] == [("length", MAX_TOKENS)] * STREAMS
        assert any(stream.arrivals[-1] > asked for stream in streams), timings

        shrunk = kube_admin.wait(
            path,
            lambda o: is_ready(o) and len((o or {}).get("status", {}).get("shards", [])) == 1,
            timeout=WAIT,
            what="back to 1 shard",
        )
        assert shrunk is not None and len(shrunk["status"]["endpoints"]) == 1
        kube_admin.wait_items(
            f"/api/v1/namespaces/{namespace}/pods",
            lambda items: [item["metadata"]["name"] for item in items] == [grown["status"]["shards"][0]["pods"][0]],
            timeout=WAIT,
            what="the removed shard's pod gone",
        )
        frontends = kube_admin.get(f"/api/v1/namespaces/{namespace}/services/tiny-f0") or {}
        assert [port["name"] for port in frontends["spec"]["ports"]] == ["shard-0"]  # the removed shard's port went
        events = kube_admin.list(f"/api/v1/namespaces/{namespace}/events")["items"]
        assert any(event.get("reason") == "ShardRemoved" for event in events)
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
