"""NeMo RL's refit collective on CPU: the fleet's receiver (:mod:`megafleet_protocol.refit.nemo`) against
an independent trainer written from the description of NeMo's wire, not from the receiver's code
(:mod:`helpers.nemo_trainer`): the unique id under NeMo's or vLLM's key, the warm-up of that
generation, NeMo's packing broadcast over gloo (standing in for NCCL). Every trainer rank takes part,
as in NeMo.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch._C import _distributed_c10d as c10d

from helpers import nemo_trainer
from helpers import refit_harness as harness
from megafleet_engine.refit_attempts import sinks
from megafleet_engine.refit_attempts.sources import nemo_collective
from megafleet_protocol.refit import communicator, errors, nemo, nemo_rendezvous

ADDRESS = nemo_trainer.ADDRESS
GLOO_PREFIX = nemo_trainer.GLOO_PREFIX
TARGET = 1000


# -- the receiver under test -----------------------------------------------------------------------


def weights() -> dict[str, torch.Tensor]:
    """A mixed refit: dtypes, a 0-d scalar, an empty tensor, one tensor larger than the target and
    odd sizes that leave later tensors at misaligned offsets."""
    generator = torch.Generator().manual_seed(13)
    return {
        "embed.weight": torch.randn(7, 9, generator=generator).to(torch.bfloat16),  # 126 B
        "norm.weight": torch.randn(33, generator=generator),  # 132 B
        "odd.bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=generator),  # 3 B: misaligns
        "layer.0.weight": torch.randn(40, 10, generator=generator),  # 1600 B > target: its own bucket
        "step": torch.tensor(41, dtype=torch.int64),  # 0-d
        "empty.bias": torch.zeros(0, 4),
        "layer.1.weight": torch.randn(30, 10, generator=generator),  # 1200 B: closes the second bucket
        "positions": torch.randint(-(2**40), 2**40, (10,), dtype=torch.int64, generator=generator),
        "last.scale": torch.randn(5, generator=generator).to(torch.bfloat16),
    }


def info_of(tensors: dict[str, torch.Tensor]) -> list[nemo.TensorSpec]:
    return nemo.refit_info({name: (tensor.shape, tensor.dtype) for name, tensor in tensors.items()})


def fleet_rank(
    rank: int,
    *,
    port: int,
    world_size: int,
    trainer_world_size: int,
    specs: list[nemo.TensorSpec],
    bucket_bytes: int,
    got: dict[int, dict[str, torch.Tensor]],
    order: dict[int, list[str]],
    joined: dict[int, nemo.NemoReceiver],
    timeout: float = 30.0,
) -> None:
    world = nemo.NemoWorld(ADDRESS, port, world_size, rank, trainer_world_size)
    deadline = communicator.Deadline(timeout)
    cpu = torch.device("cpu")
    receiver = nemo.NemoReceiver.connect(
        world, backend="gloo", device=cpu, deadline=deadline, local_address=ADDRESS, gloo_prefix=GLOO_PREFIX
    )
    joined[rank] = receiver
    got[rank], order[rank] = {}, []

    def write(tensors: list[tuple[str, torch.Tensor]]) -> int:
        for name, tensor in tensors:
            got[rank][name] = tensor.clone()  # the views are valid only during the call
            order[rank].append(name)
        return len(tensors)

    stats = receiver.receive(specs, bucket_bytes=bucket_bytes, device=cpu, write=write, deadline=deadline)
    assert stats.tensors_written == len(specs)


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("generation", "trainers", "fleet"), [("nemo", 2, 2), ("vllm", 1, 1)], ids=["nemo-0.6+", "vllm-nemo-0.5"]
)
@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_the_fleet_receives_nemos_packed_broadcast_bit_for_bit(
    generation: nemo_rendezvous.Generation, trainers: int, fleet: int
) -> None:
    tensors = weights()
    specs = info_of(tensors)
    world_size = trainers + fleet
    port = harness.free_port()
    unique_id = os.urandom(128)
    sent: list[int] = []
    got: dict[int, dict[str, torch.Tensor]] = {}
    order: dict[int, list[str]] = {}
    joined: dict[int, nemo.NemoReceiver] = {}
    ranks = [
        functools.partial(
            nemo_trainer.trainer_rank,
            rank,
            port=port,
            world_size=world_size,
            tensors=list(tensors.values()),
            target=TARGET,
            generation=generation,
            unique_id=unique_id,
            sent=sent,
        )
        for rank in range(trainers)
    ] + [
        functools.partial(
            fleet_rank,
            rank,
            port=port,
            world_size=world_size,
            trainer_world_size=trainers,
            specs=specs,
            bucket_bytes=TARGET,
            got=got,
            order=order,
            joined=joined,
        )
        for rank in range(trainers, world_size)
    ]
    with nemo_trainer.running(*ranks) as failures:
        pass
    assert not failures, failures
    assert [sum(spec.nbytes for spec in bucket) for bucket in nemo.plan_buckets(specs, TARGET)] == sent
    assert sent == [126 + 132 + 3 + 1600, 8 + 0 + 1200, 80 + 10]
    for rank in range(trainers, world_size):
        assert joined[rank].generation == generation and joined[rank].unique_id == unique_id
        assert order[rank] == list(tensors), "written in the refit info's order"
        for name, tensor in tensors.items():
            received = got[rank][name]
            assert received.dtype == tensor.dtype and received.shape == tensor.shape, name
            assert bits(received) == bits(tensor), name
        joined[rank].close()


def test_bucket_boundaries_follow_nemos_strictly_greater_rule() -> None:
    def sized(*sizes: int) -> list[nemo.TensorSpec]:
        return [nemo.TensorSpec(f"t{index}", (size,), torch.uint8) for index, size in enumerate(sizes)]

    def names(buckets: list[list[nemo.TensorSpec]]) -> list[list[str]]:
        return [[spec.name for spec in bucket] for bucket in buckets]

    assert names(nemo.plan_buckets(sized(500, 500, 1), 1000)) == [["t0", "t1", "t2"]], "== target does not close"
    assert names(nemo.plan_buckets(sized(10, 5000, 10), 1000)) == [["t0", "t1"], ["t2"]], "a large one closes"
    assert names(nemo.plan_buckets(sized(5000, 0), 1000)) == [["t0"], ["t1"]], "a 0-byte tail is still a bucket"
    assert names(nemo.plan_buckets(sized(999, 2, 0), 1000)) == [["t0", "t1"], ["t2"]]
    assert nemo.plan_buckets([], 1000) == []
    generator = torch.Generator().manual_seed(5)
    for _ in range(50):  # against the trainer's own loop
        sizes = [int(size) for size in torch.randint(0, 700, (int(torch.randint(1, 30, (1,))),), generator=generator)]
        tensors = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
        theirs = [sum(part.numel() for part in bucket) for bucket in nemo_trainer.nemo_buckets(tensors, TARGET)]
        ours = [sum(spec.nbytes for spec in bucket) for bucket in nemo.plan_buckets(sized(*sizes), TARGET)]
        assert ours == theirs


def test_unpack_copies_only_misaligned_tensors() -> None:
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.arange(4, dtype=torch.float32)}
    specs = info_of(tensors)
    bucket = torch.cat([tensor.reshape(-1).view(torch.uint8) for tensor in tensors.values()])
    (_, first), (_, second) = nemo.unpack(bucket, specs)
    assert first.data_ptr() == bucket.data_ptr(), "aligned: a view of the bucket"
    assert torch.equal(second, tensors["b"]) and second.untyped_storage().data_ptr() != bucket.data_ptr()
    with pytest.raises(errors.ProtocolError, match="a bucket of 6 bytes holds tensors of 19 bytes"):
        nemo.unpack(bucket[:6], specs)


def test_a_pickled_unique_id_naming_anything_else_is_refused() -> None:
    raw = os.urandom(128)
    pickled = nemo_trainer.vllm_pickled_id(raw)
    assert len(pickled) == 247 and b"_ctypes" in pickled, "the shape the notes measured with vLLM"
    assert nemo_rendezvous.decode_vllm_unique_id(pickled) == raw
    evil = b"cos\nsystem\n(S'true'\ntR."
    with pytest.raises(errors.ProtocolError, match=r"may not name os\.system"):
        nemo_rendezvous.decode_vllm_unique_id(evil)
    with pytest.raises(errors.ProtocolError, match="holds a bytes"):
        nemo_rendezvous.decode_vllm_unique_id(pickle.dumps(raw))


def test_a_refit_info_that_does_not_fit_the_rank_is_refused_before_any_byte() -> None:
    specs = nemo.refit_info({"w": ((4, 8), "float32"), "b": ((8,), torch.bfloat16), "extra": ((1,), "int64")})
    nemo.check_refit_info(specs, {"w": (4, 8), "b": (8,)})  # extra tensors are received and dropped
    with pytest.raises(errors.ManifestMismatch, match=r"lacks 1 parameters this rank holds, e.g. \['lm_head'\]"):
        nemo.check_refit_info(specs, {"w": (4, 8), "lm_head": (2, 2)})
    with pytest.raises(errors.ManifestMismatch, match=r"w \[4, 8\] \(expected \[8, 4\]\)"):
        nemo.check_refit_info(specs, {"w": (8, 4)})
    with pytest.raises(errors.ManifestMismatch, match="twice"):
        nemo.check_refit_info([*specs, specs[0]], {})

    class Untouched:
        def broadcast(self, tensor: torch.Tensor, *, deadline: communicator.Deadline, what: str) -> None:
            raise AssertionError("nothing is received once the refit info is refused")

        def warm_up(self, generation: nemo_rendezvous.Generation, deadline: communicator.Deadline) -> None: ...
        def abort(self) -> None: ...

    world = nemo.NemoWorld(ADDRESS, 1, 2, 1, 1)
    receiver = nemo.NemoReceiver(c10d.HashStore(), Untouched(), world=world, generation="nemo", unique_id=b"")
    with pytest.raises(errors.ManifestMismatch, match="other shapes"):
        receiver.receive(
            specs,
            bucket_bytes=TARGET,
            device=torch.device("cpu"),
            write=lambda tensors: 0,
            deadline=communicator.Deadline(5),
            required={"b": (9,)},
        )


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_a_trainer_that_never_comes_ends_at_the_deadline() -> None:
    world = nemo.NemoWorld(ADDRESS, harness.free_port(), 2, 1, 1)
    started = time.monotonic()
    with pytest.raises(errors.RefitTimeout, match="accepted a connection"):
        nemo_rendezvous.rendezvous(world, deadline=communicator.Deadline(1.0))
    assert time.monotonic() - started < 3


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_a_trainer_that_never_publishes_its_id_ends_at_the_deadline() -> None:
    port = harness.free_port()
    masters: list[c10d.Store] = []
    world = nemo.NemoWorld(ADDRESS, port, 2, 1, 1)

    def master() -> None:  # returns once the receiver connected: it counts as one of the 2
        masters.append(c10d.TCPStore(ADDRESS, port, 2, True, datetime.timedelta(seconds=10), wait_for_workers=True))

    started = time.monotonic()
    with nemo_trainer.running(master) as failures, pytest.raises(errors.RefitTimeout, match="NCCL unique id"):
        nemo_rendezvous.rendezvous(world, deadline=communicator.Deadline(1.5))
    assert not failures and len(masters) == 1, "the trainer's store counted the receiver (world_size given)"
    assert time.monotonic() - started < 5


def test_an_abort_ends_the_wait_for_the_id() -> None:
    port = harness.free_port()
    aborted = threading.Event()
    holder: list[c10d.Store] = []

    def master() -> None:
        holder.append(c10d.TCPStore(ADDRESS, port, 2, True, datetime.timedelta(seconds=10), wait_for_workers=True))
        aborted.set()

    with nemo_trainer.running(master), pytest.raises(errors.RefitAborted):
        nemo_rendezvous.rendezvous(
            nemo.NemoWorld(ADDRESS, port, 2, 1, 1), deadline=communicator.Deadline(20), aborted=aborted
        )


def test_the_default_bucket_target_is_nemos_formula() -> None:
    assert nemo.nemo_bucket_bytes(143_771_336_704) == 2_875_426_734
    assert nemo.nemo_bucket_bytes(10**12, 0.3) == 5 * 1024**3
    with pytest.raises(ValueError, match="not an inference rank"):
        nemo.NemoWorld(ADDRESS, 1, 3, 1, 2)


def test_the_engines_sink_takes_refit_after_refit_in_place_over_one_world() -> None:
    """The engine's side (:mod:`megafleet_engine.refit_attempts.sources.nemo_collective`): joined once, two refits
    written into a sink's live tensors in place through ``apply``; a tensor of the refit info the rank
    does not hold is received and dropped."""
    first, second = weights(), {name: tensor + 1 for name, tensor in weights().items()}
    specs = info_of(first)
    live = {name: torch.zeros_like(tensor) for name, tensor in first.items() if name != "step"}
    addresses = {name: tensor.data_ptr() for name, tensor in live.items()}
    sink = sinks.NamedSink(live)
    port = harness.free_port()
    applied: list[int] = []
    stats: list[nemo.Stats] = []

    def apply(write: Callable[[], int]) -> int:
        applied.append(write())
        return applied[-1]

    def fleet() -> None:
        deadline = communicator.Deadline(30)
        world = nemo.NemoWorld(ADDRESS, port, 2, 1, 1)
        joined = nemo.NemoReceiver.connect(
            world, backend="gloo", device=torch.device("cpu"), deadline=deadline, local_address=ADDRESS,
            gloo_prefix=GLOO_PREFIX,
        )  # fmt: skip
        try:
            for _ in range(2):
                stats.append(
                    nemo_collective.receive(
                        joined, sink.fresh(), specs=specs, bucket_bytes=TARGET, apply=apply, deadline=deadline
                    )
                )
                if len(stats) == 1:
                    assert all(torch.equal(live[name], first[name]) for name in live)
        finally:
            joined.close()

    trainer = functools.partial(
        nemo_trainer.trainer_rank, 0, port=port, world_size=2, tensors=list(first.values()), target=TARGET,
        generation="nemo", unique_id=os.urandom(128), sent=[], later=[list(second.values())],
    )  # fmt: skip
    with nemo_trainer.running(trainer, fleet) as failures:
        pass
    assert not failures, failures
    assert [stat.buckets for stat in stats] == [3, 3] and sum(applied) == 2 * len(live)
    assert all(bits(live[name]) == bits(second[name]) for name in live)
    assert {name: tensor.data_ptr() for name, tensor in live.items()} == addresses, "written in place"
