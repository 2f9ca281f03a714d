"""Unit tests of the refit pieces that need no network: bucket layout, messages, manifest checks, the
sinks' view of the shard map, rank arithmetic, the watchdog and the attempt record; and that the
trainer SDK imports without kopf."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from helpers import refit_harness as harness
from megafleet_engine.backends import weight_maps
from megafleet_engine.refit_attempts import phases, sinks, watchdog
from megafleet_protocol import ports
from megafleet_protocol.refit import communicator, receiver, wire
from megafleet_protocol.refit import sender as sdk


def _sized(*sizes: int) -> list[tuple[wire.Region, int]]:
    return [(wire.Region.whole(f"t{index}"), size) for index, size in enumerate(sizes)]


def test_buckets_are_filled_in_order_aligned_and_a_large_tensor_travels_alone() -> None:
    plan = wire.plan_buckets(_sized(100, 100, 5000, 10, 700), bucket_bytes=1024)
    assert [(p.region.name, p.bucket, p.offset) for p in plan.placements] == [
        ("t0", 0, 0),
        ("t1", 0, 256),
        ("t2", 1, 0),
        ("t3", 2, 0),
        ("t4", 2, 256),
    ]
    assert plan.sizes == (356, 5000, 956) and plan.largest == 5000
    assert all(p.offset % wire.ALIGNMENT == 0 for p in plan.placements)
    assert plan.oversized(1024) == [] and plan.oversized(512) == [2], "a lone large tensor is never oversized"


def test_pack_and_unpack_round_trip_any_dtype_and_region() -> None:
    tensors = {
        "a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "b": torch.arange(20, dtype=torch.float32).reshape(4, 5),
    }
    infos = {name: wire.TensorInfo.of(name, tensor) for name, tensor in tensors.items()}
    regions = [wire.Region.whole("a"), wire.Region("b", 1, 1, 4)]
    plan = wire.plan_buckets(((region, region.nbytes(infos[region.name])) for region in regions), 4096)
    bucket = torch.zeros(plan.largest, dtype=torch.uint8)
    for placement in plan.placements:
        wire.pack(bucket, placement, tensors[placement.region.name])
    first, second = (wire.unpack(bucket, placement, infos[placement.region.name]) for placement in plan.placements)
    assert torch.equal(first, tensors["a"]) and first.dtype == torch.bfloat16
    assert torch.equal(second, tensors["b"][:, 1:4])


def test_manifest_round_trips_and_malformed_ones_are_refused() -> None:
    infos = (wire.TensorInfo("w", (4, 8), "float32"), wire.TensorInfo("b", (8,), "bfloat16"))
    plan = wire.plan_buckets(((wire.Region.whole(i.name), wire.Region.whole(i.name).nbytes(i)) for i in infos), 64)
    manifest = wire.Manifest(3, "broadcast", 64, infos, plan)
    assert wire.Manifest.decode(manifest.encode()) == manifest
    wrong_protocol = manifest.encode().replace(wire.PROTOCOL, "megafleet-refit/0")
    with pytest.raises(ValueError, match="speaks 'megafleet-refit/0'"):
        wire.Manifest.decode(wrong_protocol)
    with pytest.raises(ValueError, match="twice"):
        wire.Manifest.decode(wire.Manifest(3, "reshard", 64, (infos[0], infos[0])).encode())
    overrun = wire.BucketPlan((16,), (wire.Placement(wire.Region.whole("w"), 0, 0),))
    with pytest.raises(ValueError, match="overruns"):
        wire.Manifest.decode(wire.Manifest(3, "broadcast", 64, infos, overrun).encode())
    with pytest.raises(ValueError, match="carries its bucket plan"):
        wire.Manifest.decode(wire.Manifest(3, "broadcast", 64, infos).encode())
    with pytest.raises(ValueError, match="unknown dtype"):
        wire.Manifest.decode(wire.Manifest(3, "reshard", 64, (wire.TensorInfo("w", (1,), "float99"),)).encode())
    verdict = wire.Verdict(True, regions=(wire.Region("w", 0, 1, 3), wire.Region.whole("b")))
    assert wire.Verdict.decode(verdict.encode()) == verdict
    assert wire.BucketPlan.decode(plan.encode()) == plan


def test_the_manifest_check_names_every_reason_to_refuse() -> None:
    sink = sinks.NamedSink({"w": torch.zeros(4, 8), "b": torch.zeros(8)})
    offered = (wire.TensorInfo("w", (4, 9), "float32"), wire.TensorInfo("x", (1,), "float32"))
    manifest = wire.Manifest(2, "reshard", 2**30, offered)
    verdict = receiver.check_manifest(manifest, sink, version=3, transport="broadcast", bucket_limit_bytes=2**20)
    assert not verdict.ok
    for reason in (
        "sends weight version 2, this engine expects 3",
        "uses the reshard transport, this fleet broadcast",
        "buckets (1024 MiB) exceed this fleet's bucket size (1 MiB",
        "lacks 1 parameters this rank holds, e.g. ['b']",
        "w [4, 9] (expected [4, 8])",
    ):
        assert reason in verdict.error
    fitting = wire.Manifest(
        3, "reshard", 2**20, (wire.TensorInfo("w", (4, 8), "float32"), wire.TensorInfo.of("b", torch.zeros(8)))
    )
    accepted = receiver.check_manifest(fitting, sink, version=3, transport="reshard", bucket_limit_bytes=2**20)
    assert accepted == wire.Verdict(True, regions=(wire.Region.whole("w"), wire.Region.whole("b")))


@pytest.mark.parametrize(
    ("tp_rank", "tp_size", "pp_rank", "pp_size"), [(1, 2, 0, 1), (0, 2, 1, 2)], ids=["tp2-rank1", "tp2-pp2-last-stage"]
)
def test_a_shard_sink_asks_for_its_pieces_and_fills_them_from_whole_or_sliced_tensors(
    tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> None:
    shape = harness.tiny_shape()
    layout = weight_maps.Layout(tp_rank, tp_size, pp_rank, pp_size)
    specs = weight_maps.shard_map(shape, layout)
    weights = harness.Trainer().weights()
    expected = weight_maps.hf_to_megatron(weights, shape, layout=layout)
    ranges = {(p.hf_name, *p.hf_range) for spec in specs.values() for p in spec.pieces}
    for whole in (True, False):
        live = {name: torch.zeros(spec.shape) for name, spec in specs.items()}
        sink = sinks.ShardSink(live, specs, weight_maps.hf_shapes(shape))
        regions = sink.regions()
        assert {(r.name, r.dim, r.start, r.stop) for r in regions} == ranges
        assert sink.missing() == sorted(specs)
        if whole:  # broadcast: every whole tensor arrives; the sink keeps its pieces
            for name, tensor in weights.items():
                sink.write(wire.Region.whole(name), tensor)
        else:  # reshard: only its regions arrive
            for region in regions:
                sink.write(region, region.take(weights[region.name]).clone())
        assert sink.missing() == []
        for name, tensor in expected.items():
            assert torch.equal(live[name], tensor), name


def test_a_named_sink_holds_whole_tensors_only() -> None:
    sink = sinks.NamedSink({"w": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match="held whole"):
        sink.write(wire.Region("w", 0, 0, 2), torch.ones(2, 8))
    assert sink.write(wire.Region.whole("other"), torch.ones(1)) == 0 and sink.missing() == ["w"]


def test_rank_arithmetic_of_the_trainer_fleet_world() -> None:
    rendezvous = communicator.Rendezvous("127.0.0.1", 1, world_size=6, trainer_world_size=2)
    assert rendezvous.group_size == 5
    assert [rendezvous.group_rank(rank) for rank in (0, 2, 3, 5)] == [0, 1, 2, 4]
    assert [rendezvous.global_rank(rank) for rank in (0, 1, 4)] == [0, 2, 5]
    for outside in (1, 6, -1):
        with pytest.raises(ValueError, match="not trainer rank 0 nor a fleet rank"):
            rendezvous.group_rank(outside)
    with pytest.raises(ValueError, match="has no fleet"):
        communicator.Rendezvous("127.0.0.1", 1, world_size=2, trainer_world_size=2)
    assert [ports.attempt_port(29500, attempt) for attempt in (1, 2)] == [29500, 29501]
    with pytest.raises(ValueError, match="only trainer rank 0"):
        sdk.WeightSender(29500, 3, rank=1, address="127.0.0.1")


def test_the_watchdog_fires_once_unless_stopped() -> None:
    fired = threading.Event()
    armed = watchdog.Watchdog(0.05, fired.set)
    armed.start()
    assert fired.wait(10) and armed.fired
    calls: list[int] = []
    stopped = watchdog.Watchdog(30, lambda: calls.append(1))
    stopped.start()
    stopped.stop()
    stopped._thread.join(10)
    assert not stopped._thread.is_alive() and calls == [] and not stopped.fired


def test_the_first_outcome_wins_and_a_commit_cannot_be_failed() -> None:
    record = phases.Progress(version=1, source="rendezvous")
    with record.timed("suspend"):
        assert record.snapshot().phases[0][0] == "suspend"  # reported while running
    assert record.begin_commit() and record.snapshot().phase == "resuming"
    assert not record.finish(error="late watchdog", timed_out=True)
    assert record.finish(error=None) and not record.finish(error="again")
    final = record.snapshot()
    assert (final.phase, final.error, final.timed_out) == ("succeeded", None, False)
    failed = phases.Progress(version=2, source="checkpoint")
    assert failed.finish(error="boom") and not failed.begin_commit()
    assert failed.snapshot().phase == "failed" and failed.snapshot().duration_seconds is not None


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_the_trainer_sdk_imports_without_kopf() -> None:
    code = "import sys; sys.modules['kopf'] = None; import megafleet.sdk; print(megafleet.sdk.WeightSender.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "WeightSender"
