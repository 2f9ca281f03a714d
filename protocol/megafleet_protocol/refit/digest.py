"""``mf64``: the 64-bit digest of one refit bucket, defined once and computed three ways with the same bits.

Called by the trainer's :mod:`~megafleet_protocol.refit.sender` (the digest of each packed bucket goes
into its trailer, :mod:`~megafleet_protocol.refit.trailers`), by an engine rank's
:mod:`~megafleet_protocol.refit.receiver` (the digest of each bucket as it lands, compared with the
trailer) and by the NeMo receiver (:mod:`~megafleet_protocol.refit.nemo`: each member's digests, which
the operator compares across members, since NeMo's wire carries none).

The definition. Read the payload bytes ``[0, n)``, zero-padded to a multiple of 8, as little-endian
unsigned 64-bit words ``w_0 .. w_{m-1}``; then::

    h = sum over i of fmix64(w_i XOR (i * 0x9E3779B97F4A7C15 + bucket))   (mod 2**64)

with MurmurHash3's 64-bit finalizer :func:`fmix64` (a bijection: any changed word changes its term),
the position term catching swapped or shifted words, the bucket index keeping one bucket from passing
as another, and the sum being order-free, so any parallel reduction gives the same bits. It guards
against transport faults, not adversaries (an undetected random corruption: about 2**-64).

The three implementations:

* :func:`reference`: numpy's uint64 arithmetic on the host (the definition as code; tests compare the
  others with it);
* :func:`torch_digest`: torch int64 tensors on any device, in chunks; int64 multiplication and sums
  wrap as uint64 ones do (two's complement), and the logical right shift is an arithmetic shift with
  the sign copies masked off. It queues kernels on the current stream and never waits on the host;
* :mod:`~megafleet_protocol.refit.digest_kernel`: one Triton kernel (one read of the bytes), used by
  :func:`digest` on CUDA tensors when Triton is installed.

Imports torch; numpy only inside :func:`reference`. Assumes a little-endian host and device (every
machine torch runs refits on).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any

import torch

__all__ = [
    "FMIX_C1",
    "FMIX_C2",
    "MULTIPLIER",
    "NAME",
    "digest",
    "fmix64",
    "hex_digest",
    "reference",
    "seed_at",
    "torch_digest",
    "unsigned",
    "warm_up",
]

NAME = "mf64"
"""The digest's name on the wire (``Manifest.checksum``, the hellos' ``checksums``)."""
MULTIPLIER = 0x9E3779B97F4A7C15
"""The position multiplier (2**64 / the golden ratio)."""
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53
"""MurmurHash3's ``fmix64`` multipliers."""
MASK64 = 2**64 - 1
_LOW31 = (1 << 31) - 1  # an arithmetic shift right by 33 keeps 31 bits of the word; the rest are sign copies
CPU_CHUNK_WORDS = 1 << 16
"""Words per torch chunk on CPU (512 KiB: each step's temporaries stay in the cache)."""
CUDA_CHUNK_WORDS = 1 << 22
"""Words per torch chunk on a GPU (32 MiB: few launches, bounded temporaries)."""

if sys.byteorder != "little":  # pragma: no cover - every refit machine is little-endian
    raise ImportError("mf64 reads the payload as little-endian words; this host is big-endian")


def _signed(value: int) -> int:
    """``value`` (0 .. 2**64-1) as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def unsigned(value: int) -> int:
    """An int64's bits as 0 .. 2**64-1 (what a torch digest's ``.item()`` needs)."""
    return value & MASK64


def hex_digest(value: int) -> str:
    """16 lower-case hex digits (the form the status reports)."""
    return f"{unsigned(value):016x}"


def seed_at(bucket: int, word_offset: int) -> int:
    """The seed that digests a range starting at word ``word_offset`` of bucket ``bucket`` as that part of
    the bucket: the position term of word ``i`` of the range is ``(word_offset + i) * MULTIPLIER + bucket``,
    which is ``i * MULTIPLIER + seed_at(bucket, word_offset)``. The digests of a bucket's word-aligned
    ranges, each with its seed, add up (mod 2**64) to the bucket's digest, without the bucket ever being
    copied together."""
    return (word_offset * MULTIPLIER + bucket) & MASK64


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int (0 .. 2**64-1)."""
    k &= MASK64
    k ^= k >> 33
    k = (k * FMIX_C1) & MASK64
    k ^= k >> 33
    k = (k * FMIX_C2) & MASK64
    k ^= k >> 33
    return k


def reference(data: bytes | bytearray | memoryview, bucket: int) -> int:
    """``mf64`` of ``data`` as bucket ``bucket``, with numpy on the host (the reference)."""
    import numpy as np

    raw = bytes(data)
    padded = raw + b"\0" * (-len(raw) % 8)
    words = np.frombuffer(padded, dtype="<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        index = np.arange(words.size, dtype=np.uint64) * np.uint64(MULTIPLIER) + np.uint64(bucket)
        k = words ^ index
        k ^= k >> np.uint64(33)
        k *= np.uint64(FMIX_C1)
        k ^= k >> np.uint64(33)
        k *= np.uint64(FMIX_C2)
        k ^= k >> np.uint64(33)
        return int(k.sum(dtype=np.uint64))


def digest(data: torch.Tensor, bucket: int) -> torch.Tensor:
    """``mf64`` of the 1-D ``uint8`` tensor ``data`` as bucket ``bucket``: a 0-d int64 tensor on its
    device (the bits of the unsigned digest), queued on the current stream (no host wait). A CUDA
    tensor goes through the Triton kernel when Triton is installed, anything else through
    :func:`torch_digest`; both give the same bits."""
    kernel = _kernel() if data.is_cuda else None
    if kernel is None:
        return torch_digest(data, bucket)
    words, tail = _words(data)
    total: torch.Tensor = kernel.digest_words(words, _signed(bucket & MASK64))
    if tail is not None:
        steps = torch.zeros(1, dtype=torch.int64, device=data.device)
        total.add_(_terms(tail, steps, words.numel(), bucket).sum())
    return total


def warm_up(device: torch.device) -> None:
    """Compile the Triton kernel for ``device`` now (a CUDA device with Triton installed; else
    nothing): its first use compiles it, which should not fall inside a transfer."""
    if device.type == "cuda" and _kernel() is not None:
        digest(torch.zeros(16 * 8, dtype=torch.uint8, device=device), 0)


def torch_digest(data: torch.Tensor, bucket: int, *, chunk_words: int | None = None) -> torch.Tensor:
    """``mf64`` of the 1-D ``uint8`` tensor ``data`` with torch int64 arithmetic, ``chunk_words`` words
    at a time (default by device): a 0-d int64 tensor on ``data``'s device, with no host wait."""
    words, tail = _words(data)
    chunk = min(chunk_words or (CUDA_CHUNK_WORDS if data.is_cuda else CPU_CHUNK_WORDS), max(words.numel(), 1))
    steps = torch.arange(chunk, dtype=torch.int64, device=data.device).mul_(_signed(MULTIPLIER))  # i * K, per chunk
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), chunk):
        part = words.narrow(0, start, min(chunk, words.numel() - start))
        total.add_(_terms(part, steps.narrow(0, 0, part.numel()), start, bucket).sum())
    if tail is not None:
        total.add_(_terms(tail, steps.narrow(0, 0, 1), words.numel(), bucket).sum())
    return total


def _words(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``data``'s whole words as int64 (a view when aligned) and the last, partial word zero-padded
    (``None`` when there is none)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"mf64 digests 1-D uint8 tensors, not {data.dtype} of shape {list(data.shape)}")
    whole = data.numel() // 8 * 8
    body = data.narrow(0, 0, whole)
    if body.stride(0) != 1 or body.storage_offset() % 8:
        body = body.clone(memory_format=torch.contiguous_format)  # a copy at offset 0, which int64 can view
    words = body.view(torch.int64)
    if whole == data.numel():
        return words, None
    tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
    tail.narrow(0, 0, data.numel() - whole).copy_(data.narrow(0, whole, data.numel() - whole))
    return words, tail.view(torch.int64)


def _terms(words: torch.Tensor, steps: torch.Tensor, start: int, bucket: int) -> torch.Tensor:
    """``fmix64(w_i ^ (i * MULTIPLIER + bucket))`` for the words ``words`` (word ``start`` first), as
    int64; ``steps`` holds ``j * MULTIPLIER`` for ``j`` from 0, as many as there are words."""
    k = torch.add(steps, _signed((start * MULTIPLIER + bucket) & MASK64)).bitwise_xor_(words)
    for multiplier in (FMIX_C1, FMIX_C2):
        k.bitwise_xor_(k.bitwise_right_shift(33).bitwise_and_(_LOW31))
        k.mul_(_signed(multiplier))
    return k.bitwise_xor_(k.bitwise_right_shift(33).bitwise_and_(_LOW31))


@functools.cache
def _kernel() -> Any:
    """:mod:`~megafleet_protocol.refit.digest_kernel` when Triton is installed (imported on first use:
    Triton is slow to import), else ``None``."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("megafleet_protocol.refit.digest_kernel")
