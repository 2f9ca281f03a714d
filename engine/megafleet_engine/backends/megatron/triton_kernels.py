# Triton kernels take untyped pointers and constexprs: mypy checks their wrappers in fused.py.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The Triton kernels of :mod:`.fused` (imported by it on first use: Triton is slow to import and
present on the GPU machines, with torch). Each is specified and tested through its wrapper in
:mod:`.fused`; launch them only through those."""

import os

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from triton.language.extra import libdevice  # type: ignore[import-untyped]
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # type: ignore[import-untyped]

PRECISE = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
"""On the GPU: libdevice's precise float32 functions, the ones torch's CUDA kernels call (``tl.exp``
is approximate there). The CPU interpreter has no libdevice: it runs ``tl``'s (numpy's)."""


@triton.jit
def dependent_launch():
    """The start of a kernel launched as a programmatic dependent launch that reads or writes
    nothing before the kernel before it is done: the next kernel may launch (its programs start
    where this one's leave room), then wait for the kernel before."""
    gdc_launch_dependents()
    gdc_wait()


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
def swiglu_kernel(x_ptr, out_ptr, width: tl.constexpr, block: tl.constexpr, pdl: tl.constexpr = False):
    if pdl:
        dependent_launch()
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
def halve(x, rows: tl.constexpr, half: tl.constexpr):
    """``x`` ``[rows, 2 * half]`` to ``[rows, half]``: column ``c`` plus column ``c + half`` (one
    rounding each: what one step of a CUDA warp's shuffle-down reduction adds)."""
    return tl.reduce(tl.reshape(x, [rows, 2, half]), 1, add)


@triton.jit
def torch_sum_of_squares(base, width: tl.constexpr, threads: tl.constexpr, rounds: tl.constexpr, fma: tl.constexpr):
    """The sum of the squares of ``width`` float32-widened values at ``base``, added in the order of
    torch's ``vectorized_layer_norm_kernel<T, float, rms_norm=true>`` (``compute_stats``): thread
    ``t`` of ``threads`` (warps of 32) squares and adds, from 0, the 4 values of each of its 4-wide
    vectors ``t, t + threads, ...`` in order (``sigma2 + val * val``, one fused multiply-add when
    ``fma``: nvcc contracts it); then each warp adds shuffle-down style (lane ``l`` + lane ``l + 16``,
    then ``+ 8``, ... ``+ 1``), then the warps pairwise (warp ``w`` + warp ``w + warps / 2``, ...)."""
    t = tl.arange(0, threads)
    acc = tl.full([threads], 0.0, tl.float32)  # tl.zeros is a jit function: the tests reload this module only
    for j in tl.static_range(rounds):
        vector = j * threads + t
        inside = vector < width // 4
        four = tl.load(base + vector[:, None] * 4 + tl.arange(0, 4)[None, :], mask=inside[:, None], other=0.0)
        even, odd = tl.split(tl.reshape(four.to(tl.float32), [threads, 2, 2]))  # values 0, 2 and 1, 3
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        if fma:
            acc = tl.fma(v3, v3, tl.fma(v2, v2, tl.fma(v1, v1, tl.fma(v0, v0, acc))))
        else:
            acc = acc + v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3
    warps: tl.constexpr = threads // 32
    lanes = tl.reshape(acc, [warps, 32])
    lanes = halve(lanes, warps, 16)
    lanes = halve(lanes, warps, 8)
    lanes = halve(lanes, warps, 4)
    lanes = halve(lanes, warps, 2)
    lanes = halve(lanes, warps, 1)
    total = tl.reshape(lanes, [1, warps])
    if warps >= 16:
        total = halve(total, 1, 8)
    if warps >= 8:
        total = halve(total, 1, 4)
    if warps >= 4:
        total = halve(total, 1, 2)
    if warps >= 2:
        total = halve(total, 1, 1)
    return tl.reshape(total, [1])


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    eps,
    width: tl.constexpr,
    width_pow2: tl.constexpr,
    threads: tl.constexpr,
    rounds: tl.constexpr,
    fma: tl.constexpr,
    with_residual: tl.constexpr,
    pdl: tl.constexpr = False,
):
    """One row: ``out = weight * (rstd * x)``, ``rstd = rsqrt(sum(x**2) / width + eps)`` with the sum in
    torch's order (:func:`torch_sum_of_squares`). With ``with_residual``, ``x`` is first
    ``x + residual`` rounded to ``x``'s dtype (torch's bf16 add), written to ``sum_ptr``."""
    if pdl:
        dependent_launch()
    row = tl.program_id(0)
    column = tl.arange(0, width_pow2)
    mask = column < width
    source = x_ptr + row * width
    if with_residual:
        a = tl.load(x_ptr + row * width + column, mask=mask, other=0.0)
        b = tl.load(residual_ptr + row * width + column, mask=mask, other=0.0)
        tl.store(sum_ptr + row * width + column, rounded(a.to(tl.float32) + b.to(tl.float32), a.dtype), mask=mask)
        tl.debug_barrier()
        source = sum_ptr + row * width
    sum_of_squares = torch_sum_of_squares(source, width, threads, rounds, fma)
    rstd = rsqrt(tl.math.div_rn(sum_of_squares, width * 1.0) + eps)  # IEEE division, as torch's
    x = tl.load(source + column, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + column, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + column, rounded(weight * (rstd * x), out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_heads(
    src,
    freqs_ptr,
    position,
    mscale,
    rotate,
    group_stride,
    head_stride,
    heads: tl.constexpr,
    heads_pow2: tl.constexpr,
    per_group: tl.constexpr,
    dim: tl.constexpr,
):
    """The ``heads`` heads of one row at ``src`` (head ``h`` at ``(h // per_group) * group_stride +
    (h % per_group) * head_stride``), rotated as :func:`rope_kernel` does when ``rotate``, else as
    they are; returns them ``[heads_pow2, dim]`` and the mask of real heads."""
    head = tl.arange(0, heads_pow2)[:, None]
    d = tl.arange(0, dim)[None, :]
    half: tl.constexpr = dim // 2
    partner = tl.where(d < half, d + half, d - half)
    mask = (head < heads) & (d < dim)
    base = src + (head // per_group) * group_stride + (head % per_group) * head_stride
    x = tl.load(base + d, mask=mask, other=0.0)
    other = tl.load(base + partner, mask=mask, other=0.0)
    wide = other.to(tl.float32)
    rotated = tl.where(d < half, -wide, wide)
    freq = tl.load(freqs_ptr + position * dim + d)
    cosine = rounded(cos(freq) * mscale, x.dtype)
    sine = rounded(sin(freq) * mscale, x.dtype)
    first = rounded(x.to(tl.float32) * cosine.to(tl.float32), x.dtype)
    second = rounded(rotated * sine.to(tl.float32), x.dtype)
    out = rounded(first.to(tl.float32) + second.to(tl.float32), x.dtype)
    return tl.where(rotate, out, x), mask


@triton.jit
def qkv_rope_append_kernel(
    q_src_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    freqs_ptr,
    q_positions_ptr,
    k_positions_ptr,
    block_idx_ptr,
    local_pos_ptr,
    mscale,
    rotated_rows,
    q_row_stride,
    q_group_stride,
    k_row_stride,
    k_head_stride,
    v_row_stride,
    v_head_stride,
    cache_block_stride,
    cache_pos_stride,
    cache_head_stride,
    q_heads: tl.constexpr,
    q_heads_pow2: tl.constexpr,
    q_per_group: tl.constexpr,
    kv_heads: tl.constexpr,
    kv_heads_pow2: tl.constexpr,
    dim: tl.constexpr,
    with_q: tl.constexpr,
    with_kv: tl.constexpr,
    kv_part: tl.constexpr,
    pdl: tl.constexpr = False,
):
    """One token row, one part (``program_id(1)``: the query is part 0, the key and value part
    ``kv_part``, so the two run side by side): (``with_q``) its query heads, read from the qkv
    GEMM's grouped output, rotated (rows ``< rotated_rows``; the others copied) into the contiguous
    ``q_out`` ``[rows, q_heads, dim]``; (``with_kv``, rows ``< rotated_rows``) its key heads rotated
    and, with its value heads, written to the paged KV cache at (``block_idx[row]``,
    ``local_pos[row]``), what megatron's
    ``_append_kv_cache_kernel`` writes. Frequencies ``freqs`` ``[positions, dim]`` float32, rows
    ``q_positions[row]`` and ``k_positions[row]``."""
    if pdl:
        dependent_launch()
    row = tl.program_id(0)
    part = tl.program_id(1)
    rotate = row < rotated_rows
    if with_q and part == 0:
        q_position = tl.load(q_positions_ptr + row, mask=rotate, other=0)
        q, q_mask = rope_heads(
            q_src_ptr + row * q_row_stride,
            freqs_ptr,
            q_position,
            mscale,
            rotate,
            q_group_stride,
            dim,
            q_heads,
            q_heads_pow2,
            q_per_group,
            dim,
        )
        q_head = tl.arange(0, q_heads_pow2)[:, None]
        q_d = tl.arange(0, dim)[None, :]
        tl.store(q_out_ptr + row * q_heads * dim + q_head * dim + q_d, q, mask=q_mask)
    if with_kv:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if rotate and part == kv_part:
            k_position = tl.load(k_positions_ptr + row)
            k, k_mask = rope_heads(
                k_ptr + row * k_row_stride,
                freqs_ptr,
                k_position,
                mscale,
                rotate,
                0,
                k_head_stride,
                kv_heads,
                kv_heads_pow2,
                kv_heads,
                dim,
            )
            kv_head = tl.arange(0, kv_heads_pow2)[:, None]
            kv_d = tl.arange(0, dim)[None, :]
            v = tl.load(v_ptr + row * v_row_stride + kv_head * v_head_stride + kv_d, mask=k_mask, other=0.0)
            block = tl.load(block_idx_ptr + row).to(tl.int64)
            slot = tl.load(local_pos_ptr + row).to(tl.int64)
            destination = block * cache_block_stride + slot * cache_pos_stride + kv_head * cache_head_stride + kv_d
            tl.store(key_cache_ptr + destination, k, mask=k_mask)
            tl.store(value_cache_ptr + destination, v, mask=k_mask)


@triton.jit
def maximum(a, b):
    """The max reduction's combine function (``tl.max`` is a jit function: see :func:`add`)."""
    return tl.maximum(a, b)


@triton.jit
def decode_attention_split_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seqlens_ptr,
    partial_ptr,
    stats_ptr,
    scale_log2,
    q_row_stride,
    q_head_stride,
    table_row_stride,
    cache_block_stride,
    cache_pos_stride,
    cache_head_stride,
    per_group: tl.constexpr,
    per_group_pow2: tl.constexpr,
    dim: tl.constexpr,
    block_size: tl.constexpr,
    block_n: tl.constexpr,
    splits: tl.constexpr,
    pdl: tl.constexpr = False,
):
    """One (request, KV head, split): the split's share of the request's keys (``seqlens[request]``
    of them, paged by ``block_table``), attended by the KV head's ``per_group`` query heads of the
    request's one query token; writes the unnormalised output ``partial`` ``[request, head, split,
    dim]`` (float32) and the running max and sum ``stats`` ``[request, head, split, 2]`` (base 2)."""
    if pdl:
        dependent_launch()
    request = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    seqlen = tl.load(seqlens_ptr + request)
    per_split = (seqlen + splits - 1) // splits  # tl.cdiv is a jit function: see add()
    chunk = (per_split + block_n - 1) // block_n * block_n
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    h = tl.arange(0, per_group_pow2)
    d = tl.arange(0, dim)
    head_ok = h < per_group
    head = group * per_group + h
    q = tl.load(
        q_ptr + request * q_row_stride + head[:, None] * q_head_stride + d[None, :], mask=head_ok[:, None], other=0.0
    )
    q = q.to(tl.float32) * scale_log2
    m = tl.full([per_group_pow2], float("-inf"), tl.float32)
    total = tl.full([per_group_pow2], 0.0, tl.float32)
    acc = tl.full([per_group_pow2, dim], 0.0, tl.float32)
    for first in range(start, end, block_n):
        t = first + tl.arange(0, block_n)
        valid = t < end
        block = tl.load(block_table_ptr + request * table_row_stride + t // block_size, mask=valid, other=0).to(
            tl.int64
        )
        offset = block * cache_block_stride + (t % block_size) * cache_pos_stride + group * cache_head_stride
        k = tl.load(key_cache_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.reduce(q[:, None, :] * k[None, :, :], 2, add)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(scores, 1, maximum))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        total = total * alpha + tl.reduce(p, 1, add)
        v = tl.load(value_cache_ptr + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.reduce(p[:, :, None] * v[None, :, :], 1, add)
        m = m_new
    heads = tl.num_programs(1) * per_group
    row = (request * heads + head) * splits + split
    tl.store(partial_ptr + row[:, None] * dim + d[None, :], acc, mask=head_ok[:, None])
    tl.store(stats_ptr + row * 2, m, mask=head_ok)
    tl.store(stats_ptr + row * 2 + 1, total, mask=head_ok)


@triton.jit
def decode_attention_combine_kernel(
    partial_ptr, stats_ptr, out_ptr, dim: tl.constexpr, splits: tl.constexpr, pdl: tl.constexpr = False
):
    """One (request, query head): the splits' partial outputs weighed by their maxima and sums,
    rounded to ``out``'s dtype (``out`` ``[request, head, dim]``, contiguous)."""
    if pdl:
        dependent_launch()
    request = tl.program_id(0)
    head = tl.program_id(1)
    row = request * tl.num_programs(1) + head
    s = tl.arange(0, splits)
    d = tl.arange(0, dim)
    m = tl.load(stats_ptr + (row * splits + s) * 2)
    total = tl.load(stats_ptr + (row * splits + s) * 2 + 1)
    top = tl.reduce(m, 0, maximum)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(m - top)
    denominator = tl.reduce(weight * total, 0, add)
    partial = tl.load(partial_ptr + (row * splits + s)[:, None] * dim + d[None, :])
    numerator = tl.reduce(weight[:, None] * partial, 0, add)
    out = numerator / tl.where(denominator > 0, denominator, 1.0)  # no keys: zeros (numerator 0)
    tl.store(out_ptr + row * dim + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n,
    x_row_stride,
    out_row_stride,
    k: tl.constexpr,
    rows: tl.constexpr,
    rows_pow2: tl.constexpr,
    block_n: tl.constexpr,
    block_k: tl.constexpr,
    gated: tl.constexpr,
    pdl: tl.constexpr,
    ahead: tl.constexpr = 1,
):
    """``out[r, j] = sum_i x[r, i] * w[j, i]`` for the ``rows`` rows of ``x`` and the ``block_n``
    output columns ``j`` of this program (float32 sums, rounded once), reading ``w`` ``[n, k]`` once,
    ``ahead`` (1 or 2) ``[block_n, block_k]`` tiles ahead of the one being multiplied. With ``gated``, ``w`` is ``[2n,
    k]`` (gate rows, then linear rows) and ``out[r, j]`` is :func:`swiglu_kernel`'s value of the
    two rounded sums ``j`` and ``n + j`` (the program reads both rows). With ``pdl`` (a
    programmatic dependent launch): the next kernel may start once every program has started, and
    the first weight tile is read before waiting for the kernel before (nothing this kernel reads
    or writes but the weights is touched before the wait)."""
    if pdl:
        gdc_launch_dependents()
    program = tl.program_id(0)
    pieces: tl.constexpr = 2 if gated else 1
    tile_rows = tl.arange(0, pieces * block_n)
    inside = program * block_n + tile_rows % block_n < n
    weight_rows = program * block_n + tile_rows % block_n + (tile_rows // block_n) * n
    inner = tl.arange(0, block_k)
    row = tl.arange(0, rows_pow2)
    tile = w_ptr + weight_rows[:, None].to(tl.int64) * k + inner[None, :]
    w = tl.load(tile, mask=inside[:, None] & (inner < k)[None, :], other=0.0, eviction_policy="evict_first")
    if ahead == 2:
        later = tl.load(
            tile + block_k,
            mask=inside[:, None] & (block_k + inner < k)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    if pdl:
        gdc_wait()
    acc = tl.full([rows_pow2, pieces * block_n, block_k], 0.0, tl.float32)
    for start in range(0, k, block_k):
        next_start = start + ahead * block_k
        ahead_mask = inside[:, None] & (next_start + inner < k)[None, :]
        w_next = tl.load(tile + next_start, mask=ahead_mask, other=0.0, eviction_policy="evict_first")
        at = start + inner
        valid = (row < rows)[:, None] & (at < k)[None, :]
        x = tl.load(x_ptr + row[:, None] * x_row_stride + at[None, :], mask=valid, other=0.0).to(tl.float32)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        if ahead == 2:
            w = later
            later = w_next
        else:
            w = w_next
    total = tl.reduce(acc, 2, add)
    dtype = out_ptr.dtype.element_ty
    if gated:
        gate, linear = tl.split(tl.permute(tl.reshape(total, [rows_pow2, 2, block_n]), [0, 2, 1]))
        g = rounded(gate, dtype).to(tl.float32)
        silu = rounded(tl.math.div_rn(g, 1.0 + exp(-g)), dtype)
        result = rounded(silu.to(tl.float32) * rounded(linear, dtype).to(tl.float32), dtype)
    else:
        result = rounded(total, dtype)
    columns = program * block_n + tl.arange(0, block_n)
    tl.store(
        out_ptr + row[:, None] * out_row_stride + columns[None, :],
        result,
        mask=(row < rows)[:, None] & (columns < n)[None, :],
    )
