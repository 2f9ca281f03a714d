"""HF Llama <-> megatron-core parameter maps and tensor/pipeline parallel slicing (CPU, random tensors)."""

from __future__ import annotations

import pytest
import torch

from megafleet_engine.backends import weight_maps
from megafleet_engine.backends.weight_maps import Layout, LlamaShape

# Small, but every split is non-trivial: 4 query groups of 2 heads, 4 layers, odd vocabulary.
SHAPE = LlamaShape(layers=4, hidden=32, heads=8, kv_heads=4, intermediate=48, vocab=101, head_dim=4)
# Fewer query groups than TP ranks: a rank holds part of one group.
FEW_GROUPS = LlamaShape(layers=2, hidden=32, heads=8, kv_heads=2, intermediate=48, vocab=100, head_dim=4)
TIED = LlamaShape(layers=2, hidden=16, heads=4, kv_heads=2, intermediate=32, vocab=64, tied_embeddings=True)


def random_hf(shape: LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(size, generator=generator) for name, size in weight_maps.hf_shapes(shape).items()}


def assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.mark.parametrize("shape", [SHAPE, FEW_GROUPS, TIED], ids=["groups>=tp", "groups<tp", "tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_hf_to_megatron_to_hf_is_exact(shape: LlamaShape, tp: int) -> None:
    hf = random_hf(shape)
    shards = [weight_maps.hf_to_megatron(hf, shape, rank, tp) for rank in range(tp)]
    assert_same(weight_maps.megatron_to_hf(shards, shape), hf)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_gather_back_to_the_tp1_tensor(tp: int) -> None:
    hf = random_hf(SHAPE, seed=1)
    whole = weight_maps.hf_to_megatron(hf, SHAPE)
    shards = [weight_maps.hf_to_megatron(hf, SHAPE, rank, tp) for rank in range(tp)]
    for name, tensor in whole.items():
        assert torch.equal(weight_maps.gather_tp(name, [shard[name] for shard in shards], SHAPE), tensor), name


def test_qkv_and_column_parallel_shards_are_plain_row_windows() -> None:
    """Megatron's column-parallel linear_qkv is the TP=1 tensor cut into equal row blocks."""
    hf = random_hf(FEW_GROUPS, seed=2)
    whole = weight_maps.hf_to_megatron(hf, FEW_GROUPS)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    for tp in (2, 4):
        shards = [weight_maps.hf_to_megatron(hf, FEW_GROUPS, rank, tp)[name] for rank in range(tp)]
        assert torch.equal(torch.cat(shards), whole[name])


def test_tp1_layout_matches_megatron_names_and_interleaving() -> None:
    hf = random_hf(SHAPE, seed=3)
    megatron = weight_maps.hf_to_megatron(hf, SHAPE)
    hd, per_group = SHAPE.head_dim, SHAPE.heads_per_group
    qkv = megatron["decoder.layers.2.self_attention.linear_qkv.weight"].view(SHAPE.kv_heads, per_group + 2, hd, -1)
    q = hf["model.layers.2.self_attn.q_proj.weight"].view(SHAPE.kv_heads, per_group, hd, -1)
    k = hf["model.layers.2.self_attn.k_proj.weight"].view(SHAPE.kv_heads, hd, -1)
    v = hf["model.layers.2.self_attn.v_proj.weight"].view(SHAPE.kv_heads, hd, -1)
    assert torch.equal(qkv[:, :per_group], q)
    assert torch.equal(qkv[:, per_group], k)
    assert torch.equal(qkv[:, per_group + 1], v)
    fc1 = megatron["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]])
    )
    assert torch.equal(megatron["decoder.layers.3.input_layernorm.weight"], hf["model.layers.3.input_layernorm.weight"])
    assert torch.equal(
        megatron["decoder.layers.3.pre_mlp_layernorm.weight"], hf["model.layers.3.post_attention_layernorm.weight"]
    )
    assert torch.equal(megatron["output_layer.weight"], hf["lm_head.weight"])
    assert len(megatron) == 3 + 6 * SHAPE.layers


def test_fc1_rank_shard_is_its_gate_slice_then_its_up_slice() -> None:
    hf = random_hf(SHAPE, seed=4)
    shard = weight_maps.hf_to_megatron(hf, SHAPE, 1, 2)["decoder.layers.0.mlp.linear_fc1.weight"]
    ffn = SHAPE.intermediate // 2
    assert torch.equal(shard[:ffn], hf["model.layers.0.mlp.gate_proj.weight"][ffn:])
    assert torch.equal(shard[ffn:], hf["model.layers.0.mlp.up_proj.weight"][ffn:])


def test_vocab_is_padded_with_zero_rows_to_a_multiple_of_tp() -> None:
    hf = random_hf(SHAPE, seed=5)
    last = weight_maps.hf_to_megatron(hf, SHAPE, 3, 4)["embedding.word_embeddings.weight"]
    assert last.shape == (26, SHAPE.hidden)  # 101 -> 104 rows, 26 per rank
    assert torch.equal(last[:23], hf["model.embed_tokens.weight"][78:])
    assert not last[23:].any()


def test_fused_norm_names_of_the_transformer_engine_spec() -> None:
    hf = random_hf(SHAPE, seed=6)
    megatron = weight_maps.hf_to_megatron(hf, SHAPE, layout=Layout(fused_norms=True))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in megatron
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in megatron
    assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in megatron)
    back = weight_maps.megatron_to_hf([megatron], SHAPE, fused_norms=True)
    assert_same(back, hf)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_number_layers_locally_and_cover_the_model_once(tp: int) -> None:
    hf = random_hf(SHAPE, seed=7)
    merged: dict[str, torch.Tensor] = {}
    for pp_rank in range(2):
        stage = [weight_maps.hf_to_megatron(hf, SHAPE, layout=Layout(rank, tp, pp_rank, 2)) for rank in range(tp)]
        names = set(stage[0])
        assert ("embedding.word_embeddings.weight" in names) == (pp_rank == 0)
        assert ("output_layer.weight" in names) == (pp_rank == 1)
        assert {name.split(".")[2] for name in names if name.startswith("decoder.layers.")} == {"0", "1"}
        part = weight_maps.megatron_to_hf(stage, SHAPE, pp_rank=pp_rank, pp_size=2)
        assert not set(part) & set(merged)
        merged.update(part)
    assert_same(merged, hf)


def test_tied_embeddings_have_no_output_layer_on_a_single_stage_but_a_copy_on_the_last() -> None:
    hf = random_hf(TIED, seed=8)
    assert "output_layer.weight" not in weight_maps.hf_to_megatron(hf, TIED)
    last = weight_maps.hf_to_megatron(hf, TIED, layout=Layout(pp_rank=1, pp_size=2))
    assert torch.equal(last["output_layer.weight"], hf["model.embed_tokens.weight"])


def test_writing_pieces_in_place_never_rebinds_and_each_hf_tensor_is_one_piece_per_rank() -> None:
    hf = random_hf(SHAPE, seed=9)
    live = weight_maps.hf_to_megatron(random_hf(SHAPE, seed=10), SHAPE, 1, 2)
    pointers = {name: tensor.data_ptr() for name, tensor in live.items()}
    specs = weight_maps.shard_map(SHAPE, Layout(1, 2))
    seen: list[str] = []
    for spec in specs.values():
        for piece in spec.pieces:
            seen.append(piece.hf_name)
            weight_maps.megatron_view(live[spec.name], piece).copy_(weight_maps.hf_view(hf[piece.hf_name], piece))
    assert len(seen) == len(set(seen)) == len(weight_maps.hf_shapes(SHAPE))
    assert {name: tensor.data_ptr() for name, tensor in live.items()} == pointers
    assert_same(live, weight_maps.hf_to_megatron(hf, SHAPE, 1, 2))


def test_piece_ranges_name_only_what_the_rank_needs() -> None:
    specs = weight_maps.shard_map(SHAPE, Layout(1, 2))
    q = next(p for p in specs["decoder.layers.0.self_attention.linear_qkv.weight"].pieces if "q_proj" in p.hf_name)
    per_rank = SHAPE.heads * SHAPE.head_dim // 2
    assert q.hf_range == (0, per_rank, 2 * per_rank)
    assert q.count == SHAPE.kv_heads // 2  # one strided copy for the rank's two query groups
    (o,) = specs["decoder.layers.0.self_attention.linear_proj.weight"].pieces
    assert o.hf_range == (1, per_rank, 2 * per_rank)


def test_from_hf_config_reads_llama3_rope_and_defaults() -> None:
    shape = LlamaShape.from_hf_config(
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            "max_position_embeddings": 131072,
        }
    )
    assert (shape.head_dim, shape.rope_theta, shape.rope_scaling_factor, shape.tied_embeddings) == (
        128,
        500000.0,
        8.0,
        False,
    )


def test_bad_parallel_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        weight_maps.shard_map(SHAPE, Layout(0, 3))
    with pytest.raises(ValueError, match="pipeline"):
        weight_maps.shard_map(SHAPE, Layout(pp_size=3))
