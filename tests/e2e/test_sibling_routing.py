"""Sibling-aware routing against the real control plane, the operator and the tiny CPU fleet's two
engine pods: the SDK sends the samples of one prompt to one shard, whose engine prefills them once
(its Prometheus ``megafleet_prefix_cache_hit_tokens_total`` grows by the siblings' prompts, the other
engine's not at all); a mixed batch spreads over both shards with each prompt's samples together; a
conversation's next turn goes to the shard of its first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import refit_e2e
from megafleet.sdk import fleet, generation
from megafleet_dev import kube
from megafleet_protocol import ports

pytestmark = pytest.mark.timeout(900)  # READY_WAIT plus the three batches

PODS = ("tiny-s0-p0", "tiny-s1-p0")
SAMPLES = 8
READY_WAIT = 600  # two engine pods starting on a loaded 2-core machine took over 120 s
PROMPT = [1, *range(100, 180)]  # 81 tokens: one whole 64-token block for the next turn to find
MIXED = [[1, *range(20 + 25 * index, 45 + 25 * index)] for index in range(8)]  # the tiny vocabulary: 263 ids
GREEDY = generation.Sampling(max_tokens=6, temperature=0, logprobs=False, text=False)


def hit_tokens(kube_admin: kube.Kube, namespace: str) -> list[float]:
    """Each engine's prompt tokens served from a sibling's prefill (its Prometheus metrics on the pod IP)."""
    found = []
    for pod in PODS:
        status = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        assert status is not None
        text = httpx.get(f"http://{status['status']['podIP']}:{ports.METRICS_PORT}/metrics", timeout=30).text
        found.append(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "megafleet_prefix_cache_hit_tokens_total"
            )
        )
    return found


def test_siblings_share_a_shard_and_its_prefill_while_a_mixed_batch_spreads(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path
) -> None:
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet())

    async def scenario() -> tuple[list[generation.Answer], list[float], list[generation.Answer], generation.Answer]:
        async with fleet.Fleet("tiny", namespace, kubeconfig=kubeconfig, addressing="pod") as client:
            await client.wait_ready(timeout=READY_WAIT)
            before = hit_tokens(kube_admin, namespace)
            siblings = await client.complete_batch([PROMPT] * SAMPLES, GREEDY)
            after = hit_tokens(kube_admin, namespace)
            mixed = await client.complete_batch([prompt for prompt in MIXED for _ in range(2)], GREEDY)
            turn = await client.complete([*PROMPT, *siblings[0].token_ids, 7, 8, 9], GREEDY)
            return siblings, [now - then for now, then in zip(after, before, strict=True)], mixed, turn

    siblings, hits, mixed, turn = asyncio.run(scenario())
    shard = siblings[0].shard
    assert {answer.shard for answer in siblings} == {shard}
    assert len({tuple(answer.token_ids) for answer in siblings}) == 1  # greedy: one prefill, equal answers
    assert hits[shard] == (SAMPLES - 1) * len(PROMPT) and hits[1 - shard] == 0, hits
    assert {answer.shard for answer in mixed} == {0, 1}
    for index in range(len(MIXED)):
        assert mixed[2 * index].shard == mixed[2 * index + 1].shard, index
    assert turn.shard == shard  # the conversation's next turn follows its first
