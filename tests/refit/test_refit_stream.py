"""A trainer that produces its tensors one at a time (``WeightSender.send(..., shapes=...)``), as a
trainer gathering HF tensors from its TP/PP shards does: each tensor is read only when its bucket
is packed, so the trainer never holds the whole model; anything that does not match the shapes
fails the send before the last bucket, and the engine never serves a partial version. An engine in
this process, the trainer's SDK over gloo."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from helpers import refit_harness as harness

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

PROMPT = [70, 71, 72]
TOKENS = 5


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.InProcessEngine]:
    with harness.serve_in_process(harness.token_file(tmp_path)) as running:
        yield running


class Producer:
    """Yields a fresh copy of each tensor, as a gather would, and records how many of the copies
    it made are still alive each time it is asked for the next one."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.alive_at_most = 0
        self.made = 0

    def __call__(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        copies: list[weakref.ref[torch.Tensor]] = []
        for name in names or list(self.weights):
            gc.collect()
            self.alive_at_most = max(self.alive_at_most, sum(ref() is not None for ref in copies))
            copy = self.weights[name].clone()
            copies.append(weakref.ref(copy))
            self.made += 1
            yield name, copy
            del copy


def shapes_of(weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in weights.items()}


def test_tensors_produced_one_at_a_time_refit_the_engine_without_the_trainer_holding_them_all(
    served: harness.InProcessEngine,
) -> None:
    trainers = [harness.Trainer(f"tiny://llama?seed={seed}") for seed in (91, 92)]
    agent = served.agent
    port, sender = harness.open_sender()
    try:
        for version, trainer in ((1, trainers[0]), (2, trainers[1])):
            weights = trainer.weights()
            produce = Producer(weights)
            assert agent.prepare(version, port=port, world_size=2, rank_offset=1).status_code == 202
            report = sender.send(produce(), bucket_size_mib=1, version=version, shapes=shapes_of(weights))
            assert report.tensors == len(weights) == produce.made > 4
            assert produce.alive_at_most <= 1, "the sender kept tensors it had packed already"
            assert report.manifest_sent == (version == 1)  # the same shapes: the manifest is held
            expected = (trainer.greedy(PROMPT, TOKENS), str(version))
            assert harness.completion_ids(served.frontend_url, PROMPT, TOKENS) == expected
    finally:
        sender.close()


@pytest.mark.parametrize("fault", ["order", "shape", "extra", "short"])
def test_tensors_that_do_not_match_the_shapes_fail_the_send_and_the_engine_serves_nothing_half_written(
    served: harness.InProcessEngine, fault: str
) -> None:
    trainer = harness.Trainer("tiny://llama?seed=93")
    weights = trainer.weights()
    names = list(weights)
    produced: Iterator[tuple[str, torch.Tensor]]
    if fault == "order":
        produced = Producer(weights)([names[1], names[0], *names[2:]])
    elif fault == "shape":
        produced = iter([(name, tensor if i != 2 else tensor[:1]) for i, (name, tensor) in enumerate(weights.items())])
    elif fault == "extra":
        produced = iter([*weights.items(), ("model.extra.weight", torch.zeros(2))])
    else:
        produced = Producer(weights)(names[:-1])
    agent = served.agent
    port, sender = harness.open_sender()
    try:
        assert agent.prepare(1, port=port, world_size=2, rank_offset=1).status_code == 202
        with pytest.raises(
            ValueError,
            match={
                "order": "but the shapes put",
                "shape": "but its shape says",
                "extra": "go on past",
                "short": "ended after",
            }[fault],
        ):
            sender.send(produced, bucket_size_mib=1, version=1, shapes=shapes_of(weights))
    finally:
        sender.close()
    status = agent.wait_finished()
    assert status["phase"] == "failed" and status["state"] == "stale", status
    with httpx.Client(base_url=served.frontend_url, timeout=30) as client:
        answer = client.post("/v1/completions", json={"model": harness.MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert answer.status_code == 503, answer.text  # nothing served from a half-written version
