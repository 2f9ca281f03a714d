"""NeMo RL's M-to-N reshard refit info, as its trainer hands it to the generation side
(``prepare_nccl_reshard_refit_info``), read into what a fleet rank needs: the bulk parameters per
training pipeline stage with their source and destination placements, the "misc" tensors that ride
NeMo's packed broadcast, and this rank's receive map.

Read by the fleet's receiver (:mod:`~megafleet_protocol.refit.nemo_reshard`), the engine's refit source
and the SDK's NeMo adapter (which checks it before storing it for the operator). The wire form is
NeMo's "wire safe" one (``make_nccl_reshard_refit_info_wire_safe``): ``layer_names``, then per layer a
list of ``{name, global_shape, dtype, pp_stage?, src_mesh_info: {"mesh": [...]}, src_placements,
dst_mesh_info, dst_placements, grouped_expert_proj?}``, plus ``train_world_size``, ``gen_world_size``,
``pp_size`` and ``misc_meta`` (``{name: {"shape", "dtype"}}`` in broadcast order).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megafleet_protocol.refit import nemo_reshard_plan, wire

__all__ = ["BulkParam", "Receive", "ReshardInfo", "parse_dtype"]


def parse_dtype(name: str) -> torch.dtype:
    """NeMo's dtype names (``torch.bfloat16`` or ``bfloat16``)."""
    return wire.parse_dtype(str(name).removeprefix("torch."))


@dataclasses.dataclass(frozen=True)
class BulkParam:
    """One bulk (FFN projection) parameter of the reshard, as the trainer's stage ``stage`` sends it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int
    source: tuple[nemo_reshard_plan.Mesh, tuple[nemo_reshard_plan.Placement, ...]]
    destination: tuple[nemo_reshard_plan.Mesh, tuple[nemo_reshard_plan.Placement, ...]]

    def plan(self) -> nemo_reshard_plan.ParamPlan:
        return nemo_reshard_plan.plan(self.shape, self.source, self.destination)


@dataclasses.dataclass(frozen=True)
class Receive:
    """An entry of a rank's receive map: ``param`` arrives as ``box`` of the global tensor, which the
    rank writes as ``region`` (the sink's name for the same slice)."""

    param: BulkParam
    box: nemo_reshard_plan.Box
    region: wire.Region


@dataclasses.dataclass(frozen=True)
class ReshardInfo:
    """A parsed refit info: bulk parameters in the trainer's order (layer by layer), the misc tensors
    ``(name, shape, dtype)`` in broadcast order, and the world sizes it was built for."""

    params: tuple[BulkParam, ...]
    misc: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    pp_size: int
    train_world_size: int
    gen_world_size: int

    @classmethod
    def parse(cls, info: Mapping[str, Any]) -> ReshardInfo:
        """Read NeMo's wire-safe refit info (:class:`ValueError` naming what does not fit)."""
        per_layer = info.get("per_layer_params") or {}
        params: list[BulkParam] = []
        for layer in info.get("layer_names") or ():
            for entry in per_layer[layer]:
                params.append(_param(entry))
        misc = tuple(
            (str(name), tuple(int(size) for size in meta["shape"]), parse_dtype(meta["dtype"]))
            for name, meta in (info.get("misc_meta") or {}).items()
        )
        return cls(
            tuple(params),
            misc,
            int(info.get("pp_size", 1)),
            int(info.get("train_world_size", 0)),
            int(info.get("gen_world_size", 0)),
        )

    def stages(self) -> list[tuple[int, list[BulkParam]]]:
        """The bulk parameters per stage, stages in order of first appearance (NeMo's receive order)."""
        grouped: dict[int, list[BulkParam]] = {}
        for param in self.params:
            grouped.setdefault(param.stage, []).append(param)
        return list(grouped.items())

    def receive_map(self, rank: int, required: Mapping[str, tuple[int, ...]] | None = None) -> list[Receive]:
        """What stage-communicator rank ``rank`` receives of each bulk parameter and keeps (its
        destination box), in receive order. ``required`` (the sink's names and full shapes) is
        checked: a parameter the sink lacks or holds in another shape is refused
        (:class:`ValueError`) before anything is received."""
        found = []
        for _stage, params in self.stages():
            for param in params:
                box = param.plan().destinations.get(rank)
                if box is None:
                    raise ValueError(
                        f"{param.name}: rank {rank} is not in its destination mesh {list(param.destination[0].ranks)}"
                    )
                if required is not None and tuple(required.get(param.name, ())) != param.shape:
                    held = required.get(param.name)
                    raise ValueError(
                        f"{param.name}: the trainer sends shape {list(param.shape)}, this rank holds "
                        + ("no such tensor" if held is None else f"shape {list(held)}")
                    )
                found.append(Receive(param, box, _region(param.name, box, param.shape)))
        return found


def _param(entry: Mapping[str, Any]) -> BulkParam:
    name = str(entry["name"])
    if entry.get("grouped_expert_proj"):
        raise ValueError(
            f"{name}: grouped MoE experts ({entry['grouped_expert_proj']}) are not received by the fleet's "
            "reshard yet; their tensors need the fleet's expert layout"
        )
    return BulkParam(
        name=name,
        shape=tuple(int(size) for size in entry["global_shape"]),
        dtype=parse_dtype(entry["dtype"]),
        stage=int(entry.get("pp_stage", 0)),
        source=(
            nemo_reshard_plan.Mesh.parse(entry["src_mesh_info"]),
            nemo_reshard_plan.parse_placements(entry["src_placements"]),
        ),
        destination=(
            nemo_reshard_plan.Mesh.parse(entry["dst_mesh_info"]),
            nemo_reshard_plan.parse_placements(entry["dst_placements"]),
        ),
    )


def _region(name: str, box: nemo_reshard_plan.Box, shape: Sequence[int]) -> wire.Region:
    cut = [dim for dim, (start, stop) in enumerate(box) if (start, stop) != (0, shape[dim])]
    if not cut:
        return wire.Region.whole(name)
    if len(cut) > 1:
        raise ValueError(f"{name}: a destination box cut along {len(cut)} dimensions ({box}) has no region")
    return wire.Region(name, cut[0], *box[cut[0]])
