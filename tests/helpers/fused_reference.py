"""The unfused PyTorch compositions megatron-core 0.19's ``local`` layer runs, written here from
its formulas (``rope_utils._apply_rotary_pos_emb_bshd``, ``MLP.forward``'s ``glu``): the references
of the fused kernels (``megafleet_engine.backends.megatron.fused``) on the CPU interpreter
(``tests/engine/test_fused_kernels.py``) and on the GPU (``tests/gpu/test_gpu_megatron.py``)."""

from __future__ import annotations

import torch


def rope_reference(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float) -> torch.Tensor:
    """megatron's rotary embedding (not interleaved) of ``t`` ``[n, 1, heads, dim]`` by
    ``freqs[positions]`` (``freqs`` ``[max_positions, 1, 1, dim]``, float32), op by op."""
    emb = freqs[positions]
    cos = (torch.cos(emb) * mscale).to(t.dtype)
    sin = (torch.sin(emb) * mscale).to(t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    return (t * cos) + (torch.cat((-second, first), dim=-1) * sin)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """``MLP.forward``'s unfused ``glu`` with megatron's defaults (no clamp, ``glu_linear_offset`` 0)."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(gate) * (linear + 0.0)


def rope_inputs(
    heads: int, rows: int = 5, dim: int = 16, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 q-or-k rows as a view of a wider qkv row (megatron's split: the row stride is not
    ``heads * dim``), megatron-shaped frequencies for 64 positions, and random positions."""
    generator = torch.Generator().manual_seed(heads)
    base = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * base[None, :]
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :].contiguous()
    qkv = (torch.randn(rows, 1, heads + 3, dim, generator=generator) * 4).to(device=device, dtype=torch.bfloat16)
    positions = torch.randint(0, 64, (rows,), generator=generator)
    return qkv[:, :, 1 : 1 + heads], freqs.to(device), positions.to(device)


def torch_order_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 128, fma: bool = True
) -> torch.Tensor:
    """torch's CUDA RMSNorm (``vectorized_layer_norm_kernel<T, float, rms_norm=true>``, as read in
    ``aten/src/ATen/native/cuda/layer_norm_kernel.cu``) modelled on the CPU in float32, operation by
    operation: each of ``threads`` threads adds the squares of its 4-wide vectors ``t, t + threads,
    ...`` in order from 0 (``sigma2 + val * val``, fused when ``fma``), each warp of 32 adds
    shuffle-down style (lane l + lane l + 16, ..., + 1), the warps pairwise (w + w + warps / 2, ...);
    ``rstd = 1 / sqrt(sum / width + eps)`` (the CPU's correctly rounded one: the GPU's ``rsqrtf``
    may differ in the last bit, so this reference is for the interpreter), ``weight * (rstd * x)``."""
    from triton._C.libtriton import interpreter  # type: ignore[import-untyped]  # an exact float32 fma

    rows = x.reshape(-1, x.shape[-1]).float()
    width = rows.shape[-1]
    vectors = width // 4
    acc = torch.zeros(rows.shape[0], threads)
    for j in range(-(-vectors // threads)):
        vector = j * threads + torch.arange(threads)
        inside = vector < vectors
        for ii in range(4):
            v = torch.where(inside, rows[:, (vector * 4 + ii).clamp(max=width - 1)], 0.0)
            fused = torch.from_numpy(interpreter.fma_fp32(v.numpy(), v.numpy(), acc.numpy())) if fma else None
            acc = fused if fused is not None else acc + v * v
    lanes = acc.reshape(-1, threads // 32, 32)
    for half in (16, 8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half : 2 * half]
    warps = lanes[..., 0]
    while warps.shape[-1] > 1:
        half = warps.shape[-1] // 2
        warps = warps[..., :half] + warps[..., half:]
    mean = warps / float(width)
    rstd = 1.0 / torch.sqrt(mean + torch.tensor(eps, dtype=torch.float32))
    out = weight.float() * (rstd * rows)
    return out.to(x.dtype).reshape(x.shape)
