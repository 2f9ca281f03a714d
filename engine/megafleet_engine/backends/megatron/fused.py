"""Fused Triton kernels for megatron's ``local`` layer implementation (issue 19, stage 2), and
:func:`install`, which swaps them into a built ``GPTModel`` and its dynamic inference context.

Why: on an H200 a batch-1 decode step of the Llama-3.1-8B shape was GPU-bound at 6.3 ms, ~2.4 ms
of it in ~1,230 small kernels per step (``bench/README.md``, issue 19): RoPE alone is ~20 kernels
per layer (index, cos, sin, casts, neg, cat, two muls, add, copies, for q and for k) and SwiGLU 3
(silu, ``x_linear + 0.0``, mul). Here each is one kernel:

* :func:`rope_` applies megatron's unfused rotary embedding (``rope_utils._apply_rotary_pos_emb_bshd``,
  not interleaved) to the rows of q or k in place, gathering each row's frequencies by its position;
* :func:`swiglu` is megatron's unfused gated SiLU (``MLP.forward``'s ``glu``);
* :func:`rms_norm` is an RMSNorm (``torch.nn.RMSNorm``) in one pass per row.

Exactness: :func:`rope_` and :func:`swiglu` round to bf16/fp16 where megatron's op-by-op version
does (after cos/sin, each product, the sum; after silu, after the product) and use the same
precise float32 functions (libdevice ``cos``/``sin``/``exp``, IEEE division), so their outputs are
bitwise the unfused ones' (``tests/engine/test_fused_kernels.py`` checks that on the CPU
interpreter, ``tests/gpu/test_gpu_megatron.py`` on the GPU). :func:`rms_norm` sums the squares in
another order than torch's kernel, so it may differ in the last bf16 bit: it is a separate option.

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

__all__ = ["INSTALLED", "FusedKernels", "install", "rms_norm", "rope_", "swiglu"]

INSTALLED = "megafleet_fused_kernels"
"""The model attribute :func:`install` sets: how many modules each kernel replaced."""

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """Which fused kernels :func:`install` swaps in."""

    rope_swiglu: bool = True
    """RoPE on q and k and the gated SiLU (bitwise megatron's unfused ops)."""
    rms_norm: bool = False
    """The RMSNorms (one kernel per row; may differ from torch's in the last bit)."""


def _kernels() -> Any:
    """The Triton kernels' module, imported on first use (``tests`` reload it to run the kernels
    under ``TRITON_INTERPRET=1``, which Triton reads when a kernel is defined)."""
    return importlib.import_module("megafleet_engine.backends.megatron.triton_kernels")


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


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * linear`` of ``x = [..., 2 * width]`` (contiguous), ``gate, linear`` its halves."""
    if not x.is_contiguous():
        x = x.contiguous()
    width = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * width) if width else 0
    if rows:
        block = 1024
        _kernels().swiglu_kernel[(rows, -(-width // block))](x, out, width=width, block=block, enable_fp_fusion=False)
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
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.rms_norm(x, (width,), weight, eps)`` over the last dimension, bitwise
    torch's CUDA result where :func:`torch_norm_fits` (the sum of squares in its threads' order,
    :data:`TORCH_NORM_THREADS`; then ``weight * (rstd * x)`` in float32, rounded once).
    With ``residual``: ``s = x + residual`` (rounded to the dtype, as torch's add) is normalised
    and ``(normed, s)`` returned (one kernel for the residual add and the norm)."""
    if not x.is_contiguous():
        x = x.contiguous()
    width = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
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
        )
    return (out, total) if residual is not None else out


class FusedRMSNorm(torch.nn.Module):
    """A drop-in for the ``torch.nn.RMSNorm`` it replaces, holding the same weight ``Parameter``:
    :func:`rms_norm` where torch would run its vectorized kernel, torch's own op otherwise."""

    def __init__(self, replaced: torch.nn.RMSNorm) -> None:
        super().__init__()
        self.weight = replaced.weight
        self.eps = replaced.eps if replaced.eps is not None else torch.finfo(replaced.weight.dtype).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch_norm_fits(x, self.weight):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = rms_norm(x, self.weight, self.eps)
        assert isinstance(normed, torch.Tensor)
        return normed


def _fused_mlp_forward(mlp: Any, original: Any) -> Any:
    """``MLP.forward`` for a dense gated-SiLU MLP without biases: fc1, :func:`swiglu`, fc2."""

    def forward(hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if per_token_scale is not None:
            return original(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = mlp.linear_fc1(hidden_states)
        assert bias is None, "install() patches MLPs without biases only"
        return mlp.linear_fc2(swiglu(intermediate))

    return forward


def _fused_context_rope(context: Any) -> None:
    """The dynamic context's ``apply_rotary_emb_query``/``_key`` through :func:`rope_` (in place),
    for every step kind (their positions come from the context's GPU view, as megatron's do)."""

    original_query, original_key = context.apply_rotary_emb_query, context.apply_rotary_emb_key

    def query(
        q: torch.Tensor, emb: torch.Tensor, config: Any, cu_seqlens: Any, cp_group: Any, mscale: float = 1.0
    ) -> torch.Tensor:
        if emb.dtype != torch.float32 or cu_seqlens is not None:
            unfused: torch.Tensor = original_query(q, emb, config, cu_seqlens, cp_group, mscale=mscale)
            return unfused
        n = context.padded_active_token_count
        rope_(q[:n], emb, context.gpu_view.token_to_pos_ids[:n], mscale)
        return q

    def key(k: torch.Tensor, emb: torch.Tensor, config: Any, cp_group: Any, mscale: float = 1.0) -> torch.Tensor:
        if emb.dtype != torch.float32:
            unfused: torch.Tensor = original_key(k, emb, config, cp_group, mscale=mscale)
            return unfused
        n = context.padded_active_token_count
        rope_(k[:n], emb, context.gpu_view.token_to_position_in_request[:n], mscale)
        return k[:n] if context.is_decode_only() else k

    context.apply_rotary_emb_query = query
    context.apply_rotary_emb_key = key


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


def install(model: Any, context: Any, kernels: FusedKernels) -> dict[str, int]:
    """Swap the fused kernels into ``model`` (megatron's ``GPTModel``, ``local`` spec) and its
    dynamic inference ``context``, then run each once so Triton compiles before megatron captures
    its decode graphs. Returns how many modules each kernel replaced; nothing is swapped (a log line
    says why) for a model these kernels do not fit."""
    mlp_class = importlib.import_module("megatron.core.transformer.mlp").MLP

    swapped = {"rope": 0, "swiglu": 0, "rms_norm": 0}
    reason = _why_not(model.config)
    if reason:
        log.info("fused kernels not installed: the model does not fit them (%s)", reason)
        return swapped
    if kernels.rope_swiglu:
        _fused_context_rope(context)
        swapped["rope"] = 1
        for module in model.modules():
            if type(module) is mlp_class:
                module.forward = _fused_mlp_forward(module, module.forward)
                swapped["swiglu"] += 1
    if kernels.rms_norm:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.RMSNorm and child.weight is not None:
                    setattr(parent, name, FusedRMSNorm(child))
                    swapped["rms_norm"] += 1
    _compile(model, kernels)
    setattr(model, INSTALLED, swapped)
    log.info("fused kernels installed: %s", swapped)
    return swapped


def _compile(model: Any, kernels: FusedKernels) -> None:
    """One call of each swapped kernel on the model's shapes (Triton compiles on first call)."""
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
            )
        )
    if kernels.rms_norm:
        rms_norm(
            torch.zeros(2, 1, config.hidden_size, device=device, dtype=dtype),
            torch.ones(config.hidden_size, device=device, dtype=dtype),
            1e-5,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
