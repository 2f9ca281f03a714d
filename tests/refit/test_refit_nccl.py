"""The same refit code over NCCL on two GPUs (skipped without two): the trainer's SDK on ``cuda:0`` in
this process, a receiver on ``cuda:1`` in a subprocess (this file run as a script). Broadcast into
whole HF tensors and reshard into a TP=2 megatron shard both land exactly, in place, twice over one
sender (the second version keeps the NCCL group: no communicator is built, and the receiver zeroes
its tensors in between, so the second version is proven written too); and a receiver blocked inside
an NCCL broadcast whose trainer never sends is released by its watchdog's abort.

Self-contained (torch and the refit modules only), so it runs on a bare GPU image with
``pytest --noconftest``. Weights are drawn from a fixed seed on both sides, so the receiver checks
them itself and reports JSON on stdout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megafleet_engine.backends import weight_maps
from megafleet_engine.refit_attempts import phases, sinks, watchdog
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import communicator, errors, receiver, wire
from megafleet_protocol.refit import sender as sdk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

SHAPE = weight_maps.LlamaShape(layers=4, hidden=1024, heads=16, kv_heads=8, intermediate=4096, vocab=32000)
ADDRESS = "127.0.0.1"
TRAINER_DEVICE = "cuda:0"
RECEIVER_DEVICE = "cuda:1"
BUCKET_MIB = 64
STALL_TIMEOUT_SECONDS = 6.0  # covers NCCL start-up; the test checks where the receiver was blocked


def weights(device: str) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors (bfloat16), the same for a given shape everywhere."""
    generator = torch.Generator().manual_seed(1234)
    return {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16).to(device)
        for name, shape in weight_maps.hf_shapes(SHAPE).items()
    }


def _port() -> int:
    with socket.socket() as probe:
        probe.bind((ADDRESS, 0))
        return int(probe.getsockname()[1])


def _spawn(**arguments: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), json.dumps(arguments)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _report(process: subprocess.Popen[str]) -> dict[str, Any]:
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("transport", ["broadcast", "reshard"])
def test_nccl_refit_lands_exactly_and_in_place(transport: vocabulary.Transport) -> None:
    port = _port()
    child = _spawn(mode="receive", port=port, transport=transport, rounds=2)
    try:
        tensors = weights(TRAINER_DEVICE)
        with sdk.WeightSender(
            port, 2, backend="nccl", address=ADDRESS, device=TRAINER_DEVICE, timeout_seconds=120
        ) as s:
            s.init()
            first = s.send(tensors.items(), bucket_size_mib=BUCKET_MIB, version=1, transport=transport)
            report = s.send(tensors.items(), bucket_size_mib=BUCKET_MIB, version=2, transport=transport)
    finally:
        result = _report(child)
    assert result["exact"] == [True, True] and result["inPlace"], result
    assert result["reused"] == [False, True] and (first.reused, report.reused) == (False, True)
    # the second version has the same manifest: the receiver still held it, none was sent
    assert (first.manifest_sent, report.manifest_sent) == (True, False) and result["held"] == [False, True]
    assert result["received"] == report.bytes_sent
    full = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    if transport == "reshard":
        assert report.bytes_sent < 0.6 * full
    sys.stdout.write(
        f"\nNCCL {transport}: {report.bytes_sent / 2**20:.0f} MiB in {report.phases['transfer']:.3f} s "
        f"({report.bytes_sent / report.phases['transfer'] / 1e9:.1f} GB/s), send() {report.seconds:.3f} s, "
        f"receiver phases {result['phases']}\n"
    )


def test_nccl_refit_from_tensors_produced_one_at_a_time_lands_exactly() -> None:
    """``send(..., shapes=...)`` over NCCL: each tensor is a fresh copy made on the current stream
    and dropped once the next is asked for, so the allocator may hand its memory to the next copy
    while the side stream has not packed it yet; the packing must still read the right bytes."""
    port = _port()
    child = _spawn(mode="receive", port=port, transport="broadcast", rounds=2)
    try:
        tensors = weights(TRAINER_DEVICE)
        shapes = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}

        def produced() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors.items():
                yield name, tensor.clone()

        with sdk.WeightSender(
            port, 2, backend="nccl", address=ADDRESS, device=TRAINER_DEVICE, timeout_seconds=120
        ) as s:
            s.init()
            first = s.send(produced(), bucket_size_mib=BUCKET_MIB, version=1, shapes=shapes)
            second = s.send(produced(), bucket_size_mib=BUCKET_MIB, version=2, shapes=shapes)
    finally:
        result = _report(child)
    assert result["exact"] == [True, True] and result["inPlace"], result
    assert (first.manifest_sent, second.manifest_sent) == (True, False)


def test_nccl_watchdog_releases_a_receiver_blocked_in_a_broadcast() -> None:
    """The trainer announces one bucket and never broadcasts it: the receiver's watchdog aborts its
    group, and the blocked wait returns at the deadline instead of hanging."""
    port = _port()
    child = _spawn(mode="stall", port=port, transport="broadcast")
    rendezvous = communicator.Rendezvous(ADDRESS, port, 2)
    comm = communicator.Communicator.connect(
        rendezvous,
        global_rank=0,
        backend="nccl",
        device=torch.device(TRAINER_DEVICE),
        deadline=communicator.Deadline(120),
        local_address=ADDRESS,
    )
    try:
        comm.open_round(1)  # the receiver's hello, the group decision, the group and its handshake
        infos = (wire.TensorInfo("w", (1024, 1024), "bfloat16"),)
        plan = wire.plan_buckets([(wire.Region.whole("w"), 2 * 1024 * 1024)], 2**30)
        comm.set(wire.MANIFEST_KEY, wire.Manifest(1, "broadcast", 2**30, infos, plan).encode())
        comm.get(wire.verdict_key(1), what="the verdict")
        comm.set(wire.GO_KEY, wire.Go(True).encode())
        result = _report(child)  # the bucket is never broadcast
    finally:
        comm.abort()
        comm.close()
    assert result["error"].startswith(("RefitAborted", "RefitTimeout")), result
    # NCCL receives are queued on a stream; the host waits only on the last bucket's arrival
    assert "during the last bucket" in result["error"], "the receiver must have been blocked in the broadcast"
    assert STALL_TIMEOUT_SECONDS - 0.1 <= result["seconds"] <= STALL_TIMEOUT_SECONDS + 1.0, result


# -- the receiver process ------------------------------------------------------------------------------


def _receiver(arguments: dict[str, Any]) -> dict[str, Any]:
    transport: vocabulary.Transport = arguments["transport"]
    device = torch.device(RECEIVER_DEVICE)
    torch.cuda.set_device(device)
    if arguments["mode"] == "stall":
        live = {"w": torch.zeros(1024, 1024, dtype=torch.bfloat16, device=device)}
        sink: receiver.Sink = sinks.NamedSink(live)
        expected: dict[str, torch.Tensor] = {}
    elif transport == "broadcast":
        expected = weights(RECEIVER_DEVICE)
        live = {name: torch.zeros_like(tensor) for name, tensor in expected.items()}
        sink = sinks.NamedSink(live)
    else:
        layout = weight_maps.Layout(tp_rank=0, tp_size=2)
        expected = weight_maps.hf_to_megatron(weights(RECEIVER_DEVICE), SHAPE, layout=layout)
        specs = weight_maps.shard_map(SHAPE, layout)
        live = {name: torch.zeros_like(expected[name]) for name in specs}
        sink = sinks.ShardSink(live, specs, weight_maps.hf_shapes(SHAPE))
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    timeout = STALL_TIMEOUT_SECONDS if arguments["mode"] == "stall" else 120.0
    deadline = communicator.Deadline(timeout)
    comm = communicator.Communicator.connect(
        communicator.Rendezvous(ADDRESS, int(arguments["port"]), 2),
        global_rank=1,
        backend="nccl",
        device=device,
        deadline=deadline,
        local_address=ADDRESS,
    )
    guard = watchdog.Watchdog(timeout, comm.abort)
    started = time.monotonic()
    guard.start()
    exact: list[bool] = []
    reused: list[bool] = []
    held: list[bool] = []
    accepted: receiver.Accepted | None = None
    try:
        for version in range(1, int(arguments.get("rounds", 1)) + 1):
            record = phases.Progress(version=version, source="rendezvous")
            received = receiver.receive(
                comm,
                sink,
                version=version,
                transport=transport,
                bucket_limit_bytes=2**30,
                apply=lambda write: write(),
                record=record,
                accepted=accepted,
            )
            held.append(accepted is not None and comm.held_manifest == accepted.id)
            accepted = received.accepted
            torch.cuda.synchronize(device)
            comm.set(wire.done_key(1), wire.Done(ok=True, bytes_received=received.nbytes).encode())
            exact.append(all(torch.equal(live[name], tensor) for name, tensor in expected.items()))
            reused.append(record.snapshot().reused)
            for tensor in live.values():
                tensor.zero_()  # the next version must write every byte again
            if isinstance(sink, sinks.NamedSink):
                sink = sinks.NamedSink(live)  # a fresh record of what was written
            else:
                sink = sinks.ShardSink(live, specs, weight_maps.hf_shapes(SHAPE))
    except errors.RefitError as error:
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
    finally:
        guard.stop()
        comm.close()
    return {
        "received": received.nbytes,
        "held": held,
        "exact": exact,
        "reused": reused,
        "inPlace": all(live[name].data_ptr() == pointer for name, pointer in pointers.items()),
        "phases": {name: round(seconds, 4) for name, seconds in record.snapshot().phases},
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_receiver(json.loads(sys.argv[1]))) + "\n")
