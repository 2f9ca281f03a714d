"""Megatron-layout receivers over gloo, three processes: the trainer (this process, HF layout, the SDK)
and two TP=2 receivers (subprocesses holding only their megatron shards). With ``reshard`` each rank
receives exactly the slices its shard map names, about half the model each; with ``broadcast`` each
receives everything and keeps its slices. Either way every rank ends with exactly what
``hf_to_megatron`` gives for its TP rank, written in place. (The megatron backend itself needs GPUs;
this checks the receiver, the shard map and the wire protocol it uses.) With ``integrity: checksum``
the reshard plans are sealed too, and each receiver checks every trailer of its own plan."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import refit_harness as harness
from megafleet_engine.backends import weight_maps
from megafleet_protocol import vocabulary

pytestmark = pytest.mark.slow  # each test starts engines, a process group, Ray or a subprocess

TP = 2
RECEIVER = Path(__file__).resolve().parent / "test_refit_shard_receiver.py"  # run as a script per rank


@pytest.mark.parametrize(
    ("transport", "integrity"), [("reshard", "none"), ("broadcast", "none"), ("reshard", "checksum")]
)
def test_tp2_megatron_receivers_get_exactly_their_slices(
    transport: vocabulary.Transport, integrity: vocabulary.Integrity, tmp_path: Path
) -> None:
    trainer = harness.Trainer()
    weights = trainer.weights()
    shape = harness.tiny_shape()
    port = harness.free_port()
    world_size = 1 + TP
    receivers = [
        subprocess.Popen(
            [sys.executable, str(RECEIVER), json.dumps(arguments)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arguments in (
            {
                "shape": dataclasses.asdict(shape),
                "address": harness.TRAINER_ADDRESS,
                "port": port,
                "world_size": world_size,
                "global_rank": 1 + tp_rank,
                "tp_rank": tp_rank,
                "tp_size": TP,
                "transport": transport,
                "integrity": integrity,
                "out": str(tmp_path / f"rank{tp_rank}.pt"),
            }
            for tp_rank in range(TP)
        )
    ]
    try:
        report = trainer.send_in_background(port, world_size, version=1, transport=transport).result(timeout=120)
        outputs = [receiver.communicate(timeout=120) for receiver in receivers]
    finally:
        for receiver in receivers:
            if receiver.poll() is None:
                receiver.kill()
                receiver.communicate()
    for receiver, (_, stderr) in zip(receivers, outputs, strict=True):
        assert receiver.returncode == 0, stderr

    full_model = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    received, needed = [], []
    for tp_rank, (stdout, _) in enumerate(outputs):
        result = json.loads(stdout.strip().splitlines()[-1])
        assert result["inPlace"], "the receiver rebound a tensor"
        assert result["verified"] == ("trainerDigest" if integrity == "checksum" else "none")
        assert (result["bucketsVerified"] > 0) == (integrity == "checksum")
        received.append(result["received"])
        needed.append(result["needed"])
        got = torch.load(tmp_path / f"rank{tp_rank}.pt")
        expected = weight_maps.hf_to_megatron(weights, shape, tp_rank, TP)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), f"rank {tp_rank}: {name}"

    assert report is not None and report.receivers == TP and report.verified == (integrity == "checksum")
    if transport == "reshard":
        for rank in range(TP):  # the slices its shard map names, plus alignment padding, nothing more
            assert needed[rank] <= received[rank] < needed[rank] + 256 * 64
            assert received[rank] < 0.6 * full_model
        assert report.bytes_sent == sum(received)
    else:
        assert received == [report.bytes_sent] * TP and report.bytes_sent >= full_model
