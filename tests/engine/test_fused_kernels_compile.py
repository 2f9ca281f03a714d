"""The megatron backend's fused Triton kernels compile for Hopper (sm_90, the H200) here, without
a GPU (Triton's own ``ptxas``), and the code keeps the precise float32 functions that make RoPE and
SwiGLU bitwise megatron's unfused ops (``tests/engine/test_fused_kernels.py`` checks the values on
the CPU interpreter; the GPU tests on the GPU)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from typing import Any

import pytest

from megafleet_engine.backends.megatron import fused

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

ROPE = {
    "freqs_ptr": "*fp32",
    "mscale": "fp32",
    "t_row_stride": "i32",
    "t_head_stride": "i32",
    "freqs_row_stride": "i32",
    "heads": "constexpr",
    "heads_pow2": "constexpr",
    "dim": "constexpr",
}


def ptx(kernel: str, signature: dict[str, str], constexprs: dict[str, int]) -> str:
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    assert os.environ.get("TRITON_INTERPRET") != "1"
    module: Any = importlib.reload(fused._kernels())  # defined for the GPU, not the interpreter
    source = ASTSource(fn=getattr(module, kernel), signature=signature, constexprs=constexprs)
    code: str = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    return code


def approximations(code: str) -> set[str]:
    return set(re.findall(r"\b(?:\w+\.)?approx\.\w+(?:\.\w+)?", code))


@pytest.mark.parametrize(("dtype", "positions", "heads", "dim"), [("bf16", "i64", 32, 128), ("fp16", "i32", 4, 64)])
def test_rope_compiles_with_precise_cos_and_sin(dtype: str, positions: str, heads: int, dim: int) -> None:
    code = ptx(
        "rope_kernel",
        {"t_ptr": f"*{dtype}", "positions_ptr": f"*{positions}", **ROPE},
        {"heads": heads, "heads_pow2": heads, "dim": dim},
    )
    assert approximations(code) == set()  # libdevice's cosf/sinf, not sin.approx/cos.approx
    assert ("cvt.rn.bf16.f32" in code) == (dtype == "bf16")


def test_swiglu_compiles_with_ieee_division() -> None:
    code = ptx(
        "swiglu_kernel",
        {"x_ptr": "*bf16", "out_ptr": "*bf16", "width": "constexpr", "block": "constexpr"},
        {"width": 14336, "block": 1024},
    )
    assert "div.rn.f32" in code and "div.approx" not in code and "div.full" not in code
    assert approximations(code) <= {"ex2.approx.ftz.f32"}  # inside libdevice's expf, as in CUDA's


def test_rms_norm_compiles() -> None:
    signature = {
        "x_ptr": "*bf16",
        "weight_ptr": "*bf16",
        "out_ptr": "*bf16",
        "eps": "fp32",
        "width": "constexpr",
        "width_pow2": "constexpr",
    }
    code = ptx("rms_norm_kernel", signature, {"width": 4096, "width_pow2": 4096})
    assert "div.rn.f32" in code and "cvt.rn.bf16.f32" in code
