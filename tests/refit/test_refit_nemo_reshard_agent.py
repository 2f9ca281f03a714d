"""NeMo RL's M-to-N reshard into real engine processes through the agent's routes, as the operator
drives them: a NeMo-style trainer of 2 pipeline stages x 2 TP ranks (:mod:`helpers.nemo_reshard_trainer`,
written from NeMo's contract) reshards into two engines (``python -m megafleet_engine.cli``, one rank
each: two replicas of the whole model). Each engine joins NeMo's world (``/v1/refit/nemo/join``), then
every stage's communicator beside it (``/v1/refit/nemo/reshard/join``), then refits version after version
over them (``/v1/refit/nemo/reshard``): each takes in only its stripe of every FFN projection from the
stages' trainer ranks, gets the rest from its replica, then the misc tensors over NeMo's broadcast, and
serves the trainer's weights. A refit info planned for another inference layout is refused before
anything is suspended; a refit without the stages is refused (409 ``nemo_not_joined``).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from helpers import nemo_reshard_trainer as trainer
from helpers import nemo_trainer
from helpers import refit_harness as harness

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

LAYOUT = trainer.Layout(pp=2, tp=2, gen_ranks=2, gen_tp=1, layers=2)  # the tiny Llama's 2 layers
PROMPT = [50, 51, 52, 53]
TOKENS = 6
BUCKET = 16 * 1024  # the misc tensors in several of NeMo's buckets
SESSION = "reshard-session-uid"
WAIT_SECONDS = 60.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    running = [harness.EngineProcess(f"127.0.21.{index}", token) for index in (1, 2)]
    try:
        for engine in running:
            engine.wait_serving()
        yield running
    finally:
        for engine in running:
            engine.close()


class Trainer:
    """The trainer's ranks on threads: NeMo's world, then each stage's communicator, then each refit
    handed to :meth:`send` (until :meth:`finish`)."""

    def __init__(self) -> None:
        self.ports = trainer.Ports(harness.free_port(), tuple(harness.free_port() for _ in range(LAYOUT.pp)))
        self.sent: list[tuple[int, str, int]] = []
        self._queues: list[queue.Queue[Mapping[str, torch.Tensor] | None]] = [
            queue.Queue() for _ in range(LAYOUT.train_ranks)
        ]
        ranks = [
            functools.partial(
                trainer.train_rank,
                rank,
                layout=LAYOUT,
                ports=self.ports,
                refits=iter(functools.partial(self._queues[rank].get, timeout=WAIT_SECONDS), None),
                bucket_bytes=BUCKET,
                sent=self.sent,
                misc_prefix=nemo_trainer.AGENT_GLOO_PREFIX,
            )
            for rank in range(LAYOUT.train_ranks)
        ]
        self._running = nemo_trainer.running(*ranks, timeout=WAIT_SECONDS)
        self.failures = self._running.__enter__()

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        for pending in self._queues:
            pending.put(weights)

    def finish(self) -> list[BaseException]:
        """End every rank; what they raised."""
        for pending in self._queues:
            pending.put(None)
        self._running.__exit__(None, None, None)
        return self.failures


def join_bodies(ranks: Trainer, index: int, session: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the operator sends shard ``index`` (its prefix among the inference ranks is ``index``)."""
    world = {
        "session": session,
        "rendezvous": {
            "address": harness.TRAINER_ADDRESS,
            "port": ranks.ports.misc,
            "worldSize": LAYOUT.train_ranks + LAYOUT.gen_ranks,
            "rankOffset": LAYOUT.train_ranks + index,
            "trainerWorldSize": LAYOUT.train_ranks,
        },
        "timeoutSeconds": 60,
    }
    stages = {
        "session": session,
        "stages": [{"address": harness.TRAINER_ADDRESS, "port": port} for port in ranks.ports.stages],
        "trainerRanksPerStage": LAYOUT.tp,
        "subWorldSize": LAYOUT.tp + LAYOUT.gen_ranks,
        "rankOffset": LAYOUT.tp + index,
        "timeoutSeconds": 60,
    }
    return world, stages


def refit_body(
    version: int, weights: Mapping[str, torch.Tensor], layout: trainer.Layout = LAYOUT, session: str = SESSION
) -> dict[str, Any]:
    return {
        "version": version,
        "timeoutSeconds": 60,
        "session": session,
        "refitInfo": trainer.refit_info(weights, layout),
        "bucketBytes": BUCKET,
    }


def post(engine: harness.EngineProcess, path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    with engine.agent.client() as agent:
        response = agent.post(path, json=body)
    return response.status_code, response.json()


def wait_joined(engine: harness.EngineProcess, part: str | None = None) -> dict[str, Any]:
    """The engine's ``world`` once it (or its ``part``, e.g. ``reshard``) is joined."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        world = engine.agent.status()["world"] or {}
        phase = (world.get(part) or {} if part else world).get("phase")
        if phase == "joined":
            return world
        assert phase in (None, "joining"), world
        assert time.monotonic() < deadline, f"not joined: {world}"
        time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def join(engines: list[harness.EngineProcess], ranks: Trainer, session: str = SESSION) -> None:
    """The operator's order: every member joins NeMo's world, then (once all did) the stages."""
    bodies = [join_bodies(ranks, index, session) for index in range(len(engines))]
    for engine, (world, _) in zip(engines, bodies, strict=True):
        code, answer = post(engine, "/v1/refit/nemo/join", world)
        assert code == 202, answer
    for engine in engines:
        wait_joined(engine)
    for engine, (_, stages) in zip(engines, bodies, strict=True):
        code, answer = post(engine, "/v1/refit/nemo/reshard/join", stages)
        assert code == 202 and answer["reshard"]["phase"] in ("joining", "joined"), answer
    for index, engine in enumerate(engines):
        joined = wait_joined(engine, "reshard")
        assert joined["reshard"] == {"phase": "joined", "stages": 2, "rank": LAYOUT.tp + index, "error": None}


def refit(
    engines: list[harness.EngineProcess], ranks: Trainer, version: int, weights: Mapping[str, torch.Tensor]
) -> list[dict[str, Any]]:
    for engine in engines:
        code, answer = post(engine, "/v1/refit/nemo/reshard", refit_body(version, weights))
        assert code == 202, answer
        assert (answer["source"], answer["transport"]) == ("nemo", "reshard")
    ranks.send(weights)
    return [engine.agent.wait_finished(WAIT_SECONDS) for engine in engines]


def bulk_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for name, t in weights.items() if name.endswith(trainer.BULK_SUFFIXES))


def test_two_stages_reshard_into_two_engines_refit_after_refit_each_taking_in_only_its_stripe(
    engines: list[harness.EngineProcess],
) -> None:
    policy = harness.Trainer()
    new = policy.weights()
    old = harness.tiny_backend().parameters()
    old = {name: old[name].detach().clone() for name in new}  # the trainer's order
    before = harness.completion_ids(engines[0].frontend_url, PROMPT, TOKENS)
    assert before[0] != policy.greedy(PROMPT, TOKENS), "the trainer's weights must change the output"

    code, refused = post(engines[0], "/v1/refit/nemo/reshard", refit_body(5, new))
    assert (code, refused["error"]["code"]) == (409, "nemo_not_joined")
    ranks = Trainer()
    code, refused = post(engines[0], "/v1/refit/nemo/reshard/join", join_bodies(ranks, 0, SESSION)[1])
    assert (code, refused["error"]["code"]) == (409, "nemo_not_joined"), "NeMo joins its world before the stages"
    try:
        join(engines, ranks)
        code, refused = post(engines[0], "/v1/refit/nemo/reshard", refit_body(5, new) | {"integrity": "checksum"})
        assert (code, refused["error"]["code"]) == (409, "refit_mode_unsupported"), "the bulk carries no digest"
        total = sum(t.numel() * t.element_size() for t in new.values())
        for version, weights, output in ((5, new, policy.greedy(PROMPT, TOKENS)), (6, old, before[0])):
            finished = refit(engines, ranks, version, weights)
            for status in finished:
                assert status["phase"] == "succeeded" and status["reused"], status
                # its stripe of every bulk tensor (the other half comes from its replica), all the misc ones
                assert status["bytesReceived"] == total - bulk_bytes(weights) // 2, status
            served = [harness.completion_ids(engine.frontend_url, PROMPT, TOKENS) for engine in engines]
            assert served == [(output, str(version))] * 2

        # planned for TP 2 inference ranks: each engine would keep half of what it holds. Refused before
        # anything is suspended; the trainer cannot hear it, so the session's communicators are dropped
        code, refused = post(engines[0], "/v1/refit/nemo/reshard", refit_body(7, new, trainer.Layout(2, 2, 2, 2, 2)))
        assert code == 400 and "another inference layout" in refused["error"]["message"], refused
        state, world = engines[0].agent.state(), engines[0].agent.status()["world"]
        assert (state["state"], state["weightVersion"]) == ("ready", 6)
        assert (world["phase"], world["reshard"]["phase"]) == ("left", "left"), world
    finally:
        failures = ranks.finish()
    assert not failures, failures
    assert sum(count for _, _, count in ranks.sent) == bulk_bytes(new) + bulk_bytes(old)  # each piece sent once


def test_a_new_session_over_the_same_engines_joins_new_stages_and_reshards(
    engines: list[harness.EngineProcess],
) -> None:
    """NeMo's rebuild: a new world and new stage communicators over the same engines (the old ones
    are left); the trainer's weights serve on both."""
    policy = harness.Trainer()
    weights = policy.weights()
    ranks = Trainer()
    try:
        join(engines, ranks, "rebuilt-session-uid")
        for engine in engines:
            code, answer = post(engine, "/v1/refit/nemo/reshard", refit_body(7, weights, session="rebuilt-session-uid"))
            assert code == 202, answer
        ranks.send(weights)
        assert [engine.agent.wait_finished(WAIT_SECONDS)["phase"] for engine in engines] == ["succeeded"] * 2
        expected = (policy.greedy(PROMPT, TOKENS), "7")
        assert [harness.completion_ids(engine.frontend_url, PROMPT, TOKENS) for engine in engines] == [expected] * 2
    finally:
        failures = ranks.finish()
    assert not failures, failures
