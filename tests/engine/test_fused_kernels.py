"""The megatron backend's fused Triton kernels (``backends/megatron/fused.py``) against the unfused
PyTorch compositions megatron's ``local`` layer runs (written here from megatron-core 0.19's
formulas), on Triton's CPU interpreter: RoPE and SwiGLU bitwise in bf16, RMSNorm within one bf16
step. The same comparisons run on the GPU in ``tests/gpu/test_gpu_megatron.py``."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

import pytest
import torch

from helpers.fused_reference import rope_inputs, rope_reference, swiglu_reference
from megafleet_engine.backends.megatron import fused

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Triton's interpreter runs the kernels on CPU tensors (read when the kernels are defined)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(fused._kernels())
    yield
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(fused._kernels())


@pytest.mark.parametrize("heads", [1, 3, 4])
@pytest.mark.parametrize("mscale", [1.0, 0.75])
def test_rope_equals_megatrons_unfused_rope_bitwise(heads: int, mscale: float) -> None:
    t, freqs, positions = rope_inputs(heads)
    expected = rope_reference(t.clone(), freqs, positions, mscale)
    assert t._base is not None
    untouched = t._base[:, :, :1].clone()  # the qkv columns outside the view stay as they were
    result = fused.rope_(t, freqs, positions, mscale)
    assert result is t
    assert torch.equal(t, expected)
    assert torch.equal(t._base[:, :, :1], untouched)
    assert not torch.equal(expected, rope_inputs(heads)[0])  # the rotation changed something


def test_rope_leaves_rows_past_the_view_alone() -> None:
    t, freqs, positions = rope_inputs(2, rows=6)
    before = t[4:].clone()
    fused.rope_(t[:4], freqs, positions[:4])
    assert torch.equal(t[:4], rope_reference(rope_inputs(2, rows=6)[0][:4], freqs, positions[:4], 1.0))
    assert torch.equal(t[4:], before)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 24), (7, 1, 2 * 1500), (3, 2, 2 * 8)])
def test_swiglu_equals_megatrons_unfused_glu_bitwise(shape: tuple[int, int, int]) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 6).to(torch.bfloat16)
    result = fused.swiglu(x)
    assert result.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(result, swiglu_reference(x))


def test_rms_norm_matches_torch_within_one_bf16_step() -> None:
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 1, 96, generator=generator) * 3).to(torch.bfloat16)
    weight = torch.rand(96, generator=generator).to(torch.bfloat16) + 0.5
    norm = torch.nn.RMSNorm(96, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        wide = x.float()  # float32 throughout, rounded once
        expected = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(torch.bfloat16)
        swapped = fused.FusedRMSNorm(norm)
        result = swapped(x)
    assert swapped.weight is norm.weight  # refits write the parameter the kernel reads
    assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result.float(), expected.float(), rtol=2**-7, atol=0.0)
    assert (result == expected).float().mean() > 0.95


def test_models_the_kernels_do_not_fit_are_named() -> None:
    class Config:
        gated_linear_unit = True
        activation_func = staticmethod(torch.nn.functional.silu)
        add_bias_linear = False
        bias_activation_fusion = False

    assert fused._why_not(Config()) is None
    Config.add_bias_linear = True
    Config.gated_linear_unit = False
    assert fused._why_not(Config()) == "gated SiLU MLP, add_bias_linear"
