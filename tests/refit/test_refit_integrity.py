"""Verified buckets over gloo: the trainer's SDK seals every bucket with its ``mf64`` digest when every
receiver asks for it, and every receiver checks each bucket as it lands
(:mod:`megafleet_protocol.refit.trailers`); NeMo's wire, which carries no digest, gets per-bucket
digests that the members compare and a non-finite count per tensor (:mod:`megafleet_protocol.refit.nemo_checks`).

Real engine processes (``python -m megafleet_engine.cli``, a tiny Llama of seven 1 MiB buckets) take
the refits the operator starts with ``integrity: checksum``; a receiver older than digests is played
in this process (its hello has no ``checksums``); NeMo's trainer is the independent one of
:mod:`helpers.nemo_trainer`.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from helpers import nemo_trainer
from helpers import refit_harness as harness
from megafleet_engine.refit_attempts import phases, sinks
from megafleet_protocol.refit import (
    communicator,
    digest,
    errors,
    nemo,
    receiver,
    round_messages,
    verification,
    wire,
)
from megafleet_protocol.refit import sender as sdk

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

SOURCE = "tiny://llama?hidden=256&heads=4&kv_heads=2&intermediate=512"  # 5 MiB: seven buckets of 1 MiB
PROMPT = [40, 41, 42, 43]
TOKENS = 5
OLD_RECEIVER_ADDRESS = "127.0.15.9"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    running = [harness.EngineProcess(f"127.0.15.{index}", token, source=SOURCE) for index in (1, 2)]
    try:
        for engine in running:
            engine.wait_serving()
        yield running
    finally:
        for engine in running:
            engine.close()


def trainer(seed: int) -> harness.Trainer:
    return harness.Trainer(f"{SOURCE}&seed={seed}")


def prepare(
    engines: list[harness.EngineProcess], sender: sdk.WeightSender, version: int, integrity: str, first: int = 1
) -> None:
    """Every engine joins the sender's rendezvous at rank offsets ``first``, ``first + 1``, ..."""
    port, world_size = sender.rendezvous.port, sender.rendezvous.world_size
    for offset, engine in enumerate(engines, start=first):
        accepted = engine.agent.prepare(
            version, port=port, world_size=world_size, rank_offset=offset, integrity=integrity
        )
        assert accepted.status_code == 202, accepted.text


def serves(engines: list[harness.EngineProcess], model: harness.Trainer, version: int) -> bool:
    expected = (model.greedy(PROMPT, TOKENS), str(version))
    return all(harness.completion_ids(engine.frontend_url, PROMPT, TOKENS) == expected for engine in engines)


def open_sender(world_size: int, corrupt_bucket: int | None = None) -> sdk.WeightSender:
    sender = sdk.WeightSender(
        harness.free_port(),
        world_size,
        address=harness.TRAINER_ADDRESS,
        timeout_seconds=60,
        corrupt_bucket=corrupt_bucket,
    )
    sender.init()
    return sender


def first_tensor(weights: dict[str, torch.Tensor], bucket: int) -> str:
    """The first tensor of ``bucket`` in the broadcast plan of sealed 1 MiB buckets."""
    infos = [wire.TensorInfo.of(name, tensor) for name, tensor in weights.items()]
    plan = wire.plan_buckets(
        ((wire.Region.whole(i.name), wire.Region.whole(i.name).nbytes(i)) for i in infos), 2**20, sealed=True
    )
    return plan.in_bucket(bucket)[0].region.name


def test_every_receiver_verifies_every_bucket_and_a_held_manifest_stays_sealed(
    engines: list[harness.EngineProcess],
) -> None:
    models = [trainer(seed) for seed in (51, 52, 53)]
    sender = open_sender(3)
    try:
        for version, integrity in ((1, "checksum"), (2, "checksum"), (3, "none")):
            prepare(engines, sender, version, integrity)
            report = sender.send(models[version - 1].weights().items(), bucket_size_mib=1, version=version)
            statuses = [engine.agent.wait_finished() for engine in engines]
            assert [s["phase"] for s in statuses] == ["succeeded"] * 2, statuses
            assert serves(engines, models[version - 1], version)
            assert all(s["bytesReceived"] == report.bytes_sent for s in statuses)
            if integrity == "checksum":
                assert report.verified and report.buckets == 7, report
                assert report.manifest_sent == (version == 1), "the same sealed manifest is held, not resent"
                expected = {"integrity": "checksum", "method": "trainerDigest", "buckets": 7, "mismatch": None}
            else:  # the held manifest is sealed, these receivers ask for none: a new, bare one is exchanged
                assert not report.verified and report.manifest_sent, report
                expected = {"integrity": "none", "method": "none", "buckets": 0, "mismatch": None}
            for status in statuses:
                assert status["verification"] == {**expected, "bucketDigests": [], "nonFinite": None}, status
    finally:
        sender.close()


def test_a_flipped_byte_fails_every_receiver_naming_the_bucket_and_its_first_tensor(
    engines: list[harness.EngineProcess],
) -> None:
    model = trainer(61)
    weights = model.weights()
    named = first_tensor(weights, 2)
    assert named == "model.layers.0.mlp.up_proj.weight"
    sender = open_sender(3, corrupt_bucket=2)  # test only: bucket 2's first byte flips after its digest
    try:
        prepare(engines, sender, 11, "checksum")
        with pytest.raises(errors.ReceiverFailed) as failed:
            sender.send(weights.items(), bucket_size_mib=1, version=11)
    finally:
        sender.close()
    assert sorted(failed.value.reasons) == [1, 2], failed.value
    for reason in failed.value.reasons.values():
        assert f"bucket 2 (of 7, counted from 0; first tensor {named}) does not match the trainer's mf64" in reason
    for engine in engines:
        status = engine.agent.wait_finished()
        assert status["phase"] == "failed" and status["state"] == "stale" and status["dirty"], status
        assert "bucket 2" in status["error"] and named in status["error"]
        verification = status["verification"]
        assert verification["method"] == "trainerDigest" and verification["buckets"] == 7
        assert verification["mismatch"] == {"bucket": 2, "firstTensor": named}

    repaired = open_sender(3)  # a complete, verified refit brings both back
    try:
        prepare(engines, repaired, 12, "checksum")
        assert repaired.send(weights.items(), bucket_size_mib=1, version=12).verified
    finally:
        repaired.close()
    assert [engine.agent.wait_finished()["phase"] for engine in engines] == ["succeeded"] * 2
    assert serves(engines, model, 12)


class OldReceiver:
    """A receiver older than digests, on a thread of this process: its hello carries no ``checksums``
    (the test patches :class:`round_messages.Hello`'s encoding; the engines are other processes), it
    receives into zeros and tells the trainer its outcome as an engine does."""

    def __init__(self, sender: sdk.WeightSender, rank: int, version: int, shapes: dict[str, torch.Size]) -> None:
        self.live = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self.error: str | None = None
        rendezvous = communicator.Rendezvous(
            harness.TRAINER_ADDRESS, sender.rendezvous.port, sender.rendezvous.world_size
        )
        self._thread = threading.Thread(target=self._run, args=(rendezvous, rank, version), daemon=True)
        self._thread.start()

    def _run(self, rendezvous: communicator.Rendezvous, rank: int, version: int) -> None:
        comm = communicator.Communicator.connect(
            rendezvous,
            global_rank=rank,
            backend="gloo",
            device=torch.device("cpu"),
            deadline=communicator.Deadline(60),
            local_address=OLD_RECEIVER_ADDRESS,
        )
        try:
            received = receiver.receive(
                comm,
                sinks.NamedSink(self.live),
                version=version,
                transport="broadcast",
                bucket_limit_bytes=2**20,
                apply=lambda write: write(),
                record=phases.Progress(version=version, source="rendezvous"),
            )
            comm.set(wire.done_key(comm.group_rank), wire.Done(ok=True, bytes_received=received.nbytes).encode())
        except errors.RefitError as error:
            self.error = str(error)
        finally:
            comm.close()

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive()


def test_a_receiver_older_than_digests_interoperates_and_one_that_requires_them_says_why_not(
    engines: list[harness.EngineProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    def old_encoding(hello: round_messages.Hello) -> str:
        return json.dumps({"session": hello.session, "group": hello.group, "manifest": hello.manifest})

    monkeypatch.setattr(round_messages.Hello, "encode", old_encoding)
    model = trainer(71)
    weights = model.weights()
    shapes = {name: tensor.shape for name, tensor in weights.items()}

    sender = open_sender(3)
    try:  # an engine that asks for nothing and the old receiver: unsealed buckets, both take them
        prepare(engines[:1], sender, 21, "none")
        old = OldReceiver(sender, 2, 21, shapes)
        report = sender.send(weights.items(), bucket_size_mib=1, version=21)
        old.join()
    finally:
        sender.close()
    assert not report.verified and old.error is None
    assert all(torch.equal(old.live[name], tensor) for name, tensor in weights.items())
    status = engines[0].agent.wait_finished()
    assert status["phase"] == "succeeded" and status["verification"]["method"] == "none", status

    sender = open_sender(3)
    try:  # an engine that requires digests next to the old receiver: refused before any byte moves
        prepare(engines[:1], sender, 22, "checksum")
        old = OldReceiver(sender, 2, 22, shapes)
        with pytest.raises(errors.RefitRejected) as rejected:
            sender.send(weights.items(), bucket_size_mib=1, version=22)
        old.join()
    finally:
        sender.close()
    assert list(rejected.value.reasons) == [1]
    assert "asks for integrity checksum, but the trainer's buckets carry no digest" in rejected.value.reasons[1]
    assert old.error is not None and "cancelled" in old.error
    status = engines[0].agent.wait_finished()
    assert status["phase"] == "failed" and not status["dirty"] and status["bytesReceived"] == 0, status
    assert "carry no digest" in status["error"]


# -- NeMo's collective: digests for the members' agreement, non-finite values named ------------------


def nemo_weights(poisoned: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(17)
    weights = {
        "embed.weight": torch.randn(7, 9, generator=generator).to(torch.bfloat16),
        "norm.weight": torch.randn(33, generator=generator),
        "odd.bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=generator),  # misaligns the rest
        "layer.0.weight": torch.randn(40, 10, generator=generator),
        "layer.1.weight": torch.randn(30, 10, generator=generator),
    }
    if poisoned:
        weights["layer.1.weight"][3, 4] = float("nan")
        weights["layer.1.weight"][5, 1] = float("inf")
    return weights


def test_nemo_receivers_digests_agree_and_name_a_non_finite_tensor() -> None:
    clean, poisoned = nemo_weights(), nemo_weights(poisoned=True)
    specs = nemo.refit_info({name: (tensor.shape, tensor.dtype) for name, tensor in clean.items()})
    target = 1000
    port = harness.free_port()
    outcomes: dict[int, list[verification.Verification | errors.NonFiniteWeights]] = {1: [], 2: []}

    def fleet_rank(rank: int) -> None:
        deadline = communicator.Deadline(30)
        world = nemo.NemoWorld(nemo_trainer.ADDRESS, port, 3, rank, 1)
        joined = nemo.NemoReceiver.connect(
            world, backend="gloo", device=torch.device("cpu"), deadline=deadline, local_address=nemo_trainer.ADDRESS,
            gloo_prefix=nemo_trainer.GLOO_PREFIX,
        )  # fmt: skip
        try:
            for _ in range(2):
                try:
                    stats = joined.receive(
                        specs, bucket_bytes=target, device=torch.device("cpu"), write=len, deadline=deadline,
                        integrity="checksum",
                    )  # fmt: skip
                    assert stats.verification is not None
                    outcomes[rank].append(stats.verification)
                except errors.NonFiniteWeights as error:
                    outcomes[rank].append(error)
        finally:
            joined.close()

    trainer_rank = functools.partial(
        nemo_trainer.trainer_rank, 0, port=port, world_size=3, tensors=list(clean.values()), target=target,
        generation="nemo", unique_id=os.urandom(128), sent=[], later=[list(poisoned.values())],
    )  # fmt: skip
    with nemo_trainer.running(
        trainer_rank, functools.partial(fleet_rank, 1), functools.partial(fleet_rank, 2)
    ) as failures:
        pass
    assert not failures, failures

    buckets = nemo.plan_buckets(specs, target)
    assert len(buckets) == 2
    for rank in (1, 2):
        first, second = outcomes[rank]
        assert first.method == "agreement" and first.buckets == 2 and first.non_finite is None, first  # type: ignore[union-attr]
        expected = []
        for index, bucket in enumerate(buckets):
            raw = b"".join(
                clean[spec.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for spec in bucket
            )
            expected.append(digest.hex_digest(digest.reference(raw, index)))
        assert list(first.bucket_digests) == expected  # type: ignore[union-attr]
        assert isinstance(second, errors.NonFiniteWeights), second
        assert (second.tensor, second.count, second.bucket) == ("layer.1.weight", 2, 1)
        assert "layer.1.weight (bucket 1, counted from 0) holds 2 non-finite values" in str(second)
        assert second.outcome is not None and second.outcome.non_finite == "layer.1.weight"
    assert outcomes[1][0] == outcomes[2][0], "two members of one broadcast agree"
    agreed = [outcome.outcome.bucket_digests for outcome in (outcomes[1][1], outcomes[2][1])]  # type: ignore[union-attr]
    assert agreed[0] == agreed[1] and agreed[0][0] == outcomes[1][0].bucket_digests[0]  # type: ignore[union-attr]
    assert agreed[0][1] != outcomes[1][0].bucket_digests[1]  # type: ignore[union-attr]
