# Triton kernels take untyped pointers and constexprs: mypy checks their wrapper, digest_words.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The Triton kernel of :func:`megafleet_protocol.refit.digest.digest` on CUDA tensors: ``mf64`` in one
read of the bucket's bytes (the torch fallback runs about a dozen elementwise kernels per chunk).

Imported by :mod:`~megafleet_protocol.refit.digest` on first use, only where Triton is installed
(Triton is slow to import); tests reload it under ``TRITON_INTERPRET=1`` to run it on CPU tensors.
Each program digests ``BLOCK`` words into one partial sum; torch adds the partial sums (int64 sums wrap
as uint64 ones do), so the result does not depend on how the work is split.
"""

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = ["BLOCK", "digest_words"]

BLOCK = 2048
"""Words per program (16 KiB of payload)."""


@triton.jit
def _fmix64(k):
    k ^= k >> 33
    k *= 0xFF51AFD7ED558CCD
    k ^= k >> 33
    k *= 0xC4CEB9FE1A85EC53
    k ^= k >> 33
    return k


@triton.jit(do_not_specialize=["n_words", "bucket"])  # one compiled kernel for every bucket
def _mf64_kernel(words_ptr, partial_ptr, n_words, bucket, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    offsets = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n_words
    words = tl.load(words_ptr + offsets, mask=inside, other=0).to(tl.uint64, bitcast=True)
    position = offsets.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15 + bucket.to(tl.uint64)
    terms = tl.where(inside, _fmix64(words ^ position), 0)
    tl.store(partial_ptr + program, tl.sum(terms, axis=0).to(tl.int64, bitcast=True))


def digest_words(words: torch.Tensor, bucket: int) -> torch.Tensor:
    """The sum of ``mf64``'s terms over the int64 words ``words`` (word 0 first) as bucket ``bucket``
    (its bits as an int64): a 0-d int64 tensor, queued on the current stream."""
    count = words.numel()
    if count == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    programs = triton.cdiv(count, BLOCK)
    partial = torch.empty(programs, dtype=torch.int64, device=words.device)
    _mf64_kernel[(programs,)](words, partial, count, bucket, BLOCK=BLOCK)
    return partial.sum()
