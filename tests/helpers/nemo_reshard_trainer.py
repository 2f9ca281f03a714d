"""A NeMo-style trainer of the M-to-N reshard (``refit_transport: nccl_reshard``) for the tests of the
fleet's receiving side (it holds no tests). Written from NeMo RL's contract (its synchronizer,
``build_nccl_reshard_refit_info`` and the Megatron policy worker's sender), not from the receiver:

* the refit info as NeMo's trainer builds it (:func:`refit_info`): FFN projections (``gate_proj``,
  ``up_proj``, ``down_proj``) are bulk, grouped by layer, each stage's source mesh the stage's ranks
  ``0..T_s-1`` TP-sharded (gate/up ``Shard(0)``, down ``Shard(1)``), the destination mesh the inference
  ranks ``T_s..T_s+G-1`` (TP innermost, then DP); 1-d tensors replicated; everything else is misc, in
  the trainer's order; the wire-safe form (``{"mesh": [...]}``, ``{"dim": d}`` / ``{}``);
* each training rank (:func:`train_rank`) holds only its own stage's TP slices, hosts its stage's
  store when it is the stage's first rank (world rank 0 also hosts the misc world's store), joins the
  stage communicator (``T_s + G`` ranks) and the misc world (``T + G``), warms both up, and per refit
  sends its slices of each of its stage's bulk tensors as the reshard plan says (gloo point-to-point
  standing in for NCCL), then takes part in NeMo's packed broadcast of the misc tensors; its steps
  (:func:`join_misc`, :func:`join_stage`, :func:`send_refit`) also serve the policy workers of the
  end-to-end tests (:mod:`helpers.nemo_reshard_policy`), which NeMo's synchronizer drives one call at a time.

The per-message plan is the one both ends of NeMo's reshard compute from the refit info
(:mod:`megafleet_protocol.refit.nemo_reshard_plan`; its own tests hold it to NeMo's algorithm).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from helpers import nemo_trainer
from megafleet_protocol.refit import nemo_reshard
from megafleet_protocol.refit import nemo_reshard_plan as plan_

ADDRESS = nemo_trainer.ADDRESS
BULK_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
_LAYER = re.compile(r"^(?:(?P<prefix>.+)\.)?layers\.(?P<index>\d+)(?:\.|$)")


def layer_of(name: str) -> str:
    """NeMo's per-layer group of a parameter name (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``)."""
    match = _LAYER.match(name)
    if match is None:
        return name.split(".")[0]
    prefix = match.group("prefix")
    return f"{prefix}.layers.{match.group('index')}" if prefix else f"layers.{match.group('index')}"


def tp_dim(name: str) -> int | None:
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return 0
    if name.endswith("down_proj.weight"):
        return 1
    return None


def mesh(count: int, offset: int, *, tp: int) -> tuple[list[Any], dict[str, int]]:
    """NeMo's mesh of ``count`` ranks from ``offset``: active dims (tp, dp) of size > 1, the first
    innermost; its rank tensor as nested lists and each dim's axis."""
    dims = [(name, size) for name, size in (("tp", tp), ("dp", count // tp)) if size > 1]
    ranks = list(range(offset, offset + count))
    if not dims:
        return ranks, {}
    outer_to_inner = list(reversed(dims))
    shape = [size for _, size in outer_to_inner]
    nested: Any = torch.tensor(ranks).reshape(shape).tolist()
    return nested, {name: axis for axis, (name, _) in enumerate(outer_to_inner)}


def placements(name: str, dim_map: Mapping[str, int], ndim: int) -> list[dict[str, int]]:
    wire: list[dict[str, int]] = [{} for _ in range(len(dim_map) or 1)]  # {"dim": d} is Shard(d), {} Replicate
    sharded = tp_dim(name)
    if ndim >= 2 and sharded is not None and "tp" in dim_map:
        wire[dim_map["tp"]] = {"dim": sharded}
    return wire


@dataclasses.dataclass(frozen=True)
class Layout:
    """The trainer's and the fleet's parallelism: ``pp`` stages of ``tp`` ranks; ``gen_ranks``
    inference ranks of TP ``gen_tp``; ``layers`` decoder layers split evenly over the stages."""

    pp: int
    tp: int
    gen_ranks: int
    gen_tp: int
    layers: int

    @property
    def train_ranks(self) -> int:
        return self.pp * self.tp

    def stage_of(self, name: str) -> int:
        index = int(layer_of(name).rsplit(".", 1)[1])
        return index * self.pp // self.layers


def refit_info(weights: Mapping[str, torch.Tensor], layout: Layout) -> dict[str, Any]:
    """NeMo's wire-safe refit info of ``weights`` (full tensors, HF names, the trainer's order)."""
    src_mesh, src_dims = mesh(layout.tp, 0, tp=layout.tp)
    dst_mesh, dst_dims = mesh(layout.gen_ranks, layout.tp, tp=layout.gen_tp)
    per_layer: dict[str, list[dict[str, Any]]] = {}
    misc: dict[str, dict[str, Any]] = {}
    for name, tensor in weights.items():
        if not name.endswith(BULK_SUFFIXES):
            misc[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype)}
            continue
        entry: dict[str, Any] = {
            "name": name,
            "global_shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
            "src_mesh_info": {"mesh": src_mesh},
            "src_placements": placements(name, src_dims, tensor.ndim),
            "dst_mesh_info": {"mesh": dst_mesh},
            "dst_placements": placements(name, dst_dims, tensor.ndim),
        }
        if layout.pp > 1:
            entry["pp_stage"] = layout.stage_of(name)
        per_layer.setdefault(layer_of(name), []).append(entry)
    return {
        "layer_names": list(per_layer),
        "per_layer_params": per_layer,
        "train_world_size": layout.train_ranks,
        "gen_world_size": layout.gen_ranks,
        "pp_size": layout.pp,
        "gen_tp_size": layout.gen_tp,
        "misc_meta": misc,
    }


def tp_slice(tensor: torch.Tensor, name: str, rank: int, tp: int) -> torch.Tensor:
    """A training rank's TP-local slice (``torch.chunk`` of its sharded dim); 1-d tensors whole."""
    dim = tp_dim(name)
    if dim is None or tensor.ndim < 2 or tp == 1:
        return tensor
    return torch.chunk(tensor, tp, dim=dim)[rank].contiguous()


@dataclasses.dataclass(frozen=True)
class Ports:
    """Where the trainer's stores listen: the misc world's, then one per stage."""

    misc: int
    stages: tuple[int, ...]


def train_rank(
    world_rank: int,
    *,
    layout: Layout,
    ports: Ports,
    refits: Iterable[Mapping[str, torch.Tensor]],
    bucket_bytes: int,
    sent: list[tuple[int, str, int]],
    misc_prefix: str = nemo_trainer.GLOO_PREFIX,
) -> None:
    """One training rank, refit after refit: its stage's bulk slices, then NeMo's misc broadcast.
    ``misc_prefix``: the misc world's gloo store prefix (the engine's agent uses
    :data:`helpers.nemo_trainer.AGENT_GLOO_PREFIX`)."""
    # NeMo's order: init_collective (the misc world) first, then the stage communicators
    misc = join_misc(world_rank, layout=layout, port=ports.misc, prefix=misc_prefix)
    stage = join_stage(world_rank, layout=layout, port=ports.stages[world_rank // layout.tp])
    for weights in refits:
        send_refit(
            world_rank, layout=layout, weights=weights, groups=(stage, misc), bucket_bytes=bucket_bytes, sent=sent
        )


Joined = tuple[Any, Any]
"""A communicator as a rank holds it: its store (kept open: the master counts its clients) and its group."""


def join_misc(world_rank: int, *, layout: Layout, port: int, prefix: str, timeout: float = 30.0) -> Joined:
    """NeMo's world (``init_collective``): ``T + G`` ranks, world rank 0 hosts the store (its constructor
    returns once every rank connected) and publishes the unique id; the warm-up broadcast.
    ``timeout`` bounds the store's wait and each of the group's operations."""
    world = layout.train_ranks + layout.gen_ranks
    store = c10d.TCPStore(ADDRESS, port, world, world_rank == 0, datetime.timedelta(seconds=timeout))
    if world_rank == 0:
        writer: Any = store  # torch's stubs type values as str; bytes are what NeMo stores
        writer.set("nccl_unique_id", os.urandom(128))
    group = nemo_reshard.gloo_group(
        c10d.PrefixStore(prefix, store), world_rank, world, local_address=ADDRESS, timeout=timeout
    )
    group.broadcast([torch.ones(1) if world_rank == 0 else torch.zeros(1)], _root()).wait()
    return store, group


def join_stage(world_rank: int, *, layout: Layout, port: int, timeout: float = 30.0) -> Joined:
    """Its stage's communicator (``init_nccl_reshard_comm_group``): ``T_s + G`` ranks, the stage's first
    rank hosts the store; the warm-up broadcast."""
    local = world_rank % layout.tp
    sub_world = layout.tp + layout.gen_ranks
    store = c10d.TCPStore(ADDRESS, port, sub_world, local == 0, datetime.timedelta(seconds=timeout))
    if local == 0:
        writer: Any = store
        writer.set("nccl_unique_id", os.urandom(128))
    group = nemo_reshard.gloo_group(
        c10d.PrefixStore(nemo_reshard.GLOO_PREFIX, store), local, sub_world, local_address=ADDRESS, timeout=timeout
    )
    group.broadcast([torch.ones(1) if local == 0 else torch.zeros(1)], _root()).wait()
    return store, group


def send_refit(
    world_rank: int,
    *,
    layout: Layout,
    weights: Mapping[str, torch.Tensor],
    groups: tuple[Joined, Joined],
    bucket_bytes: int,
    sent: list[tuple[int, str, int]],
) -> None:
    """One ``nccl_reshard_refit`` of one rank (``groups``: its stage's communicator, NeMo's world): its
    slices of its stage's bulk tensors, layer by layer, then NeMo's packed broadcast of the misc ones."""
    stage, local = divmod(world_rank, layout.tp)
    (_, stage_group), (_, misc_group) = groups
    info = refit_info(weights, layout)
    for layer in info["layer_names"]:
        for entry in info["per_layer_params"][layer]:
            if entry.get("pp_stage", 0) != stage:
                continue  # each stage sends only its own layers
            _send(entry, tp_slice(weights[entry["name"]], entry["name"], local, layout.tp), local, stage_group, sent)
    misc = [weights[name] for name in info["misc_meta"]]
    for parts in nemo_trainer.nemo_buckets(misc, bucket_bytes):
        misc_group.broadcast([torch.cat(parts)], _root()).wait()


def _send(entry: Mapping[str, Any], local_tensor: torch.Tensor, rank: int, group: Any, sent: list[Any]) -> None:
    plan = plan_.plan(
        entry["global_shape"],
        (
            plan_.Mesh.parse(entry["src_mesh_info"]),
            plan_.parse_placements(entry["src_placements"]),
        ),
        (
            plan_.Mesh.parse(entry["dst_mesh_info"]),
            plan_.parse_placements(entry["dst_placements"]),
        ),
    )
    held = plan.sources[rank]
    works = []
    for transfer in plan.steps(rank).sends:
        piece = local_tensor[plan_.local(transfer.overlap, held)].contiguous()
        works.append(group.send([piece], transfer.receiver, transfer.tag))
        sent.append((transfer.receiver, entry["name"], piece.numel() * piece.element_size()))
    for work in works:
        work.wait()


def _root() -> Any:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options
