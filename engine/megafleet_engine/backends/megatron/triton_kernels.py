# Triton kernels take untyped pointers and constexprs: mypy checks their wrappers in fused.py.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The Triton kernels of :mod:`.fused` (imported by it on first use: Triton is slow to import and
present on the GPU machines, with torch). Each is specified and tested through its wrapper in
:mod:`.fused`; launch them only through those."""

import os

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from triton.language.extra import libdevice  # type: ignore[import-untyped]

PRECISE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
"""On the GPU: libdevice's precise float32 functions, the ones torch's CUDA kernels call (``tl.exp``
is approximate there). The CPU interpreter has no libdevice: it runs ``tl``'s (numpy's)."""


@triton.jit
def cos(x):
    if PRECISE:
        return libdevice.cos(x)
    else:
        return tl.cos(x)


@triton.jit
def sin(x):
    if PRECISE:
        return libdevice.sin(x)
    else:
        return tl.sin(x)


@triton.jit
def exp(x):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def rsqrt(x):
    if PRECISE:
        return libdevice.rsqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def add(a, b):
    """The sum's combine function (``tl.sum`` is this module's ``tl.reduce`` with it; tests reload
    this module under the interpreter, not Triton's own ``tl.sum``)."""
    return a + b


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to the nearest ``dtype`` value, ties to even (what torch's casts do; the
    CPU interpreter's float32-to-bf16 cast truncates, so bf16 is rounded here bit by bit)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def rope_kernel(
    t_ptr,
    freqs_ptr,
    positions_ptr,
    mscale,
    t_row_stride,
    t_head_stride,
    freqs_row_stride,
    heads: tl.constexpr,
    heads_pow2: tl.constexpr,
    dim: tl.constexpr,
):
    row = tl.program_id(0)
    position = tl.load(positions_ptr + row)
    head = tl.arange(0, heads_pow2)[:, None]
    d = tl.arange(0, dim)[None, :]
    half: tl.constexpr = dim // 2
    partner = tl.where(d < half, d + half, d - half)
    mask = (head < heads) & (d < dim)
    base = t_ptr + row * t_row_stride + head * t_head_stride
    x = tl.load(base + d, mask=mask, other=0.0)
    other = tl.load(base + partner, mask=mask, other=0.0)
    wide = other.to(tl.float32)  # negated in float32 (exact; the interpreter's bf16 has no negation)
    rotated = tl.where(d < half, -wide, wide)
    freq = tl.load(freqs_ptr + position * freqs_row_stride + d)
    cosine = rounded(cos(freq) * mscale, x.dtype)
    sine = rounded(sin(freq) * mscale, x.dtype)
    first = rounded(x.to(tl.float32) * cosine.to(tl.float32), x.dtype)
    second = rounded(rotated * sine.to(tl.float32), x.dtype)
    out = rounded(first.to(tl.float32) + second.to(tl.float32), x.dtype)
    tl.store(base + d, out, mask=mask)


@triton.jit
def swiglu_kernel(x_ptr, out_ptr, width: tl.constexpr, block: tl.constexpr):
    row = tl.program_id(0)
    column = tl.program_id(1) * block + tl.arange(0, block)
    mask = column < width
    gate = tl.load(x_ptr + row * 2 * width + column, mask=mask, other=0.0)
    linear = tl.load(x_ptr + row * 2 * width + width + column, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = rounded(tl.math.div_rn(g, 1.0 + exp(-g)), gate.dtype)
    out = rounded(silu.to(tl.float32) * linear.to(tl.float32), gate.dtype)
    tl.store(out_ptr + row * width + column, out, mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, eps, width: tl.constexpr, width_pow2: tl.constexpr):
    row = tl.program_id(0)
    column = tl.arange(0, width_pow2)
    mask = column < width
    x = tl.load(x_ptr + row * width + column, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + column, mask=mask, other=0.0).to(tl.float32)
    rstd = rsqrt(tl.math.div_rn(tl.reduce(x * x, 0, add), width * 1.0) + eps)  # IEEE division, as torch's
    tl.store(out_ptr + row * width + column, rounded(x * rstd * weight, out_ptr.dtype.element_ty), mask=mask)
