"""``mf64``, the refit buckets' digest (:mod:`megafleet_protocol.refit.digest`), and the trailers that
carry it on the megafleet wire (:mod:`megafleet_protocol.refit.trailers`): hand-computed values from
MurmurHash3's published ``fmix64`` vectors, the torch implementation (and Triton's, on its CPU
interpreter) bit for bit against numpy's, the properties the definition promises, and the wire's
sealed layout, messages and checks. No network, no process group."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megafleet_engine.refit_attempts import sinks
from megafleet_protocol.refit import digest, errors, receiver, round_messages, trailers, verification, wire

K = digest.MULTIPLIER
MASK = 2**64 - 1

FMIX64_VECTORS = [  # MurmurHash3's fmix64, as published with its reference implementations
    (0x0000000000000000, 0x0000000000000000),
    (0x0000000000000001, 0xB456BCFC34C2CB2C),
    (0xFFFFFFFFFFFFFFFF, 0x64B5720B4B825F21),
    (0x1234567890ABCDEF, 0x0CAE996FEE6BD396),
    (0xDEADBEEFCAFEBABE, 0x7082995008F0C48C),
]


def le(*words: int) -> bytes:
    return b"".join((word & MASK).to_bytes(8, "little") for word in words)


def torch_value(data: bytes, bucket: int, **options: int) -> int:
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    return digest.unsigned(int(digest.torch_digest(tensor, bucket, **options).item()))


@pytest.mark.parametrize(("word", "mixed"), FMIX64_VECTORS, ids=[f"{w:#x}" for w, _ in FMIX64_VECTORS])
def test_fmix64_is_murmur3s_finalizer(word: int, mixed: int) -> None:
    assert digest.fmix64(word) == mixed


# Each row: payload, bucket, the digest by hand from the vectors above (h = sum of fmix64(w_i ^ (i*K + bucket))).
MINUS_K = -K & MASK  # a bucket seed that makes word 1's position term 0
HAND_COMPUTED = [
    (b"", 0, 0),  # no words: the empty sum
    (b"\x01", 0, 0xB456BCFC34C2CB2C),  # one byte, zero-padded: w_0 = 1
    (le(0), 1, 0xB456BCFC34C2CB2C),  # w_0 = 0, bucket 1: fmix64(1)
    (le(1, K ^ MASK), 0, (0xB456BCFC34C2CB2C + 0x64B5720B4B825F21) & MASK),  # w_1 ^ K = 2**64 - 1
    (le(0x1234567890ABCDEF ^ 5, (K + 5) ^ 0xDEADBEEFCAFEBABE), 5, (0x0CAE996FEE6BD396 + 0x7082995008F0C48C) & MASK),
    # a partial last word: w_1 = 1 (three bytes, zero-padded) at position K + seed = 0
    (le(MINUS_K ^ MASK) + b"\x01\x00\x00", MINUS_K, (0x64B5720B4B825F21 + 0xB456BCFC34C2CB2C) & MASK),
]


@pytest.mark.parametrize(("payload", "bucket", "expected"), HAND_COMPUTED, ids=[str(i) for i in range(6)])
def test_digests_computed_by_hand(payload: bytes, bucket: int, expected: int) -> None:
    assert digest.reference(payload, bucket) == expected
    assert torch_value(payload, bucket) == expected
    assert digest.hex_digest(expected) == f"{expected:016x}" and len(digest.hex_digest(expected)) == 16


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 64, 1001, 70_001 * 8 + 5])
@pytest.mark.parametrize("bucket", [0, 3, 2**31 + 7, 2**32 - 1])
def test_torch_equals_numpy_bit_for_bit_in_any_chunking(size: int, bucket: int) -> None:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size + bucket))
    expected = digest.reference(data.numpy().tobytes(), bucket)
    assert digest.unsigned(int(digest.digest(data, bucket).item())) == expected
    for chunk in (1, 3, 1 << 10) if size < 10_000 else (1 << 10,):
        assert digest.unsigned(int(digest.torch_digest(data, bucket, chunk_words=chunk).item())) == expected


def test_a_view_at_any_offset_digests_its_own_bytes() -> None:
    base = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for start in (1, 3, 8, 13):
        view = base[start:]
        assert torch_value(view.numpy().tobytes(), 9) == digest.reference(view.numpy().tobytes(), 9)
        assert digest.unsigned(int(digest.digest(view, 9).item())) == digest.reference(view.numpy().tobytes(), 9)
    with pytest.raises(ValueError, match="1-D uint8"):
        digest.digest(torch.zeros(4, dtype=torch.int32), 0)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=300),
    position=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
    bucket=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_any_changed_byte_changes_the_digest(data: bytes, position: int, flip: int, bucket: int) -> None:
    changed = bytearray(data)
    changed[position % len(data)] ^= flip
    assert digest.reference(bytes(changed), bucket) != digest.reference(data, bucket)
    assert torch_value(bytes(changed), bucket) == digest.reference(bytes(changed), bucket)


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.integers(min_value=0, max_value=MASK), min_size=2, max_size=40, unique=True),
    pair=st.tuples(st.integers(min_value=0), st.integers(min_value=0)),
    bucket=st.integers(min_value=0, max_value=2**32 - 2),
)
def test_swapped_words_and_another_bucket_change_the_digest(
    words: list[int], pair: tuple[int, int], bucket: int
) -> None:
    first, second = pair[0] % len(words), pair[1] % len(words)
    if first == second:
        second = (first + 1) % len(words)
    swapped = list(words)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    original = digest.reference(le(*words), bucket)
    assert digest.reference(le(*swapped), bucket) != original
    assert digest.reference(le(*words), bucket + 1) != original
    assert torch_value(le(*swapped), bucket) == digest.reference(le(*swapped), bucket)


# -- the Triton kernel on Triton's CPU interpreter (the same comparison runs on a GPU in tests/gpu) -----

INTERPRETED = """
import sys, torch
from megafleet_protocol.refit import digest, digest_kernel
for words in (0, 1, 2048, 2049, 5000):
    data = torch.randint(0, 256, (words * 8,), dtype=torch.uint8, generator=torch.Generator().manual_seed(words))
    for bucket in (0, 1, 77, 2**32 - 1, digest.seed_at(3, 1 << 40)):  # the last: a range deep in a group
        got = digest.unsigned(int(digest_kernel.digest_words(data.view(torch.int64), digest._signed(bucket)).item()))
        assert got == digest.reference(data.numpy().tobytes(), bucket), (words, bucket)
print("equal")
"""


@pytest.mark.slow  # starts a subprocess: Triton reads TRITON_INTERPRET once, before any kernel is defined
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_triton_kernel_equals_numpy_on_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stdout + done.stderr[-4000:]


# -- the trailer and the sealed layout --------------------------------------------------------------


def test_a_sealed_bucket_carries_its_digest_and_index_and_any_change_is_caught() -> None:
    plan = wire.plan_buckets([(wire.Region.whole("a"), 100), (wire.Region.whole("b"), 40)], 1024, sealed=True)
    assert plan.sizes == (256 + 48 + 16,), "payload to 296, trailer at 304 (next multiple of 16)"
    chunk = torch.randint(0, 256, (plan.sizes[0],), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    trailers.seal(chunk, 0)
    trailer = chunk[-16:].numpy().tobytes()
    assert int.from_bytes(trailer[:8], "little") == digest.reference(chunk[:-16].numpy().tobytes(), 0)
    assert int.from_bytes(trailer[8:12], "little") == 0 and trailer[12:] == b"MFCK"

    def verify(bucket_bytes: torch.Tensor) -> verification.Verification:
        checks = trailers.Checks(plan, torch.device("cpu"))
        checks.check(0, bucket_bytes)
        return checks.settle("checksum")

    assert verify(chunk) == verification.Verification("checksum", "trainerDigest", buckets=1)
    for corrupt in (0, 200, 303):  # a payload byte, padding before the trailer, the magic
        changed = chunk.clone()
        changed[corrupt] ^= 1
        assert verify(changed).mismatch == verification.Mismatch(0, "a"), corrupt
    other = chunk.clone()
    trailers.seal(other, 1)  # sealed as bucket 1, arriving as bucket 0
    assert verify(other).mismatch == verification.Mismatch(0, "a")


def test_sealed_plans_keep_the_trailer_inside_the_bucket_size() -> None:
    sized = [(wire.Region.whole(f"t{i}"), size) for i, size in enumerate((100, 100, 5000, 10, 1000))]
    plan = wire.plan_buckets(sized, 1024, sealed=True)
    assert [(p.bucket, p.offset) for p in plan.placements] == [(0, 0), (0, 256), (1, 0), (2, 0), (3, 0)]
    # payload end rounded up to 16, plus the trailer; t4 at 256 would pass 1024, alone it fills it exactly
    assert plan.sizes == (384, 5024, 32, 1024)
    assert all(size % 16 == 0 and size >= 16 for size in plan.sizes)
    assert plan.oversized(1024) == []
    infos = {f"t{i}": wire.TensorInfo(f"t{i}", (size,), "uint8") for i, size in enumerate((100, 100, 5000, 10, 1000))}
    plan.check(infos, sealed=True)
    with pytest.raises(ValueError, match=r"buckets \[0, 1, 2\] have no room for their digest's trailer"):
        wire.plan_buckets(sized, 1024).check(infos, sealed=True)  # sizes 356, 5000, 266, 1000
    overrun = wire.BucketPlan((32,), (wire.Placement(wire.Region.whole("t3"), 0, 0),))
    with pytest.raises(ValueError, match="overruns"):
        overrun.check({"t3": wire.TensorInfo("t3", (20,), "uint8")}, sealed=True)  # reaches into the trailer


def test_manifests_name_their_digest_and_old_ones_have_none() -> None:
    infos = (wire.TensorInfo("w", (4, 8), "float32"),)
    plan = wire.plan_buckets([(wire.Region.whole("w"), 128)], 1024, sealed=True)
    sealed = wire.Manifest(3, "broadcast", 1024, infos, plan, checksum="mf64")
    assert wire.Manifest.decode(sealed.encode()) == sealed
    old = json.loads(sealed.encode())
    del old["checksum"]
    old["buckets"]["sizes"] = [128]
    assert wire.Manifest.decode(json.dumps(old)).checksum is None, "a trainer older than digests"
    with pytest.raises(ValueError, match="carry digest 'crc32'"):
        wire.Manifest.decode(sealed.encode().replace('"mf64"', '"crc32"'))
    unsealed = wire.Manifest(3, "broadcast", 1024, infos, wire.plan_buckets([(wire.Region.whole("w"), 128)], 1024))
    with pytest.raises(ValueError, match="overruns its bucket of 128 bytes"):  # the payload reaches the trailer
        wire.Manifest.decode(unsealed.encode().replace('"checksum":null', '"checksum":"mf64"'))


def test_hellos_ask_for_digests_and_old_ones_ask_for_none() -> None:
    hello = round_messages.Hello("s", "g", "m", ("mf64",))
    assert round_messages.Hello.decode(hello.encode().encode()) == hello
    assert round_messages.Hello.decode(b'{"session": "s", "group": null, "manifest": null}').checksums == ()
    with pytest.raises(errors.ProtocolError, match="malformed hello"):
        round_messages.Hello.decode(b'{"session": "s", "group": null, "checksums": "mf64"}')


def test_a_receiver_that_asks_for_integrity_refuses_a_manifest_without_digests() -> None:
    sink = sinks.NamedSink({"w": torch.zeros(4, 8)})
    infos = (wire.TensorInfo("w", (4, 8), "float32"),)
    bare = wire.Manifest(1, "broadcast", 1024, infos, wire.plan_buckets([(wire.Region.whole("w"), 128)], 1024))
    terms = {"version": 1, "transport": "broadcast", "bucket_limit_bytes": 1024}
    assert receiver.check_manifest(bare, sink, **terms).ok  # type: ignore[arg-type]
    refused = receiver.check_manifest(bare, sink, integrity="checksum", **terms)  # type: ignore[arg-type]
    assert not refused.ok and "asks for integrity checksum, but the trainer's buckets carry no digest" in refused.error
    sealed_plan = wire.plan_buckets([(wire.Region.whole("w"), 128)], 1024, sealed=True)
    sealed = wire.Manifest(1, "broadcast", 1024, infos, sealed_plan, checksum="mf64")
    assert receiver.check_manifest(sealed, sink, integrity="checksum", **terms).ok  # type: ignore[arg-type]
    held = receiver.Accepted("id", sealed, sealed_plan, "broadcast", 1024)
    assert held.holds("broadcast", 1024, "mf64") and not held.holds("broadcast", 1024, None)


def test_the_mismatch_error_names_the_bucket_and_its_first_tensor() -> None:
    error = errors.BucketMismatch(2, "model.layers.0.mlp.up_proj.weight", 16)
    assert (error.bucket, error.first_tensor) == (2, "model.layers.0.mlp.up_proj.weight")
    assert "bucket 2 (of 16, counted from 0; first tensor model.layers.0.mlp.up_proj.weight)" in str(error)
    assert isinstance(error, errors.RefitError)
