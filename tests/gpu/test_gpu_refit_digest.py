"""``mf64`` on a GPU (:mod:`megafleet_protocol.refit.digest`): the Triton kernel and the chunked torch
fallback give numpy's bits exactly, neither waits on the host (CUDA's sync debug mode would raise), the
trailer checks catch a flipped byte on the device with one read at the end, and the kernel's
throughput on a 1 GiB bucket (reported to ``$MEGAFLEET_GPU_REPORT``; the refit benchmark measures what
it costs a transfer).

Needs one NVIDIA GPU (and Triton for the kernel's tests); skips cleanly otherwise.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from helpers import gpu
from megafleet_protocol.refit import cuda_streams, digest, trailers, wire

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

SIZES = [0, 1, 8, 4095, 16 * 2048 * 8 + 3, 3 * 2**20 + 5]


def payload(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@needs_triton
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bucket", [0, 1, 2**32 - 1, digest.seed_at(3, 1 << 40)])  # the last: a range deep in a group
def test_the_kernel_and_torch_on_the_gpu_equal_numpy(size: int, bucket: int) -> None:
    host = payload(size, size + bucket)
    expected = digest.reference(host.numpy().tobytes(), bucket)
    device = host.cuda()
    assert digest._kernel() is not None, "digest() on CUDA takes the Triton kernel"
    assert digest.unsigned(int(digest.digest(device, bucket).item())) == expected
    assert digest.unsigned(int(digest.torch_digest(device, bucket).item())) == expected
    assert digest.unsigned(int(digest.torch_digest(device, bucket, chunk_words=1000).item())) == expected
    if size > 3:
        view = device[3:]  # not 8-byte aligned: copied once, same bits
        assert digest.unsigned(int(digest.digest(view, bucket).item())) == digest.reference(
            host[3:].numpy().tobytes(), bucket
        )


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
def test_digests_and_checks_queue_on_a_side_stream_without_a_host_wait() -> None:
    plan = wire.plan_buckets(
        [(wire.Region.whole("first.weight"), 5000), (wire.Region.whole("b"), 300)], 2**20, sealed=True
    )
    chunk = payload(plan.sizes[0], 5).cuda()
    stream = cuda_streams.side_stream(chunk.device)
    assert stream is not None
    checks = trailers.Checks(plan, chunk.device)
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            trailers.seal(chunk, 0)
            digest.torch_digest(chunk, 0)
            corrupt = chunk.clone()
            corrupt[17] ^= 0x40
            checks.check(0, corrupt)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    outcome = checks.settle("checksum")  # the one read
    assert outcome.mismatch is not None and (outcome.mismatch.bucket, outcome.mismatch.first_tensor) == (
        0,
        "first.weight",
    )
    clean = trailers.Checks(plan, chunk.device)
    clean.check(0, chunk)
    assert clean.settle("checksum").mismatch is None


@needs_triton
def test_the_kernel_reads_a_1_gib_bucket_at_memory_speed() -> None:
    data = torch.randint(0, 256, (2**30,), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        digest.digest(data, 1)
    torch.cuda.synchronize()
    make: Any = torch.cuda.Event  # untyped constructor in torch's stubs
    start, end = make(enable_timing=True), make(enable_timing=True)
    runs = 10
    start.record()
    for index in range(runs):
        digest.digest(data, index)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / runs
    gb_per_s = 2**30 / seconds / 1e9
    gpu.report("mf64_kernel_1gib", milliseconds=round(seconds * 1e3, 3), gb_per_s=round(gb_per_s, 1))
    assert gb_per_s > 200, f"{gb_per_s:.0f} GB/s"


def test_parameter_digests_on_the_gpu_equal_numpys_over_the_laid_out_groups() -> None:
    """A rank's parameter digests (megatron-native, a checkpoint) on the GPU: mixed dtypes, odd sizes and a
    strided view, grouped small so that ranges start deep in their groups."""
    from megafleet_protocol.refit import parameter_digests

    generator = torch.Generator().manual_seed(11)
    host = {
        "b.weight": torch.randn(300, 77, generator=generator).to(torch.bfloat16),
        "a.norm": torch.randn(33, generator=generator),
        "c.odd": payload(13, 5),
        "d.strided": torch.randn(64, 48, generator=generator).t(),
    }
    on_gpu = {name: tensor.cuda() for name, tensor in host.items()}
    got = parameter_digests.digest_tensors(on_gpu, group_bytes=40_000).bucket_digests
    raw = {name: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for name, t in host.items()}
    expected = []
    for index, group in enumerate(parameter_digests.plan_groups([(n, len(b)) for n, b in raw.items()], 40_000)):
        buffer = bytearray(group[-1].offset + group[-1].nbytes)
        for placed in group:
            buffer[placed.offset : placed.offset + placed.nbytes] = raw[placed.name]
        expected.append(digest.hex_digest(digest.reference(bytes(buffer), index)))
    assert len(expected) > 1 and list(got) == expected
