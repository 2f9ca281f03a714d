"""Fused Triton kernels for megatron's ``local`` layer implementation, and :func:`install`, which
swaps them into a built ``GPTModel`` and its dynamic inference context.

Why: on an H200 a batch-1 decode step of the Llama-3.1-8B shape was GPU-bound at 6.3 ms, ~2.4 ms of
it in ~1,230 small kernels per step (``bench/HISTORY.md``, ``engine_megatron.py``): RoPE alone is ~20 kernels per layer
(index, cos, sin, casts, neg, cat, two muls, add, copies, for q and for k) and SwiGLU 3 (silu,
``x_linear + 0.0``, mul). Here each is one kernel:

* :func:`rope_` applies megatron's unfused rotary embedding (``rope_utils._apply_rotary_pos_emb_bshd``,
  not interleaved) to the rows of q or k in place, gathering each row's frequencies by its position;
* :func:`swiglu` is megatron's unfused gated SiLU (``MLP.forward``'s ``glu``);
* :func:`rms_norm` is torch's RMSNorm in one kernel per row, adding the squares in the order of
  torch's CUDA kernel; with a residual it first does the layer's residual add
  (:func:`_defer_residual_add` leaves the add to the norm after it);
* :func:`qkv_rope_append` does the query's copy out of the qkv GEMM's output, RoPE on q and k and
  the KV-cache append in one kernel (:func:`_fused_qkv`, :func:`_fused_context_rope`);
* :func:`decode_attention` (only with :attr:`FusedKernels.attention`) replaces FlashAttention in
  one-request decode steps;
* :func:`gemv` (only with :attr:`FusedKernels.gemv`) replaces megatron's cuBLAS GEMMs in one-token
  steps (batch-1 decode), fc1 with the SwiGLU in its kernel; with :attr:`FusedKernels.pdl` every
  kernel here is a programmatic dependent launch (:func:`_pdl`), so the next GEMV's weights stream
  while the kernel before it drains.

Exactness: :func:`rope_`, :func:`swiglu` and :func:`qkv_rope_append` round to bf16/fp16 where
megatron's op-by-op version does (after cos/sin, each product, the sum; after silu, after the
product) and use the same precise float32 functions (libdevice ``cos``/``sin``/``exp``, IEEE
division); :func:`rms_norm` adds in torch's order with torch's roundings; so their outputs are
bitwise the unfused ones' (``tests/engine/test_fused_kernels.py`` checks that on the CPU
interpreter, ``tests/gpu/test_gpu_megatron.py`` on the GPU); dependent launches change no result.
:func:`decode_attention` and :func:`gemv` sum in another order than FlashAttention and cuBLAS:
within bf16 rounding, not bitwise.

Who calls: :func:`.build.build_engine` (through :func:`install`) before megatron's engine captures
its decode CUDA graphs, so the graphs hold these kernels. The modules keep their parameters (the
norms' weights are the same ``Parameter`` objects), so refits write what the graphs read.
Triton is imported on first use (the GPU machines have it with torch; tests run it under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import torch

__all__ = ["INSTALLED", "FusedKernels", "gemv", "install", "rms_norm", "rope_", "swiglu"]

INSTALLED = "megafleet_fused_kernels"
"""The model attribute :func:`install` sets: how many modules each kernel replaced."""

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """Which fused kernels :func:`install` swaps in."""

    rope_swiglu: bool = True
    """RoPE on q and k and the gated SiLU (bitwise megatron's unfused ops)."""
    rms_norm: bool = True
    """The RMSNorms (one kernel per row, the squares added in torch's order: bitwise torch's)."""
    residual_add: bool = True
    """Each residual add into the RMSNorm after it (:func:`_defer_residual_add`; bitwise torch's add
    and norm): within a layer always, across layers (the MLP's add into the next layer's input
    norm) only with ``across_layers``. Needs ``rms_norm``."""
    across_layers: bool = False
    """Whether the layers run in one graph or eagerly (the build sets it for block graphs), so an
    add may be left to the next layer's norm."""
    attention: bool = False
    """The decode steps' attention of up to :data:`DECODE_ATTENTION_MAX_REQUESTS` requests through
    :func:`decode_attention` instead of FlashAttention (not bitwise: another summation order)."""
    qkv: bool = True
    """The query's copy out of the qkv GEMM's output, its RoPE, the key's RoPE and the KV-cache
    append as one kernel per layer (:func:`qkv_rope_append`; bitwise the ops it replaces)."""
    gemv: bool = False
    """The linear layers (qkv, proj, fc1 with the SwiGLU, fc2, the output layer) of steps of at most
    :data:`GEMV_MAX_ROWS` tokens through :func:`gemv` instead of megatron's cuBLAS GEMM (one tensor
    parallel rank; not bitwise: another summation order)."""
    pdl: bool = False
    """The fused kernels launched as programmatic dependent launches (:func:`_pdl`; bitwise the
    same results)."""


def _kernels() -> Any:
    """The Triton kernels' module, imported on first use (``tests`` reload it to run the kernels
    under ``TRITON_INTERPRET=1``, which Triton reads when a kernel is defined)."""
    return importlib.import_module("megafleet_engine.backends.megatron.triton_kernels")


def _pdl(pdl: bool) -> dict[str, bool]:
    """The launch arguments of a kernel with a ``pdl`` parameter: with ``pdl``, a programmatic
    dependent launch (Hopper and later; CUDA graphs keep the dependency): the kernel lets the next
    one start as soon as all of its programs have started, and waits for the one before it before
    it reads or writes anything (:func:`gemv` reads its first weight tile before), so kernel
    boundaries overlap instead of draining the GPU (:attr:`FusedKernels.pdl`)."""
    return {"pdl": True, "launch_pdl": True} if pdl else {}


def rope_(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Rotate ``t`` ``[n, 1, heads, dim]`` (any strides, last one 1) in place by the rotary
    frequencies ``freqs`` ``[max_positions, 1, 1, dim]`` (float32) of each row's position
    ``positions`` ``[n]``: megatron's ``t * cos + rotate_half(t) * sin`` (not interleaved), with
    ``cos``/``sin`` scaled by ``mscale``. Returns ``t``."""
    n, _, heads, dim = t.shape
    if n == 0:
        return t
    if t.stride(3) != 1 or freqs.stride(3) != 1 or freqs.shape[-1] != dim or dim & (dim - 1):
        raise ValueError(f"rope_: unsupported layout t {tuple(t.shape)}/{t.stride()} freqs {tuple(freqs.shape)}")
    kernels = _kernels()
    kernels.rope_kernel[(n,)](
        t,
        freqs,
        positions,
        float(mscale),
        t.stride(0),
        t.stride(2),
        freqs.stride(0),
        heads=heads,
        heads_pow2=kernels.triton.next_power_of_2(heads),
        dim=dim,
        enable_fp_fusion=False,
    )
    return t


def swiglu(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * linear`` of ``x = [..., 2 * width]`` (contiguous), ``gate, linear`` its halves
    (``pdl``: :func:`_pdl`)."""
    if not x.is_contiguous():
        x = x.contiguous()
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * width) if width else 0
    if rows:
        block = 1024
        _kernels().swiglu_kernel[(rows, -(-width // block))](
            x, out, width=width, block=block, enable_fp_fusion=False, **_pdl(pdl)
        )
    return out


TORCH_NORM_THREADS = 128
"""Threads per row of torch's ``vectorized_layer_norm_kernel`` (``num_threads()``, 4 warps on CUDA):
:func:`rms_norm` adds the squares in the order these threads do."""
TORCH_NORM_FMA = True
"""Whether torch's per-thread ``sigma2 + val * val`` is one fused multiply-add (nvcc contracts it)."""


def torch_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch would normalise ``x`` with its vectorized kernel (the order :func:`rms_norm`
    reproduces): a float32/bf16/fp16 row of a multiple of 4 values (at most 2**24), ``x`` and
    ``weight`` 16-byte aligned, both contiguous, the same dtype."""
    width = x.shape[-1]
    return (
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and 0 < width <= 1 << 24
        and width % 4 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.rms_norm(x, (width,), weight, eps)`` over the last dimension, bitwise
    torch's CUDA result where :func:`torch_norm_fits` (the sum of squares in its threads' order,
    :data:`TORCH_NORM_THREADS`; then ``weight * (rstd * x)`` in float32, rounded once).
    With ``residual``: ``s = x + residual`` (rounded to the dtype, as torch's add) is normalised
    and ``(normed, s)`` returned (one kernel for the residual add and the norm); ``s`` is written to
    ``total`` if given (it may be ``x`` itself: the add in place, as megatron's). ``pdl``: :func:`_pdl`."""
    if not x.is_contiguous():
        x = x.contiguous()
    width = x.shape[-1]
    out = torch.empty_like(x)
    if residual is None:
        total = out
    elif total is None:
        total = torch.empty_like(x)
    rows = x.numel() // width if width else 0
    if rows:
        kernels = _kernels()
        threads = TORCH_NORM_THREADS
        kernels.rms_norm_kernel[(rows,)](
            x,
            residual.contiguous() if residual is not None else x,
            weight,
            out,
            total,
            float(eps),
            width=width,
            width_pow2=kernels.triton.next_power_of_2(width),
            threads=threads,
            rounds=-(-width // (4 * threads)),
            fma=TORCH_NORM_FMA,
            with_residual=residual is not None,
            enable_fp_fusion=False,
            num_warps=4,
            **_pdl(pdl),
        )
    return (out, total) if residual is not None else out


@dataclasses.dataclass
class _ResidualState:
    """A residual add left for the next norm (:func:`_defer_residual_add`): megatron's add of the
    residual into the attention's or MLP's output ``x`` (in place), not yet done."""

    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    """(``x``, residual): ``x`` is to become ``x + residual``."""

    def settle(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pending add, taken (``None``: none)."""
        pending, self.pending = self.pending, None
        return pending


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of the same values (megatron re-wraps tensors: no identity)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class FusedRMSNorm(torch.nn.Module):
    """A drop-in for the ``torch.nn.RMSNorm`` it replaces, holding the same weight ``Parameter``:
    :func:`rms_norm` where torch would run its vectorized kernel, torch's own op otherwise; with a
    ``residual`` state, it first completes an add left for it (in the same kernel when it can)."""

    def __init__(self, replaced: torch.nn.RMSNorm, residual: _ResidualState | None = None, pdl: bool = False) -> None:
        super().__init__()
        self.pdl = pdl
        self.weight = replaced.weight
        self.eps = replaced.eps if replaced.eps is not None else torch.finfo(replaced.weight.dtype).eps
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = self.residual.settle() if self.residual is not None else None
        if pending is not None and not (_same(pending[0], x) and torch_norm_fits(x, self.weight)):
            pending[0].add_(pending[1])  # megatron's own in-place add, then the norm alone
            pending = None
        if not torch_norm_fits(x, self.weight):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if pending is not None:
            normed, _ = rms_norm(x, self.weight, self.eps, residual=pending[1], total=x, pdl=self.pdl)
            return normed
        plain = rms_norm(x, self.weight, self.eps, pdl=self.pdl)
        assert isinstance(plain, torch.Tensor)
        return plain


def _defer_residual_add(original: Any, state: _ResidualState) -> Any:
    """A layer's ``self_attn_bda``/``mlp_bda`` (megatron's bias-dropout-add, called as
    ``bda(training, fused)(x_with_bias, residual, prob)``): in inference without a bias, where
    megatron adds the residual into ``x`` in place and returns ``x``, it returns ``x`` as it is and
    leaves the add to the next :class:`FusedRMSNorm` (one kernel for both; nothing reads ``x``
    in between in megatron's layer)."""

    def bda(training: bool, fused: bool) -> Any:
        function = original(training, fused)

        def deferred(x_with_bias: Any, residual: torch.Tensor, prob: float) -> torch.Tensor:
            x: torch.Tensor = x_with_bias[0]
            bias = x_with_bias[1]
            plain = not training and bias is None and not x.requires_grad and not residual.requires_grad
            if not (plain and x.dtype == residual.dtype and x.shape == residual.shape and x.is_contiguous()):
                result: torch.Tensor = function(x_with_bias, residual, prob)
                return result
            earlier = state.settle()
            if earlier is not None:  # never left unconsumed in megatron's order; done if it were
                earlier[0].add_(earlier[1])
            state.pending = (x, residual)
            return x

        return deferred

    return bda


def _fused_mlp_forward(mlp: Any, original: Any, kernels: FusedKernels) -> Any:
    """``MLP.forward`` for a dense gated-SiLU MLP without biases: fc1, :func:`swiglu`, fc2; with
    :attr:`FusedKernels.gemv`, steps of at most :data:`GEMV_MAX_ROWS` tokens run fc1 and the SwiGLU
    as one :func:`gemv` (``gated``; fc1 is megatron's plain linear on one rank)."""
    fc1 = mlp.linear_fc1

    def forward(hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if per_token_scale is not None:
            return original(hidden_states, per_token_scale, **kwargs)
        if kernels.gemv and _gemv_takes(hidden_states, fc1.weight) and type(fc1).__name__ == "ColumnParallelLinear":
            return mlp.linear_fc2(gemv(hidden_states, fc1.weight, gated=True, pdl=kernels.pdl))
        intermediate, bias = fc1(hidden_states)
        assert bias is None, "install() patches MLPs without biases only"
        return mlp.linear_fc2(swiglu(intermediate, pdl=kernels.pdl))

    return forward


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether a linear layer's product ``x @ weight.T`` goes to :func:`gemv`: at most
    :data:`GEMV_MAX_ROWS` rows, nothing that needs a gradient, a layout :func:`gemv_fits`."""
    width = x.shape[-1] if x.dim() else 0
    rows = x.numel() // width if width else 0
    return (
        weight is not None
        and 0 < rows <= GEMV_MAX_ROWS
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and gemv_fits(x, weight)
    )


def _gemv_linear(linear: Any, pdl: bool) -> None:
    """Route one megatron ``ColumnParallelLinear``/``RowParallelLinear`` (one rank: no
    communication in its product) to :func:`gemv` for the steps :func:`_gemv_takes`: its
    ``_forward_impl`` (megatron's ``input @ weight.t()`` (+ bias)); every other call to megatron's."""
    original = linear._forward_impl

    def forward_impl(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if bias is not None or kwargs.get("sequence_parallel") or not _gemv_takes(input, weight):
            return original(input=input, weight=weight, bias=bias, **kwargs)
        return gemv(input, weight, pdl=pdl)

    linear._forward_impl = forward_impl


def _fused_context_rope(context: Any, state: _QkvState | None, pdl: bool = False) -> None:
    """The dynamic context's ``apply_rotary_emb_query``/``_key`` through :func:`rope_` (in place),
    for every step kind (their positions come from the context's GPU view, as megatron's do); with
    ``state`` (the qkv fold, :func:`_fused_qkv`), the key's RoPE is deferred to the KV append, which
    also fills and rotates the query, in one :func:`qkv_rope_append`."""

    original_query, original_key = context.apply_rotary_emb_query, context.apply_rotary_emb_key
    original_append = context.append_key_value_cache

    def fill_query(q: torch.Tensor, rotated_rows: int, emb: torch.Tensor, mscale: float) -> bool:
        """Fill the deferred query buffer ``q`` (rotating ``rotated_rows`` rows); False: not deferred."""
        if state is None or state.query is None or not _same(state.query[0], q):
            return False
        query, state.query = state.query, None
        n = context.padded_active_token_count
        qkv_rope_append(query, None, emb, context.gpu_view.token_to_pos_ids[:n], emb, rotated_rows, mscale, pdl)
        return True

    def query(
        q: torch.Tensor, emb: torch.Tensor, config: Any, cu_seqlens: Any, cp_group: Any, mscale: float = 1.0
    ) -> torch.Tensor:
        if state is not None and state.done is not None and _same(state.done[0][0], q):
            (filled, done_emb, done_mscale), state.done = state.done, None
            if done_emb is emb and done_mscale == mscale:
                return q  # the append filled and rotated it with these frequencies
            state.query = filled  # other frequencies than the key's: fill it again below
        if emb.dtype != torch.float32 or cu_seqlens is not None or not emb.is_contiguous():
            fill_query(q, 0, emb, mscale)  # copied only: megatron's own RoPE follows
            unfused: torch.Tensor = original_query(q, emb, config, cu_seqlens, cp_group, mscale=mscale)
            return unfused
        n = context.padded_active_token_count
        if not fill_query(q, n, emb, mscale):
            rope_(q[:n], emb, context.gpu_view.token_to_pos_ids[:n], mscale)
        return q

    def key(k: torch.Tensor, emb: torch.Tensor, config: Any, cp_group: Any, mscale: float = 1.0) -> torch.Tensor:
        if emb.dtype != torch.float32:
            unfused: torch.Tensor = original_key(k, emb, config, cp_group, mscale=mscale)
            return unfused
        n = context.padded_active_token_count
        if state is not None and state.active and emb.is_contiguous():
            state.key = (emb, mscale)  # rotated by the append
        else:
            rope_(k[:n], emb, context.gpu_view.token_to_position_in_request[:n], mscale)
        return k[:n] if context.is_decode_only() else k

    def append(layer_number: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if state is None or state.key is None:
            original_append(layer_number, k, v)
            return
        (emb, mscale), state.key = state.key, None
        n = context.padded_active_token_count
        layer = context.layer_map[layer_number - 1]
        query = state.query
        if query is not None:
            state.query, state.done = None, (query, emb, mscale)
        qkv_rope_append(
            query,
            (
                k,
                v,
                context.memory_buffer[0, layer],
                context.memory_buffer[1, layer],
                context.gpu_view.token_to_block_idx[:n],
                context.gpu_view.token_to_local_position_within_kv_block[:n],
            ),
            emb,
            context.gpu_view.token_to_pos_ids[:n],
            context.gpu_view.token_to_position_in_request[:n],
            n,
            mscale,
            pdl,
        )

    context.apply_rotary_emb_query = query
    context.apply_rotary_emb_key = key
    context.append_key_value_cache = append


def qkv_rope_append(
    query: tuple[torch.Tensor, torch.Tensor] | None,
    key_value: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    freqs: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    rotated_rows: int,
    mscale: float = 1.0,
    pdl: bool = False,
) -> None:
    """One kernel for what megatron runs as four per layer (the query's reshape copy, RoPE on q,
    RoPE on k, the KV-cache append), bitwise the same results:

    * ``query = (out, grouped)``: ``grouped`` ``[rows, 1, groups, per_group * dim]`` (the qkv GEMM's
      output split, any row and group strides) is written to ``out`` ``[rows, 1, groups *
      per_group, dim]`` (contiguous), rows ``< rotated_rows`` rotated by ``freqs[q_positions[row]]``;
    * ``key_value = (key, value, key_cache, value_cache, block_idx, local_pos)``: rows ``<
      rotated_rows`` of ``key`` ``[rows, 1, kv_heads, dim]`` rotated by ``freqs[k_positions[row]]``
      and ``value`` are written to the caches ``[blocks, block_size, kv_heads, dim]`` at
      ``(block_idx[row], local_pos[row])``.

    ``freqs`` ``[positions, 1, 1, dim]`` float32, contiguous; ``cos``/``sin`` scaled by ``mscale``;
    ``pdl``: :func:`_pdl`."""
    if query is None and key_value is None:
        return
    kernels = _kernels()
    dim = freqs.shape[-1]
    dummy = freqs
    q_out, grouped = query if query is not None else (dummy, dummy)
    key, value, key_cache, value_cache, block_idx, local_pos = (
        key_value if key_value is not None else (dummy, dummy, dummy, dummy, q_positions, q_positions)
    )
    q_heads = q_out.shape[2] if query is not None else 1
    groups = grouped.shape[2] if query is not None else 1
    kv_heads = key.shape[2] if key_value is not None else 1
    rows = q_out.shape[0] if query is not None else rotated_rows
    if rows == 0:
        return
    if not freqs.is_contiguous() or dim & (dim - 1) or (query is not None and not q_out.is_contiguous()):
        raise ValueError("qkv_rope_append: unsupported layout")
    parts = (query is not None) + (key_value is not None)
    kernels.qkv_rope_append_kernel[(rows, parts)](
        grouped,
        q_out,
        key,
        value,
        key_cache,
        value_cache,
        freqs,
        q_positions,
        k_positions,
        block_idx,
        local_pos,
        float(mscale),
        rotated_rows,
        grouped.stride(0) if query is not None else 0,
        grouped.stride(2) if query is not None else 0,
        key.stride(0) if key_value is not None else 0,
        key.stride(2) if key_value is not None else 0,
        value.stride(0) if key_value is not None else 0,
        value.stride(2) if key_value is not None else 0,
        key_cache.stride(0) if key_value is not None else 0,
        key_cache.stride(1) if key_value is not None else 0,
        key_cache.stride(2) if key_value is not None else 0,
        q_heads=q_heads,
        q_heads_pow2=kernels.triton.next_power_of_2(q_heads),
        q_per_group=q_heads // groups,
        kv_heads=kv_heads,
        kv_heads_pow2=kernels.triton.next_power_of_2(kv_heads),
        dim=dim,
        with_q=query is not None,
        with_kv=key_value is not None,
        kv_part=parts - 1,
        enable_fp_fusion=False,
        **_pdl(pdl),
    )


GEMV_MAX_ROWS = 1
"""Linear layers of at most this many rows (tokens) go through :func:`gemv` (with
:attr:`FusedKernels.gemv`); more rows stay with megatron's GEMM (cuBLAS)."""


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """How :func:`gemv` splits one linear layer: ``block_n`` output columns per program, the weights
    read ``block_k`` columns at a time, ``ahead`` tiles ahead of the one multiplied, ``warps``
    warps per program."""

    block_n: int = 4
    block_k: int = 512
    warps: int = 4
    ahead: int = 1


GEMV_CONFIGS: dict[tuple[int, int, bool], GemvConfig] = {}
"""Configs measured on this process's GPU by weight shape and ``gated`` (``bench/gemv_probe.py
--tune``, which ``bench/engine_megatron.py --tune-gemv`` runs before it builds its models): they
take precedence over :func:`gemv_config`'s table."""


def gemv_config(n: int, k: int, rows: int, gated: bool = False) -> GemvConfig:
    """The :class:`GemvConfig` for an ``[n, k]`` weight and ``rows`` rows: the fastest of
    ``bench/gemv_probe.py``'s sweeps at one row on an H200 for each of the Llama-3.1-8B shapes
    (alone: ``bench/results/gemv-probe-h200-2026-12-02.json``; after a norm with dependent
    launches, ``--tune``: ``…-tuned.json``, which chose these), by the shape's kind."""
    if n >= 16 * k:  # an output layer (128256 x 4096: 4.27 TB/s)
        return GemvConfig(block_n=8, block_k=256, warps=4)
    if k >= 2 * n:  # fc2 (4096 x 14336: 3.74 TB/s)
        return GemvConfig(block_n=8, block_k=512, warps=8)
    if n >= 4 * k:  # fc1 (28672 x 4096: 3.72 TB/s; with its SwiGLU: 3.74 TB/s)
        return GemvConfig(block_n=2, block_k=512 if gated else 1024, warps=4)
    if n > k:  # qkv (6144 x 4096: 3.19 TB/s)
        return GemvConfig(block_n=4, block_k=256, warps=4)
    return GemvConfig(block_n=8, block_k=512, warps=4, ahead=2)  # proj (4096 x 4096)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    gated: bool = False,
    pdl: bool = False,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` for a few rows: ``x`` ``[..., k]`` (rows: the leading dimensions' product),
    ``weight`` ``[n, k]`` contiguous, the same dtype; returns ``[..., n]``. Each output is one
    float32 sum of the row's products, rounded once to the dtype: not cuBLAS's bits (another
    summation order), within its rounding. With ``gated``, ``weight`` is a gated MLP's fc1 ``[2m,
    k]`` and the result ``[..., m]`` is :func:`swiglu` of the product (bitwise :func:`swiglu` of
    this function's ungated result with the same ``config``: the SwiGLU in the same kernel). One kernel, no split-K
    reduction: ``n / block_n`` programs each stream ``block_n`` rows of the weight; for decode steps
    of up to :data:`GEMV_MAX_ROWS` tokens, where a GEMM reads the weights at less than the GPU's
    bandwidth. ``pdl``: :func:`_pdl`."""
    n, k = weight.shape
    if not gemv_fits(x, weight) or (gated and n % 2):
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} {weight.dtype}")
    width = n // 2 if gated else n
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    chosen = config or GEMV_CONFIGS.get((n, k, gated)) or gemv_config(n, k, rows, gated)
    kernels = _kernels()
    kernels.gemv_kernel[(-(-width // chosen.block_n),)](
        flat,
        weight,
        out,
        width,
        flat.stride(0),
        width,
        k=k,
        rows=rows,
        rows_pow2=kernels.triton.next_power_of_2(rows),
        block_n=chosen.block_n,
        block_k=min(chosen.block_k, kernels.triton.next_power_of_2(k)),
        gated=gated,
        pdl=pdl,
        ahead=chosen.ahead,
        num_warps=chosen.warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``x`` and ``weight``: a 2-D contiguous weight of ``x``'s float
    dtype, ``x``'s last dimension its width with stride 1, each row's values contiguous."""
    return (
        weight.dim() == 2
        and weight.is_contiguous()
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.shape[-1] == weight.shape[1]
        and x.stride(-1) == 1
        and (x.dim() == 1 or x.is_contiguous())
    )


DECODE_ATTENTION_MAX_REQUESTS = 1
"""Decode steps of at most this many requests use :func:`decode_attention` (when installed): on an
H200 it took 6.3 us against FlashAttention-4's 8.6 us for one request of 256 keys, but 17 us
against 8.9 us for 8 requests (``bench/engine_megatron.py --kernel-probe``, 2026-12-02)."""
DECODE_ATTENTION_SPLITS = 16
"""Splits of each request's keys (one program each per KV head): one query token leaves little
work per request, so the keys are spread over programs and the splits combined after."""


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seqlens: torch.Tensor,
    scale: float,
    splits: int = DECODE_ATTENTION_SPLITS,
    block_n: int = 16,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query token per request over its paged keys and values (a decode step):
    ``q`` ``[requests, 1, heads, dim]`` (last stride 1), the caches ``[blocks, block_size, kv_heads,
    dim]`` (megatron's layout), ``block_table`` ``[requests, max_blocks]`` (the blocks of each
    request's tokens in order), ``seqlens`` ``[requests]`` (keys per request, the new token's
    included); ``softmax(q k^T * scale) v`` per query head, each KV head serving ``heads /
    kv_heads`` consecutive query heads. Returns ``[requests, 1, heads, dim]`` in ``q``'s dtype;
    requests with no keys get zeros. Two kernels: ``splits`` programs per (request, KV head) over
    shares of the keys, then one per (request, head) combining them (``pdl``: :func:`_pdl`)."""
    requests, _, heads, dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty(requests, 1, heads, dim, dtype=q.dtype, device=q.device)
    if requests == 0:
        return out
    if q.stride(3) != 1 or key_cache.stride() != value_cache.stride() or dim & (dim - 1) or splits & (splits - 1):
        raise ValueError("decode_attention: unsupported layout")
    kernels = _kernels()
    partial = torch.empty(requests, heads, splits, dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(requests, heads, splits, 2, dtype=torch.float32, device=q.device)
    per_group = heads // kv_heads
    kernels.decode_attention_split_kernel[(requests, kv_heads, splits)](
        q,
        key_cache,
        value_cache,
        block_table,
        seqlens,
        partial,
        stats,
        float(scale) * 1.4426950408889634,  # log2(e): the kernel's exponentials are base 2
        q.stride(0),
        q.stride(2),
        block_table.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        per_group=per_group,
        per_group_pow2=kernels.triton.next_power_of_2(per_group),
        dim=dim,
        block_size=block_size,
        block_n=block_n,
        splits=splits,
        **_pdl(pdl),
    )
    kernels.decode_attention_combine_kernel[(requests, heads)](partial, stats, out, dim=dim, splits=splits, **_pdl(pdl))
    return out


def _fused_decode_attention(attention: Any, pdl: bool = False) -> None:
    """Patch one ``SelfAttention``'s ``flash_decode_and_prefill``: decode-only steps of at most
    :data:`DECODE_ATTENTION_MAX_REQUESTS` requests (one query token each, no attention sink) go to
    :func:`decode_attention`; every other step to megatron's FlashAttention."""
    original = attention.flash_decode_and_prefill

    def flash_decode_and_prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        max_seqlen_q: Any,
        max_seqlen_k: Any,
        cu_seqlens_q: Any,
        cu_seqlens_k: Any,
        seqlens_k: torch.Tensor,
        block_table: torch.Tensor,
        is_decode_only: bool,
        softmax_offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        requests = seqlens_k.shape[0]
        if (
            not is_decode_only
            or softmax_offset is not None
            or requests > DECODE_ATTENTION_MAX_REQUESTS
            or q.shape[0] != requests
        ):
            result: torch.Tensor = original(
                q,
                k,
                v,
                max_seqlen_q,
                max_seqlen_k,
                cu_seqlens_q,
                cu_seqlens_k,
                seqlens_k,
                block_table,
                is_decode_only,
                softmax_offset=softmax_offset,
            )
            return result
        scale = getattr(attention, "softmax_scale", None) or q.shape[-1] ** -0.5
        return decode_attention(q, k, v, block_table, seqlens_k, scale, pdl=pdl)

    attention.flash_decode_and_prefill = flash_decode_and_prefill


@dataclasses.dataclass
class _QkvState:
    """What the patched attention methods of one model hand each other within a layer's forward
    (:func:`_fused_qkv`): they run in order (the qkv split, the key's RoPE, the append, the
    query's RoPE), on one stream, so plain attributes carry it."""

    active: bool = False
    """Inside an attention forward over the dynamic context these patches serve."""
    query: tuple[torch.Tensor, torch.Tensor] | None = None
    """(the query buffer returned unfilled, the grouped qkv view it is to be filled from)."""
    key: tuple[torch.Tensor, float] | None = None
    """(freqs, mscale) of the key handed back unrotated, for the append to rotate."""
    done: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, float] | None = None
    """((query buffer, grouped view), freqs, mscale): the append filled and rotated the query."""


def _fused_qkv(attention: Any, context: Any, state: _QkvState) -> None:
    """Patch one ``SelfAttention``: its qkv split hands back an unfilled contiguous query buffer,
    the context's key RoPE defers, and the append fills the query, rotates both and appends the
    KV in one :func:`qkv_rope_append` (``_fused_context_rope`` routes the context's methods here)."""
    original_forward, original_qkv = attention.forward, attention.get_query_key_value_tensors
    apply_module = importlib.import_module("megatron.core.typed_torch").apply_module

    def forward(*args: Any, **kwargs: Any) -> Any:
        inference_context: Any = kwargs.get("inference_context") or kwargs.get("inference_params")
        state.active = inference_context is context and not context.is_static_batching()
        try:
            return original_forward(*args, **kwargs)
        finally:
            state.active = False
            state.query = state.key = state.done = None

    def get_query_key_value_tensors(
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> Any:
        if not state.active or output_gate or not split_qkv or key_value_states is not None:
            return original_qkv(hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        mixed_qkv, _ = apply_module(attention.linear_qkv)(hidden_states)
        groups = attention.num_query_groups_per_partition
        per_group = attention.num_attention_heads_per_partition // groups
        dim = attention.hidden_size_per_attention_head
        grouped = mixed_qkv.view(*mixed_qkv.shape[:-1], groups, (per_group + 2) * dim)
        source, key, value = torch.split(grouped, [per_group * dim, dim, dim], dim=3)
        query = torch.empty(
            *mixed_qkv.shape[:-1], groups * per_group, dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device
        )
        state.query = (query, source)
        return query, key, value

    attention.forward = forward
    attention.get_query_key_value_tensors = get_query_key_value_tensors


def _why_not(config: Any) -> str | None:
    """Why :func:`install` cannot swap kernels into a model of ``config`` (``None``: it can)."""
    checks = {
        "rotary_interleaved": not getattr(config, "rotary_interleaved", False),
        "multi_latent_attention": not getattr(config, "multi_latent_attention", False),
        "rotary_percent": getattr(config, "rotary_percent", 1.0) == 1.0,
        "gated SiLU MLP": bool(config.gated_linear_unit) and config.activation_func is torch.nn.functional.silu,
        "add_bias_linear": not config.add_bias_linear,
        "glu_linear_offset": getattr(config, "glu_linear_offset", 0.0) == 0.0,
        "activation_func_clamp_value": getattr(config, "activation_func_clamp_value", None) is None,
        "bias_activation_fusion": not config.bias_activation_fusion,
        "use_te_activation_func": not getattr(config, "use_te_activation_func", False),
        "yarn": getattr(config, "rope_type", "rope") != "yarn",
    }
    failed = [name for name, ok in checks.items() if not ok]
    return ", ".join(failed) or None


def _why_not_qkv(model: Any, context: Any) -> str | None:
    """Why the qkv fold (:func:`_fused_qkv`) does not fit ``model`` (``None``: it does): it hands
    back the query unfilled for the context's RoPE to fill, so every path that reads the query
    before that must be off."""
    config = model.config
    checks = {
        "position_embedding_type rope": getattr(model, "position_embedding_type", "rope") == "rope",
        "flash_decode": not getattr(config, "flash_decode", False),
        "attention_output_gate": not getattr(config, "attention_output_gate", False),
        "qk_layernorm": not getattr(config, "qk_layernorm", False),
        "fused_single_qkv_rope": not getattr(config, "fused_single_qkv_rope", False),
        "flashinfer fused rope": not getattr(context, "use_flashinfer_fused_rope", False),
        "MLA latent cache": not getattr(context, "cache_mla_latent", False),
        "tensor parallel": config.tensor_model_parallel_size == 1,
    }
    failed = [name for name, ok in checks.items() if not ok]
    return ", ".join(failed) or None


def install(model: Any, context: Any, kernels: FusedKernels) -> dict[str, int]:
    """Swap the fused kernels into ``model`` (megatron's ``GPTModel``, ``local`` spec) and its
    dynamic inference ``context``, then run each once so Triton compiles before megatron captures
    its decode graphs. Returns how many modules each kernel replaced; nothing is swapped (a log line
    says why) for a model these kernels do not fit."""
    swapped = {"rope": 0, "swiglu": 0, "rms_norm": 0, "qkv": 0, "residual_add": 0, "attention": 0, "gemv": 0}
    if kernels.gemv and model.config.tensor_model_parallel_size != 1:
        log.info("gemv not installed: tensor parallel")
        kernels = dataclasses.replace(kernels, gemv=False)
    reason = _why_not(model.config)
    if reason:
        log.info("fused kernels not installed: the model does not fit them (%s)", reason)
        return swapped
    if kernels.rope_swiglu:
        _install_rope_swiglu(model, context, kernels, swapped)
    if kernels.attention:
        if getattr(model.config, "window_size", None) is None:
            for module in _self_attentions(model):
                _fused_decode_attention(module, kernels.pdl)
                swapped["attention"] += 1
        else:
            log.info("decode attention not installed: sliding-window attention")
    if kernels.rms_norm:
        residual = _ResidualState() if kernels.residual_add else None
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.RMSNorm and child.weight is not None:
                    setattr(parent, name, FusedRMSNorm(child, residual, kernels.pdl))
                    swapped["rms_norm"] += 1
        if residual is not None:
            swapped["residual_add"] = _install_residual_adds(model, residual, kernels.across_layers)
    if kernels.gemv:
        for module in _linears(model):
            _gemv_linear(module, kernels.pdl)
            swapped["gemv"] += 1
    _compile(model, kernels, context if swapped["qkv"] else None, context if swapped["attention"] else None)
    setattr(model, INSTALLED, swapped)
    log.info("fused kernels installed: %s", swapped)
    return swapped


def _linears(model: Any) -> list[Any]:
    """``model``'s megatron ``ColumnParallelLinear`` and ``RowParallelLinear`` modules (exactly those
    classes: their ``_forward_impl`` is the plain product)."""
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    classes = (layers.ColumnParallelLinear, layers.RowParallelLinear)
    return [module for module in model.modules() if type(module) in classes]


def _self_attentions(model: Any) -> list[Any]:
    """``model``'s megatron ``SelfAttention`` modules."""
    attention_class = importlib.import_module("megatron.core.transformer.attention").SelfAttention
    return [module for module in model.modules() if isinstance(module, attention_class)]


def _install_rope_swiglu(model: Any, context: Any, kernels: FusedKernels, swapped: dict[str, int]) -> None:
    """RoPE (with :attr:`FusedKernels.qkv`, the qkv fold where it fits) and the gated SiLU (with
    :attr:`FusedKernels.gemv`, in fc1's kernel where it takes the step), counted into ``swapped``."""
    reason = _why_not_qkv(model, context) if kernels.qkv else "not asked for"
    state = _QkvState() if reason is None else None
    _fused_context_rope(context, state, kernels.pdl)
    swapped["rope"] = 1
    if state is not None:
        for module in _self_attentions(model):
            _fused_qkv(module, context, state)
            swapped["qkv"] += 1
    else:
        log.info("qkv fold not installed: %s", reason)
    mlp_class = importlib.import_module("megatron.core.transformer.mlp").MLP
    for module in model.modules():
        if type(module) is mlp_class:
            module.forward = _fused_mlp_forward(module, module.forward, kernels)
            swapped["swiglu"] += 1


def _install_residual_adds(model: Any, state: _ResidualState, across_layers: bool) -> int:
    """Leave each residual add whose next op is a :class:`FusedRMSNorm` to that norm: the
    attention's (the same layer's pre-MLP norm, where no cross-attention sits between) and, with
    ``across_layers``, the MLP's of every layer but the last (the next layer's input norm; the last
    one's output leaves the layers). Returns how many adds were left to norms."""
    layers = [m for m in model.modules() if all(hasattr(m, a) for a in ("self_attn_bda", "mlp_bda", "input_layernorm"))]
    deferred = 0
    for index, layer in enumerate(layers):
        plain = all(
            type(getattr(layer, a, None)).__name__.startswith("Identity")
            for a in ("cross_attention", "pre_cross_attn_layernorm")
        )
        if plain and isinstance(getattr(layer, "pre_mlp_layernorm", None), FusedRMSNorm):
            layer.self_attn_bda = _defer_residual_add(layer.self_attn_bda, state)
            deferred += 1
        following = layers[index + 1] if index + 1 < len(layers) else None
        if across_layers and following is not None and isinstance(following.input_layernorm, FusedRMSNorm):
            layer.mlp_bda = _defer_residual_add(layer.mlp_bda, state)
            deferred += 1
    return deferred


def _compile(model: Any, kernels: FusedKernels, qkv_context: Any = None, attention_context: Any = None) -> None:
    """One call of each swapped kernel on the model's shapes (Triton compiles on first call); the
    qkv fold's with the index dtypes of ``qkv_context``'s GPU view, on scratch caches; the decode
    attention's reading ``attention_context``'s cache with its block table's and lengths' dtypes."""
    config = model.config
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    heads_q = config.num_attention_heads // config.tensor_model_parallel_size
    heads_k = max(1, (config.num_query_groups or config.num_attention_heads) // config.tensor_model_parallel_size)
    dim = config.kv_channels
    if kernels.rope_swiglu:
        freqs = torch.zeros(4, 1, 1, dim, device=device)
        positions = torch.zeros(2, dtype=torch.int64, device=device)
        for heads in {heads_q, heads_k}:
            rope_(torch.zeros(2, 1, heads, dim, device=device, dtype=dtype), freqs, positions)
        swiglu(
            torch.zeros(
                2, 1, 2 * config.ffn_hidden_size // config.tensor_model_parallel_size, device=device, dtype=dtype
            ),
            pdl=kernels.pdl,
        )
    if qkv_context is not None:
        view = qkv_context.gpu_view
        per_group = heads_q // heads_k
        grouped = torch.zeros(2, 1, heads_k, (per_group + 2) * dim, device=device, dtype=dtype)
        source, key, value = torch.split(grouped, [per_group * dim, dim, dim], dim=3)
        cache = torch.zeros(2, 2, 4, heads_k, dim, device=device, dtype=dtype)
        freqs = torch.zeros(4, 1, 1, dim, device=device)
        qkv_rope_append(
            (torch.empty(2, 1, heads_q, dim, device=device, dtype=dtype), source),
            (
                key,
                value,
                cache[0],
                cache[1],
                view.token_to_block_idx[:2] * 0,
                view.token_to_local_position_within_kv_block[:2] * 0,
            ),
            freqs,
            view.token_to_pos_ids[:2] * 0,
            view.token_to_position_in_request[:2] * 0,
            2,
            pdl=kernels.pdl,
        )
    if attention_context is not None:
        view = attention_context.gpu_view
        decode_attention(
            torch.zeros(1, 1, heads_q, dim, device=device, dtype=dtype),
            attention_context.memory_buffer[0, 0],
            attention_context.memory_buffer[1, 0],
            view.mha_block_table[:1] * 0,
            view.mha_kv_seq_lengths[:1] * 0 + 1,
            1.0,
            pdl=kernels.pdl,
        )
    if kernels.rms_norm:
        for residual in (None, torch.zeros(2, 1, config.hidden_size, device=device, dtype=dtype)):
            x = torch.zeros(2, 1, config.hidden_size, device=device, dtype=dtype)
            weight = torch.ones(config.hidden_size, device=device, dtype=dtype)
            rms_norm(x, weight, 1e-5, residual=residual, total=x, pdl=kernels.pdl)
    if kernels.gemv:
        weights = {tuple(m.weight.shape): m.weight for m in _linears(model) if getattr(m, "weight", None) is not None}
        for (n, k), weight in weights.items():  # read only
            x = torch.zeros(1, 1, k, device=device, dtype=dtype)
            gemv(x, weight, pdl=kernels.pdl)
            if n == 2 * config.ffn_hidden_size:  # fc1 with its SwiGLU
                gemv(x, weight, gated=True, pdl=kernels.pdl)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
