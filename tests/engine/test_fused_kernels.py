"""The megatron backend's fused Triton kernels (``backends/megatron/fused.py``) against the unfused
PyTorch compositions megatron's ``local`` layer runs (written here from megatron-core 0.19's
formulas), on Triton's CPU interpreter: RoPE and SwiGLU bitwise in bf16, RMSNorm within one bf16
step. The same comparisons run on the GPU in ``tests/gpu/test_gpu_megatron.py``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from helpers.fused_reference import rope_inputs, rope_reference, swiglu_reference, torch_order_rms_norm_reference
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


@pytest.mark.parametrize(
    ("rows", "width", "threads", "fma"),
    [(6, 96, 128, True), (3, 4096, 128, True), (2, 2056, 128, True), (2, 1024, 256, False)],
)
def test_rms_norm_adds_the_squares_in_torchs_cuda_order(
    rows: int, width: int, threads: int, fma: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused, "TORCH_NORM_THREADS", threads)
    monkeypatch.setattr(fused, "TORCH_NORM_FMA", fma)
    generator = torch.Generator().manual_seed(width)
    x = (torch.randn(rows, 1, width, generator=generator) * 3).to(torch.bfloat16)
    weight = (torch.rand(width, generator=generator) + 0.5).to(torch.bfloat16)
    result = fused.rms_norm(x, weight, 1e-5)
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    assert torch.equal(result, torch_order_rms_norm_reference(x, weight, 1e-5, threads, fma))
    # another order of the same sums is not always the same bits (what makes the order matter)
    wide = x.float()
    naive = (weight.float() * (torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5) * wide)).to(torch.bfloat16)
    torch.testing.assert_close(result.float(), naive.float(), rtol=2**-7, atol=0.0)


def test_rms_norm_with_the_residual_add_writes_the_sum_and_normalises_it() -> None:
    generator = torch.Generator().manual_seed(5)
    x, residual = ((torch.randn(3, 1, 512, generator=generator) * 3).to(torch.bfloat16) for _ in range(2))
    weight = (torch.rand(512, generator=generator) + 0.5).to(torch.bfloat16)
    result = fused.rms_norm(x, weight, 1e-5, residual=residual)
    assert isinstance(result, tuple)
    normed, total = result
    assert torch.equal(total, x + residual)  # torch's bf16 add
    assert torch.equal(normed, torch_order_rms_norm_reference(x + residual, weight, 1e-5))


def test_fused_rms_norm_keeps_the_weight_and_falls_back_to_torch_where_torch_does_not_vectorize() -> None:
    norm = torch.nn.RMSNorm(96, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    swapped = fused.FusedRMSNorm(norm)
    assert swapped.weight is norm.weight  # refits write the parameter the kernel reads
    x = (torch.randn(4, 1, 96) * 3).to(torch.bfloat16)
    assert torch.equal(swapped(x), torch_order_rms_norm_reference(x, norm.weight.detach(), 1e-5))
    odd = (torch.randn(4, 1, 98) * 3).to(torch.bfloat16)  # not a multiple of 4: torch's other kernel
    odd_norm = torch.nn.RMSNorm(98, eps=1e-5, dtype=torch.bfloat16)
    assert not fused.torch_norm_fits(odd, odd_norm.weight)
    assert torch.equal(fused.FusedRMSNorm(odd_norm)(odd), odd_norm(odd))


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


class FakeMLP(torch.nn.Module):
    """megatron's dense ``MLP`` as far as :func:`fused.install` reads it: ``linear_fc1`` and
    ``linear_fc2`` return ``(output, bias)``; ``forward`` is the unfused gated SiLU."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(hidden + ffn)
        self.fc1 = torch.randn(2 * ffn, hidden, generator=generator).to(torch.bfloat16) / 4
        self.fc2 = torch.randn(hidden, ffn, generator=generator).to(torch.bfloat16) / 4

    def linear_fc1(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.fc1.T, None

    def linear_fc2(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.fc2.T, None

    def forward(self, hidden: torch.Tensor, per_token_scale: torch.Tensor | None = None) -> Any:
        intermediate, _ = self.linear_fc1(hidden)
        return self.linear_fc2(swiglu_reference(intermediate))


class FakeAttention(torch.nn.Module):
    """megatron-core 0.19.2's ``SelfAttention`` as far as the qkv fold reads it, and the order of
    its dynamic-context forward: the qkv GEMM and split (the query copied by ``reshape``), the
    key's RoPE, the KV append, the query's RoPE."""

    num_query_groups_per_partition = 2
    num_attention_heads_per_partition = 4
    hidden_size_per_attention_head = 16

    def __init__(self, hidden: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(hidden)
        self.weight = (torch.randn((4 + 2 * 2) * 16, hidden, generator=generator) / 4).to(torch.bfloat16)

    def linear_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.T, None

    def get_query_key_value_tensors(
        self, hidden: torch.Tensor, key_value_states: Any = None, output_gate: bool = False, split_qkv: bool = True
    ) -> Any:
        mixed, _ = self.linear_qkv(hidden)
        grouped = mixed.view(*mixed.shape[:-1], 2, (2 + 2) * 16)
        query, key, value = torch.split(grouped, [2 * 16, 16, 16], dim=3)
        return query.reshape(query.size(0), query.size(1), -1, 16), key, value

    def forward(
        self, hidden: torch.Tensor, attention_mask: Any = None, *, inference_context: Any, rotary_pos_emb: Any
    ) -> Any:
        query, key, value = self.get_query_key_value_tensors(hidden, None)
        key = inference_context.apply_rotary_emb_key(key, rotary_pos_emb, None, None)
        inference_context.append_key_value_cache(2, key, value)
        return inference_context.apply_rotary_emb_query(query, rotary_pos_emb, None, None, None)


class IdentityOp(torch.nn.Module):
    """megatron's placeholder module (``x -> x``), by its name."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


def bias_dropout_add(training: bool, fused: bool) -> Any:
    """megatron-core 0.19.2's bias-dropout-add in inference without a bias: ``x += residual`` in
    place, ``x`` returned."""

    def add(x_with_bias: tuple[torch.Tensor, None], residual: torch.Tensor, prob: float) -> torch.Tensor:
        return x_with_bias[0].add_(residual)

    return add


class FakeLayer(torch.nn.Module):
    """megatron's ``TransformerLayer`` as far as the fusions read it; :meth:`run` is its forward's
    order of norms, adds and sublayers (the attention a GEMM here)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.self_attention = FakeAttention(hidden)
        self.self_attn_bda, self.mlp_bda = bias_dropout_add, bias_dropout_add
        self.pre_cross_attn_layernorm, self.cross_attention = IdentityOp(), IdentityOp()
        self.mixer = (torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(ffn)) / 4).to(torch.bfloat16)
        self.input_layernorm = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=torch.bfloat16)
        self.pre_mlp_layernorm = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=torch.bfloat16)
        self.mlp = FakeMLP(hidden, ffn)

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        residual = hidden
        attention = self.input_layernorm(hidden) @ self.mixer
        hidden = self.self_attn_bda(False, False)((attention, None), residual, 0.0)
        hidden = self.cross_attention(self.pre_cross_attn_layernorm(hidden))
        residual = hidden
        mlp, _ = self.mlp(self.pre_mlp_layernorm(hidden))
        return self.mlp_bda(False, False)((mlp, None), residual, 0.0)  # type: ignore[no-any-return]


class FakeModel(torch.nn.Module):
    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.first = FakeLayer(32, 48)
        self.layers = torch.nn.ModuleList([self.first, FakeLayer(32, 48)])
        self.final_layernorm = torch.nn.RMSNorm(32, eps=1e-5, dtype=torch.bfloat16)

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer.run(hidden)  # type: ignore[operator]
        return self.final_layernorm(hidden)  # type: ignore[no-any-return]


def fake_model(add_bias_linear: bool = False) -> FakeModel:
    config = types.SimpleNamespace(
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=add_bias_linear,
        bias_activation_fusion=False,
        num_attention_heads=4,
        num_query_groups=2,
        tensor_model_parallel_size=1,
        kv_channels=16,
        ffn_hidden_size=48,
        hidden_size=32,
    )
    return FakeModel(config)


def fake_context(tokens: int, padded: int, decode_only: bool) -> Any:
    """megatron's dynamic context as far as the RoPE hooks read it; its own ``apply_rotary_emb_*``
    are megatron's unfused composition."""
    generator = torch.Generator().manual_seed(tokens)
    blocks = torch.randperm(6, generator=generator)[: padded + 3]
    context = types.SimpleNamespace(
        padded_active_token_count=padded,
        gpu_view=types.SimpleNamespace(
            token_to_pos_ids=torch.randint(0, 64, (padded + 3,), generator=generator),
            token_to_position_in_request=torch.randint(0, 64, (padded + 3,), generator=generator),
            token_to_block_idx=blocks.to(torch.int32),
            token_to_local_position_within_kv_block=torch.randint(0, 4, (padded + 3,), generator=generator),
        ),
        is_decode_only=lambda: decode_only,
        is_static_batching=lambda: False,
        layer_map=[5, 0, 7],  # megatron's layer number 2 is the cache's layer 0
        memory_buffer=torch.zeros(2, 1, 6, 4, 2, 16, dtype=torch.bfloat16),  # [k/v, layer, block, slot, head, dim]
    )

    def append(layer_number: int, k: torch.Tensor, v: torch.Tensor) -> None:
        layer = context.layer_map[layer_number - 1]
        block = context.gpu_view.token_to_block_idx[:padded].long()
        slot = context.gpu_view.token_to_local_position_within_kv_block[:padded]
        context.memory_buffer[0, layer, block, slot] = k.squeeze(1)[:padded]
        context.memory_buffer[1, layer, block, slot] = v.squeeze(1)[:padded]

    context.append_key_value_cache = append

    def query(q: torch.Tensor, emb: torch.Tensor, config: Any, cu: Any, cp: Any, mscale: float = 1.0) -> Any:
        positions = context.gpu_view.token_to_pos_ids[:padded]
        q[:padded] = rope_reference(q[:padded], emb, positions, mscale)
        return q

    def key(k: torch.Tensor, emb: torch.Tensor, config: Any, cp: Any, mscale: float = 1.0) -> Any:
        rotated = rope_reference(k[:padded], emb, context.gpu_view.token_to_position_in_request[:padded], mscale)
        if decode_only:
            return rotated
        k[:padded] = rotated
        return k

    context.apply_rotary_emb_query, context.apply_rotary_emb_key = query, key
    return context


@pytest.fixture()
def fake_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron.core.transformer.mlp.MLP`` is the fake MLP (megatron-core is GPU-machine-only)."""
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mlp = types.ModuleType("megatron.core.transformer.mlp")
    mlp.MLP = FakeMLP  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.mlp", mlp)
    attention = types.ModuleType("megatron.core.transformer.attention")
    attention.SelfAttention = FakeAttention  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.attention", attention)
    typed_torch = types.ModuleType("megatron.core.typed_torch")
    typed_torch.apply_module = lambda module: module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.typed_torch", typed_torch)


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_install_swaps_the_kernels_in_and_keeps_the_results(fake_megatron: None, decode_only: bool) -> None:
    model = fake_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(0.5, 1.5)
    norm_weights = [module.weight for module in model.modules() if isinstance(module, torch.nn.RMSNorm)]
    context = fake_context(tokens=5, padded=4, decode_only=decode_only)
    hidden = (torch.randn(3, 1, 32, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    unfused_mlp = model.first.mlp(hidden)
    qkv, freqs, _ = rope_inputs(4 + 2 * 2, rows=6, dim=16)
    q, k = qkv[:, :, :4].contiguous(), qkv[:, :, 4:6]
    unfused_q = context.apply_rotary_emb_query(q.clone(), freqs, None, None, None)
    unfused_k = context.apply_rotary_emb_key(k.clone(), freqs, None, None)
    tokens = (torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(6)) * 2).to(torch.bfloat16)
    unfused_attention = model.first.self_attention(tokens, inference_context=context, rotary_pos_emb=freqs)
    unfused_cache, _ = context.memory_buffer.clone(), context.memory_buffer.zero_()

    swapped = fused.install(model, context, fused.FusedKernels())

    assert swapped == {"rope": 1, "swiglu": 2, "rms_norm": 5, "qkv": 2, "residual_add": 2, "attention": 0, "gemv": 0}
    assert getattr(model, fused.INSTALLED) == swapped
    assert [module.weight for module in model.modules() if isinstance(module, fused.FusedRMSNorm)] == norm_weights
    assert not any(isinstance(module, torch.nn.RMSNorm) for module in model.modules())
    fused_mlp = model.first.mlp(hidden)
    assert torch.equal(fused_mlp[0], unfused_mlp[0]) and fused_mlp[1] is None
    assert torch.equal(context.apply_rotary_emb_query(q, freqs, None, None, None), unfused_q)
    rotated_k = context.apply_rotary_emb_key(k, freqs, None, None)
    assert rotated_k.shape[0] == (4 if decode_only else 6)
    assert torch.equal(rotated_k, unfused_k)
    # the qkv fold: one kernel fills and rotates the query and appends the rotated key and the value
    fused_attention = model.first.self_attention(tokens, inference_context=context, rotary_pos_emb=freqs)
    assert torch.equal(fused_attention, unfused_attention)
    assert torch.equal(context.memory_buffer, unfused_cache)
    assert unfused_cache.count_nonzero() > 0


def test_install_leaves_a_model_it_does_not_fit_alone(fake_megatron: None) -> None:
    model = fake_model(add_bias_linear=True)
    context = fake_context(tokens=2, padded=2, decode_only=True)
    original = context.apply_rotary_emb_query
    assert fused.install(model, context, fused.FusedKernels()) == {
        "rope": 0,
        "swiglu": 0,
        "rms_norm": 0,
        "qkv": 0,
        "residual_add": 0,
        "attention": 0,
        "gemv": 0,
    }
    assert context.apply_rotary_emb_query is original
    assert sum(isinstance(module, torch.nn.RMSNorm) for module in model.modules()) == 5


@pytest.mark.parametrize("across_layers", [True, False])
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_residual_adds_left_to_the_next_norm_give_the_same_bits(fake_megatron: None, across_layers: bool) -> None:
    """The layers' adds, done by the norm after each (in one kernel), give bitwise what the same
    norms give after megatron's own in-place adds; across layers only when asked, never the last
    layer's (its output leaves the layers)."""
    hidden = (torch.randn(3, 1, 32, generator=torch.Generator().manual_seed(8)) * 2).to(torch.bfloat16)
    models = []
    for kernels in (fused.FusedKernels(residual_add=False), fused.FusedKernels(across_layers=across_layers)):
        model = fake_model()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(9))
        swapped = fused.install(model, fake_context(tokens=2, padded=2, decode_only=True), kernels)
        models.append((model, swapped))
    (separate, separate_swapped), (deferred, deferred_swapped) = models
    assert separate_swapped["residual_add"] == 0
    assert deferred_swapped["residual_add"] == (3 if across_layers else 2)  # 2 layers: 2 attention adds + 1 MLP add
    with torch.no_grad():
        expected = separate.run(hidden.clone())
        produced = deferred.run(hidden.clone())
    assert torch.equal(produced, expected)
    assert not torch.equal(expected, separate.final_layernorm(hidden))  # the layers did something


@pytest.mark.parametrize(("lengths", "heads", "kv_heads"), [([5, 0, 1, 37], 4, 2), ([300], 8, 8)])
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_decode_attention_is_softmax_attention_over_the_paged_cache(
    lengths: list[int], heads: int, kv_heads: int
) -> None:
    """One query token per request against its keys in megatron's paged layout (blocks in a random
    order), every KV head serving its consecutive query heads; requests without keys get zeros."""
    generator = torch.Generator().manual_seed(len(lengths))
    dim, block_size, blocks = 16, 8, 64
    key_cache, value_cache = (
        (torch.randn(blocks, block_size, kv_heads, dim, generator=generator) * 2).to(torch.bfloat16) for _ in range(2)
    )
    order = torch.randperm(blocks, generator=generator)
    table = torch.zeros(len(lengths), -(-max(lengths) // block_size), dtype=torch.int32)
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        table[row, :count] = order[used : used + count]
        used += count
    q = (torch.randn(len(lengths), 1, heads, dim, generator=generator) * 2).to(torch.bfloat16)
    scale = dim**-0.5
    produced = fused.decode_attention(q, key_cache, value_cache, table, torch.tensor(lengths, dtype=torch.int32), scale)
    assert produced.shape == q.shape and produced.dtype == q.dtype
    for row, length in enumerate(lengths):
        if length == 0:
            assert torch.equal(produced[row], torch.zeros_like(produced[row]))
            continue
        tokens = torch.arange(length)
        slots = table[row, tokens // block_size].long(), tokens % block_size
        keys = key_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [length, heads, dim]
        values = value_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row, 0].float(), keys) * scale, dim=-1)
        expected = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(produced[row, 0].float(), expected, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 24, 64), (1, 10, 96), (3, 16, 200), (4, 8, 1024)])
@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_gemv_is_the_product_rounded_once(rows: int, n: int, k: int) -> None:
    """Each output is the row's float32 sum of products rounded once (within that rounding of the
    exact product), whatever the tile sizes: columns and widths that are not multiples of them."""
    generator = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 1, k, generator=generator).to(torch.bfloat16)
    exact = x.double() @ weight.double().T
    configs = (
        fused.GemvConfig(block_n=4, block_k=32),
        fused.GemvConfig(block_n=8, block_k=128, warps=8),
        fused.GemvConfig(block_n=2, block_k=32, ahead=2),
    )
    for config in configs:
        produced = fused.gemv(x, weight, config=config)
        assert produced.shape == (rows, 1, n) and produced.dtype == torch.bfloat16
        torch.testing.assert_close(produced.double(), exact, rtol=2**-8, atol=1e-5)
    assert fused.gemv(x[:0], weight).shape == (0, 1, n)
    with pytest.raises(ValueError):
        fused.gemv(x, weight.T)  # not contiguous


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_gemv_gated_is_the_swiglu_of_the_gemv_bitwise() -> None:
    generator = torch.Generator().manual_seed(11)
    weight = (torch.randn(2 * 20, 64, generator=generator) / 2).to(torch.bfloat16)
    x = (torch.randn(2, 1, 64, generator=generator) * 2).to(torch.bfloat16)
    for config in (fused.GemvConfig(block_n=8, block_k=32), fused.GemvConfig(block_n=1, block_k=16, ahead=2)):
        gated = fused.gemv(x, weight, gated=True, config=config)
        assert gated.shape == (2, 1, 20)
        assert torch.equal(gated, fused.swiglu(fused.gemv(x, weight, config=config)))


class ColumnParallelLinear(torch.nn.Module):
    """megatron's linear layer as far as :func:`fused.install`'s GEMV reads it: ``forward`` calls
    ``_forward_impl`` with keywords (megatron's product, counted here) and returns ``(out, bias)``."""

    def __init__(self, n: int, k: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter((torch.randn(n, k, generator=generator) / 4).to(torch.bfloat16))
        self.products = 0

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, bias: Any, **kwargs: Any) -> torch.Tensor:
        self.products += 1
        return torch.matmul(input, weight.t())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = self._forward_impl(input=x, weight=self.weight, bias=None, allreduce_dgrad=False, sequence_parallel=False)
        return out, None


class RowParallelLinear(ColumnParallelLinear):
    pass


class LinearMLP(torch.nn.Module):
    """megatron's dense gated-SiLU ``MLP`` over megatron's linear layers."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(2 * ffn, hidden, seed=1)
        self.linear_fc2 = RowParallelLinear(hidden, ffn, seed=2)

    def forward(self, hidden: torch.Tensor, per_token_scale: torch.Tensor | None = None) -> Any:
        intermediate, _ = self.linear_fc1(hidden)
        return self.linear_fc2(swiglu_reference(intermediate))


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_gemv_takes_the_linear_layers_of_one_token_steps(fake_megatron: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With :attr:`FusedKernels.gemv`, megatron's linear layers multiply one-token steps through
    :func:`fused.gemv` (fc1 with the SwiGLU in its kernel), reading the weight parameters in place
    (a refit's writes show); steps of more tokens keep megatron's product and its bits."""
    layers = types.ModuleType("megatron.core.tensor_parallel.layers")
    layers.ColumnParallelLinear, layers.RowParallelLinear = ColumnParallelLinear, RowParallelLinear  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel", types.ModuleType("megatron.core.tensor_parallel"))
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.layers", layers)
    monkeypatch.setattr(sys.modules["megatron.core.transformer.mlp"], "MLP", LinearMLP, raising=False)
    model = fake_model()
    model.mlp = LinearMLP(32, 48)
    model.output_layer = ColumnParallelLinear(40, 32, seed=3)
    one, three = (
        (torch.randn(rows, 1, 32, generator=torch.Generator().manual_seed(rows)) * 2).to(torch.bfloat16)
        for rows in (1, 3)
    )
    with torch.no_grad():
        unfused = [model.mlp(x)[0] for x in (one, three)] + [model.output_layer(one)[0]]
        swapped = fused.install(
            model, fake_context(tokens=2, padded=2, decode_only=True), fused.FusedKernels(gemv=True)
        )
        assert swapped["gemv"] == 3
        counts = [module.products for module in (model.mlp.linear_fc1, model.mlp.linear_fc2, model.output_layer)]
        fc1, fc2 = model.mlp.linear_fc1.weight, model.mlp.linear_fc2.weight
        produced = model.mlp(one)[0]
        assert torch.equal(produced, fused.gemv(fused.gemv(one, fc1, gated=True), fc2))
        torch.testing.assert_close(produced.float(), unfused[0].float(), rtol=2**-6, atol=2**-6)
        assert torch.equal(model.output_layer(one)[0], fused.gemv(one, model.output_layer.weight))
        assert [m.products for m in (model.mlp.linear_fc1, model.mlp.linear_fc2, model.output_layer)] == counts
        assert torch.equal(model.mlp(three)[0], unfused[1])  # three tokens: megatron's products
        assert model.mlp.linear_fc1.products == counts[0] + 1
        fc2.mul_(2)  # written in place, as a refit writes
        assert not torch.equal(model.mlp(one)[0], produced)
