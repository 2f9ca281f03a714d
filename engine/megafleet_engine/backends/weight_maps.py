"""Hugging Face Llama parameters <-> megatron-core ``GPTModel`` parameters, with tensor and pipeline
parallel slicing. Pure torch: megatron-core is never imported here.

Called by the megatron backend (:mod:`megafleet_engine.backends.megatron`) to load
checkpoints and to write refitted weights in place, and by the refit receiver, which uses the
:func:`shard_map` to ask for only the slices of each HF tensor its rank holds.

Megatron's layout, read in megatron-core 0.19.2 (``models/gpt/gpt_layer_specs.py``,
``transformer/attention.py``, ``transformer/mlp.py``):

* ``self_attention.linear_qkv.weight`` fuses Q, K and V, interleaved per query group:
  ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``; it is column parallel, so
  rank ``r`` holds rows ``[r * L, (r + 1) * L)`` of that interleaved tensor (``L`` = rows / TP). With
  fewer query groups than TP ranks a rank holds part of one group (megatron all-gathers and
  re-slices at run time); the same row window describes it.
* ``mlp.linear_fc1.weight`` fuses gate and up, **per rank**: rank ``r`` holds ``[gate_r; up_r]``
  (``gate_r`` = rows ``[r * F/TP, (r + 1) * F/TP)`` of ``gate_proj``). Concatenating the ranks'
  shards therefore does not give the TP=1 tensor; :func:`gather_tp` does.
* Column parallel (rows split): ``linear_qkv``, ``linear_fc1``, ``embedding.word_embeddings``
  and ``output_layer`` (vocab parallel, vocab padded to a multiple of TP). Row parallel (columns
  split): ``linear_proj``, ``linear_fc2``. Norms are replicated.
* The *local* spec (``get_gpt_layer_local_spec``, no Transformer Engine) keeps the norms as
  modules: ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``. The Transformer Engine
  spec fuses them into the linear layers (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``): ``Layout(fused_norms=True)``.
* Pipeline stages number their layers from 0 (``decoder.layers.{local}``); the embedding lives on
  the first stage, ``decoder.final_layernorm`` and ``output_layer`` on the last. With tied
  embeddings megatron has no ``output_layer.weight`` on a stage that also holds the embedding.

Rotary embeddings need no permutation: HF Llama checkpoints already use the rotate-half layout
that megatron's default (non-interleaved) RoPE uses.

A :class:`Piece` says where one contiguous run of an HF tensor goes in a megatron tensor; the shard
map lists, per megatron parameter of one rank, every piece it is made of. :func:`megatron_view` and
:func:`hf_view` give matching views of both sides, so ``megatron_view(live, p).copy_(hf_view(t, p))``
writes a piece in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "Layout",
    "LlamaShape",
    "ParamSpec",
    "Piece",
    "gather_tp",
    "hf_shapes",
    "hf_to_megatron",
    "hf_view",
    "megatron_to_hf",
    "megatron_view",
    "padded_vocab_size",
    "shard_map",
]


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The architecture of a Llama-style decoder (what the weight maps and the model build need)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0  # > 0: Llama 3.x ("llama3") frequency scaling by this factor
    norm_eps: float = 1e-5
    max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaShape:
        """The shape of a Hugging Face ``LlamaConfig`` (its ``config.json`` as a dict)."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        factor = float(rope.get("factor", 0.0)) if rope.get("rope_type", rope.get("type")) == "llama3" else 0.0
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            heads=int(config["num_attention_heads"]),
            kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            head_dim=int(config.get("head_dim") or 0),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=float(theta),
            rope_scaling_factor=factor,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            max_positions=int(config.get("max_position_embeddings", 8192)),
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which part of the model one rank holds, and which megatron spec names it."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    fused_norms: bool = False  # True for the Transformer Engine spec (norm weights inside linears)
    vocab_multiple: int = 1  # pad the vocabulary to a multiple of this times tp_size

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"bad ranks: tp {self.tp_rank}/{self.tp_size}, pp {self.pp_rank}/{self.pp_size}")

    def layer_range(self, shape: LlamaShape) -> range:
        """Global layer numbers on this pipeline stage (megatron's even split)."""
        if shape.layers % self.pp_size:
            raise ValueError(f"{shape.layers} layers do not split evenly over {self.pp_size} pipeline stages")
        per_stage = shape.layers // self.pp_size
        return range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclasses.dataclass(frozen=True)
class Piece:
    """``count`` blocks of ``length`` consecutive indices along ``dim`` of HF tensor ``hf_name``
    (starting at ``hf_start``, blocks back to back), placed in a megatron tensor at ``dest_start``
    along the same dimension, one block every ``dest_stride`` indices."""

    hf_name: str
    dim: int
    hf_start: int
    length: int
    dest_start: int
    count: int = 1
    dest_stride: int = 0  # 0: length (blocks back to back)

    @property
    def stride(self) -> int:
        return self.dest_stride or self.length

    @property
    def hf_range(self) -> tuple[int, int, int]:
        """``(dim, start, stop)``: the one contiguous range of the HF tensor this piece needs."""
        return self.dim, self.hf_start, self.hf_start + self.count * self.length


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One megatron parameter of one rank: its local shape and the pieces that fill it (indices
    no piece covers, vocabulary padding, are zero)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def padded_vocab_size(vocab: int, layout: Layout) -> int:
    multiple = layout.vocab_multiple * layout.tp_size
    return -(-vocab // multiple) * multiple


def hf_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every HF parameter of the model and its full shape."""
    h, hd = shape.hidden, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (shape.heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (shape.kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (shape.kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, shape.heads * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (shape.intermediate, h)
        shapes[p + "mlp.up_proj.weight"] = (shape.intermediate, h)
        shapes[p + "mlp.down_proj.weight"] = (h, shape.intermediate)
    shapes["model.norm.weight"] = (h,)
    if not shape.tied_embeddings:
        shapes["lm_head.weight"] = (shape.vocab, h)
    return shapes


def _check_divisible(shape: LlamaShape, layout: Layout) -> None:
    tp = layout.tp_size
    problems = []
    if shape.heads % tp:
        problems.append(f"heads ({shape.heads})")
    if shape.intermediate % tp:
        problems.append(f"intermediate ({shape.intermediate})")
    if shape.kv_heads % tp and tp % shape.kv_heads:
        problems.append(f"kv_heads ({shape.kv_heads}, nor does it divide TP)")
    if problems:
        raise ValueError(f"tensor parallel size {tp} does not divide {', '.join(problems)}")


def _coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge pieces of the same HF tensor whose HF blocks follow each other and whose destinations
    are evenly spaced, so a strided copy writes them at once."""
    merged: list[Piece] = []
    for piece in pieces:
        for index, block in enumerate(merged):
            if block.hf_name != piece.hf_name or block.length != piece.length or block.dim != piece.dim:
                continue
            if piece.hf_start != block.hf_start + block.count * block.length:
                continue
            gap = piece.dest_start - block.dest_start
            if block.count == 1 and gap > 0:
                merged[index] = dataclasses.replace(block, count=2, dest_stride=gap)
                break
            if block.count > 1 and piece.dest_start == block.dest_start + block.count * block.stride:
                merged[index] = dataclasses.replace(block, count=block.count + 1)
                break
        else:
            merged.append(piece)
    return [dataclasses.replace(p, dest_stride=0) if p.stride == p.length else p for p in merged]


def _window(segments: list[tuple[str, int, int]], start: int, stop: int) -> list[Piece]:
    """Rows ``[start, stop)`` of a tensor made by stacking HF row ranges ``(name, first, rows)``."""
    pieces = []
    offset = 0
    for name, first, rows in segments:
        low, high = max(start, offset), min(stop, offset + rows)
        if low < high:
            pieces.append(Piece(name, 0, first + low - offset, high - low, low - start))
        offset += rows
    return _coalesce(pieces)


def _layer_specs(shape: LlamaShape, layout: Layout, hf_layer: int, local_layer: int) -> list[ParamSpec]:
    tp, rank = layout.tp_size, layout.tp_rank
    h, hd, groups, per_group = shape.hidden, shape.head_dim, shape.kv_heads, shape.heads_per_group
    hf = f"model.layers.{hf_layer}."
    mg = f"decoder.layers.{local_layer}."
    segments = []
    for g in range(groups):
        segments.append((hf + "self_attn.q_proj.weight", g * per_group * hd, per_group * hd))
        segments.append((hf + "self_attn.k_proj.weight", g * hd, hd))
        segments.append((hf + "self_attn.v_proj.weight", g * hd, hd))
    qkv_rows = (shape.heads + 2 * groups) * hd // tp
    ffn = shape.intermediate // tp
    attention_cols = shape.heads * hd // tp
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if layout.fused_norms else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if layout.fused_norms else "pre_mlp_layernorm.weight"
    return [
        ParamSpec(mg + input_norm, (h,), (Piece(hf + "input_layernorm.weight", 0, 0, h, 0),)),
        ParamSpec(
            mg + "self_attention.linear_qkv.weight",
            (qkv_rows, h),
            tuple(_window(segments, rank * qkv_rows, (rank + 1) * qkv_rows)),
        ),
        ParamSpec(
            mg + "self_attention.linear_proj.weight",
            (h, attention_cols),
            (Piece(hf + "self_attn.o_proj.weight", 1, rank * attention_cols, attention_cols, 0),),
        ),
        ParamSpec(mg + mlp_norm, (h,), (Piece(hf + "post_attention_layernorm.weight", 0, 0, h, 0),)),
        ParamSpec(
            mg + "mlp.linear_fc1.weight",
            (2 * ffn, h),
            (
                Piece(hf + "mlp.gate_proj.weight", 0, rank * ffn, ffn, 0),
                Piece(hf + "mlp.up_proj.weight", 0, rank * ffn, ffn, ffn),
            ),
        ),
        ParamSpec(
            mg + "mlp.linear_fc2.weight",
            (h, ffn),
            (Piece(hf + "mlp.down_proj.weight", 1, rank * ffn, ffn, 0),),
        ),
    ]


def _vocab_spec(name: str, hf_name: str, shape: LlamaShape, layout: Layout) -> ParamSpec:
    rows = padded_vocab_size(shape.vocab, layout) // layout.tp_size
    start = layout.tp_rank * rows
    real = max(0, min(rows, shape.vocab - start))
    pieces = (Piece(hf_name, 0, start, real, 0),) if real else ()
    return ParamSpec(name, (rows, shape.hidden), pieces)


def shard_map(shape: LlamaShape, layout: Layout | None = None) -> dict[str, ParamSpec]:
    """Every megatron parameter one rank holds, by megatron name, and where its values come from."""
    layout = layout or Layout()
    _check_divisible(shape, layout)
    specs: list[ParamSpec] = []
    if layout.first_stage:
        specs.append(_vocab_spec("embedding.word_embeddings.weight", "model.embed_tokens.weight", shape, layout))
    for local, layer in enumerate(layout.layer_range(shape)):
        specs.extend(_layer_specs(shape, layout, layer, local))
    if layout.last_stage:
        h = shape.hidden
        specs.append(ParamSpec("decoder.final_layernorm.weight", (h,), (Piece("model.norm.weight", 0, 0, h, 0),)))
        if not (shape.tied_embeddings and layout.first_stage):
            source = "model.embed_tokens.weight" if shape.tied_embeddings else "lm_head.weight"
            specs.append(_vocab_spec("output_layer.weight", source, shape, layout))
    return {spec.name: spec for spec in specs}


def megatron_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of megatron tensor ``local`` that ``piece`` fills, as a view (writes go through).

    Shape: the HF slice's shape when ``count == 1``, else ``(count, length, *rest)``.
    """
    if piece.count == 1:
        return local.narrow(piece.dim, piece.dest_start, piece.length)
    if piece.dim != 0:
        raise ValueError("strided pieces exist only along dimension 0")
    row = local.stride(0)
    return local.as_strided(
        (piece.count, piece.length, *local.shape[1:]),
        (piece.stride * row, *local.stride()),
        local.storage_offset() + piece.dest_start * row,
    )


def hf_view(hf: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The slice of HF tensor ``hf`` that ``piece`` needs, shaped like :func:`megatron_view`'s
    result. A view when ``hf`` is contiguous (as every checkpoint tensor is)."""
    part = hf.narrow(piece.dim, piece.hf_start, piece.count * piece.length)
    if piece.count == 1:
        return part
    return part.reshape(piece.count, piece.length, *hf.shape[1:])


def _pieces(specs: Mapping[str, ParamSpec]) -> Iterator[tuple[ParamSpec, Piece]]:
    for spec in specs.values():
        for piece in spec.pieces:
            yield spec, piece


def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor],
    shape: LlamaShape,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    layout: Layout | None = None,
) -> dict[str, torch.Tensor]:
    """One rank's megatron state dict, built from full HF tensors (new tensors, HF dtype/device).

    ``layout`` overrides ``tp_rank``/``tp_size`` when given (for pipeline stages or fused norms).
    """
    layout = layout or Layout(tp_rank=tp_rank, tp_size=tp_size)
    specs = shard_map(shape, layout)
    out: dict[str, torch.Tensor] = {}
    for spec in specs.values():
        sample = hf_state[spec.pieces[0].hf_name] if spec.pieces else next(iter(hf_state.values()))
        out[spec.name] = torch.zeros(spec.shape, dtype=sample.dtype, device=sample.device)
    for spec, piece in _pieces(specs):
        megatron_view(out[spec.name], piece).copy_(hf_view(hf_state[piece.hf_name], piece))
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]],
    shape: LlamaShape,
    *,
    pp_rank: int = 0,
    pp_size: int = 1,
    fused_norms: bool = False,
    vocab_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """The HF tensors of one pipeline stage, from that stage's megatron state dicts of every TP rank
    (``shards[r]`` is rank ``r``'s). The inverse of :func:`hf_to_megatron`."""
    tp_size = len(shards)
    full = hf_shapes(shape)
    out: dict[str, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        layout = Layout(rank, tp_size, pp_rank, pp_size, fused_norms=fused_norms, vocab_multiple=vocab_multiple)
        for spec, piece in _pieces(shard_map(shape, layout)):
            local = shard[spec.name]
            if piece.hf_name not in out:
                out[piece.hf_name] = torch.empty(full[piece.hf_name], dtype=local.dtype, device=local.device)
            target = out[piece.hf_name].narrow(piece.dim, piece.hf_start, piece.count * piece.length)
            if piece.count > 1:
                target = target.view(piece.count, piece.length, *target.shape[1:])
            target.copy_(megatron_view(local, piece))
    return out


def gather_tp(name: str, shards: Sequence[torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    """The TP=1 megatron tensor ``name`` from every TP rank's shard of it (``shards[r]`` = rank r's).

    Norms are replicated; ``linear_fc1`` joins the ranks' gate halves, then their up halves;
    row-parallel weights join along columns; the rest join along rows (vocabulary padding dropped).
    """
    if name.endswith(("layernorm.weight", "layer_norm_weight")):
        return shards[0].clone()
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return torch.cat(list(shards), dim=1)
    joined = torch.cat(list(shards), dim=0)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return joined[: shape.vocab].clone()
    return joined
