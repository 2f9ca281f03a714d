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
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
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
        {"x_ptr": "*bf16", "out_ptr": "*bf16", "width": "constexpr", "block": "constexpr", "pdl": "constexpr"},
        {"width": 14336, "block": 1024, "pdl": False},
    )
    assert "div.rn.f32" in code and "div.approx" not in code and "div.full" not in code
    assert approximations(code) <= {"ex2.approx.ftz.f32"}  # inside libdevice's expf, as in CUDA's


@pytest.mark.parametrize(("with_residual", "pdl"), [(False, False), (True, False), (True, True)])
def test_rms_norm_compiles_with_fused_multiply_adds_in_torchs_order(with_residual: bool, pdl: bool) -> None:
    signature = {
        "x_ptr": "*bf16",
        "residual_ptr": "*bf16",
        "weight_ptr": "*bf16",
        "out_ptr": "*bf16",
        "sum_ptr": "*bf16",
        "eps": "fp32",
        "width": "constexpr",
        "width_pow2": "constexpr",
        "threads": "constexpr",
        "rounds": "constexpr",
        "fma": "constexpr",
        "with_residual": "constexpr",
        "pdl": "constexpr",
    }
    constexprs = {
        "width": 4096,
        "width_pow2": 4096,
        "threads": 128,
        "rounds": 8,
        "fma": True,
        "with_residual": with_residual,
        "pdl": pdl,
    }
    code = ptx("rms_norm_kernel", signature, constexprs)
    # a programmatic dependent launch: the next kernel may start, this one waits for the one before
    assert ("griddepcontrol.launch_dependents" in code) == ("griddepcontrol.wait" in code) == pdl
    assert "div.rn.f32" in code and "cvt.rn.bf16.f32" in code
    assert code.count("fma.rn.f32") >= 4096 // 128  # each thread's 32 squares, one rounding each
    # libdevice's rsqrtf, what torch's rsqrt calls (Triton's flushes subnormals: no difference for
    # its argument, a mean of squares plus eps)
    assert approximations(code) == {"rsqrt.approx.ftz.f32"}


def test_qkv_rope_append_compiles() -> None:
    signature = {
        "q_src_ptr": "*bf16",
        "q_out_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "key_cache_ptr": "*bf16",
        "value_cache_ptr": "*bf16",
        "freqs_ptr": "*fp32",
        "q_positions_ptr": "*i64",
        "k_positions_ptr": "*i64",
        "block_idx_ptr": "*i32",
        "local_pos_ptr": "*i64",
        "mscale": "fp32",
        **{name: "i32" for name in ("rotated_rows", "q_row_stride", "q_group_stride", "k_row_stride", "k_head_stride")},
        **{
            name: "i32"
            for name in ("v_row_stride", "v_head_stride", "cache_block_stride", "cache_pos_stride", "cache_head_stride")
        },
        **{
            name: "constexpr"
            for name in (
                "q_heads",
                "q_heads_pow2",
                "q_per_group",
                "kv_heads",
                "kv_heads_pow2",
                "dim",
                "with_q",
                "with_kv",
                "pdl",
            )
        },
    }
    constexprs = {
        "q_heads": 32,
        "q_heads_pow2": 32,
        "q_per_group": 4,
        "kv_heads": 8,
        "kv_heads_pow2": 8,
        "dim": 128,
        "with_q": True,
        "with_kv": True,
        "kv_part": 1,
        "pdl": False,
    }
    code = ptx("qkv_rope_append_kernel", signature, constexprs)
    assert approximations(code) == set()  # libdevice's cosf/sinf, as the RoPE kernel


@pytest.mark.parametrize("pdl", [False, True])
def test_decode_attention_compiles(pdl: bool) -> None:
    split = {
        "q_ptr": "*bf16",
        "key_cache_ptr": "*bf16",
        "value_cache_ptr": "*bf16",
        "block_table_ptr": "*i32",
        "seqlens_ptr": "*i32",
        "partial_ptr": "*fp32",
        "stats_ptr": "*fp32",
        "scale_log2": "fp32",
        **{name: "i32" for name in ("q_row_stride", "q_head_stride", "table_row_stride", "cache_block_stride")},
        **{name: "i32" for name in ("cache_pos_stride", "cache_head_stride")},
        **{
            name: "constexpr"
            for name in ("per_group", "per_group_pow2", "dim", "block_size", "block_n", "splits", "pdl")
        },
    }
    constexprs = {
        "per_group": 4,
        "per_group_pow2": 4,
        "dim": 128,
        "block_size": 256,
        "block_n": 16,
        "splits": 16,
        "pdl": pdl,
    }
    code = ptx("decode_attention_split_kernel", split, constexprs)
    assert "ex2.approx" in code
    assert ("griddepcontrol.wait" in code) == pdl
    combine = {
        "partial_ptr": "*fp32",
        "stats_ptr": "*fp32",
        "out_ptr": "*bf16",
        "dim": "constexpr",
        "splits": "constexpr",
        "pdl": "constexpr",
    }
    code = ptx("decode_attention_combine_kernel", combine, {"dim": 128, "splits": 16, "pdl": pdl})
    assert "cvt.rn.bf16.f32" in code
    assert ("griddepcontrol.wait" in code) == pdl


@pytest.mark.parametrize(("rows", "gated", "pdl"), [(1, False, True), (4, False, False), (1, True, False)])
def test_gemv_compiles(rows: int, gated: bool, pdl: bool) -> None:
    signature = {
        "x_ptr": "*bf16",
        "w_ptr": "*bf16",
        "out_ptr": "*bf16",
        "n": "i32",
        "x_row_stride": "i32",
        "out_row_stride": "i32",
        **{name: "constexpr" for name in ("k", "rows", "rows_pow2", "block_n", "block_k", "gated", "pdl", "ahead")},
    }
    constexprs = {
        "k": 4096,
        "rows": rows,
        "rows_pow2": rows,
        "block_n": 2,
        "block_k": 1024,
        "gated": gated,
        "pdl": pdl,
        "ahead": 1 + pdl,
    }
    code = ptx("gemv_kernel", signature, constexprs)
    assert "ld.global.L1::evict_first" in code  # the weights stream through, read once per step
    assert ("griddepcontrol.wait" in code) == pdl
    if gated:  # the SwiGLU epilogue rounds as swiglu_kernel does
        assert "div.rn.f32" in code and approximations(code) <= {"ex2.approx.ftz.f32"}
