"""Where received weights go: the parameters of one engine rank (its live weights, or its staging
copy), always written in place.

Built by the weight target (:mod:`~megafleet_engine.refit_attempts.weight_target`) and called by the
receiver (:mod:`megafleet_protocol.refit.receiver`) or NeMo's (through
:mod:`~megafleet_engine.refit_attempts.sources.nemo_collective`), which hand each received tensor (a
whole Hugging Face tensor, or a contiguous region of one) to a sink; its writes run on the engine's
backend thread (through the attempt's ``apply``). The sink copies into the live tensors whatever part
of it this rank holds and ignores the rest. Writes are ``copy_`` into the
existing storage, never a rebinding, so CUDA graphs captured on those addresses stay valid.

Two sinks cover the backends:

* :class:`NamedSink`: parameters by Hugging Face name, each held whole (the ``transformers``
  backend's :meth:`parameters`). It needs every tensor whole, under either transport.
* :class:`ShardSink`: megatron-layout parameters of one tensor/pipeline-parallel rank, described by
  :func:`megafleet_engine.backends.weight_maps.shard_map`. It needs, per piece of the map, the
  contiguous range of the HF tensor that piece comes from (:attr:`Piece.hf_range`); with the
  broadcast transport it cuts those ranges out of whole tensors, with reshard it receives only them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch

from megafleet_engine.backends import base, weight_maps
from megafleet_protocol.refit import receiver, wire

__all__ = ["NamedSink", "Parameters", "ShardSink", "Staged", "pointers", "sink_for"]


class Parameters(Protocol):
    """Tensors a sink writes into, as a backend shows its live weights (a backend is one)."""

    def parameters(self) -> dict[str, torch.Tensor]: ...

    def shard_map(self) -> base.ShardMap | None: ...


@dataclasses.dataclass(frozen=True)
class Staged:
    """A backend's staging copy as :class:`Parameters` (``staged_parameters``, ``staged_shard_map``)."""

    backend: base.Backend

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.backend.staged_parameters()

    def shard_map(self) -> base.ShardMap | None:
        return self.backend.staged_shard_map()


class NamedSink:
    """Parameters by Hugging Face name, each held whole."""

    def __init__(self, live: Mapping[str, torch.Tensor]) -> None:
        if not live:
            raise ValueError("a sink needs at least one parameter")
        self._live = dict(live)
        self._written: set[str] = set()

    @property
    def device(self) -> torch.device:
        return next(iter(self._live.values())).device

    def required(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(tensor.shape) for name, tensor in self._live.items()}

    def regions(self) -> list[wire.Region]:
        return [wire.Region.whole(name) for name in self._live]

    @torch.no_grad()
    def write(self, region: wire.Region, tensor: torch.Tensor) -> int:
        target = self._live.get(region.name)
        if target is None:
            return 0
        if not region.is_whole:
            raise ValueError(f"{region.name} is held whole here, but a region {region} of it arrived")
        target.copy_(tensor)
        self._written.add(region.name)
        return 1

    def missing(self) -> list[str]:
        return sorted(set(self._live) - self._written)

    def fresh(self) -> NamedSink:
        clone = copy.copy(self)
        clone._written = set()
        return clone


@dataclasses.dataclass(frozen=True)
class _Target:
    megatron_name: str
    piece: weight_maps.Piece

    @property
    def hf_range(self) -> tuple[int, int, int]:
        return self.piece.hf_range


class ShardSink:
    """Megatron-layout parameters of one rank: ``live`` by megatron name, filled per ``specs``
    (:func:`~megafleet_engine.backends.weight_maps.shard_map` of this rank's layout) from HF tensors
    of full shapes ``hf_shapes`` (:func:`~megafleet_engine.backends.weight_maps.hf_shapes`)."""

    def __init__(
        self,
        live: Mapping[str, torch.Tensor],
        specs: Mapping[str, weight_maps.ParamSpec],
        hf_shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        missing = sorted(set(specs) - set(live))
        if missing:
            raise ValueError(f"the shard map names parameters this rank lacks: {missing[:4]}")
        self._live = dict(live)
        self._hf_shapes = dict(hf_shapes)
        self._targets: dict[str, list[_Target]] = {}
        for spec in specs.values():
            for piece in spec.pieces:
                self._targets.setdefault(piece.hf_name, []).append(_Target(spec.name, piece))
        self._written: set[_Target] = set()

    @property
    def device(self) -> torch.device:
        return next(iter(self._live.values())).device

    def required(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._hf_shapes[name]) for name in self._targets}

    def regions(self) -> list[wire.Region]:
        unique = {
            wire.Region(target.piece.hf_name, *target.hf_range)
            for targets in self._targets.values()
            for target in targets
        }
        return sorted(unique, key=lambda region: (region.name, region.dim or 0, region.start))

    @torch.no_grad()
    def write(self, region: wire.Region, tensor: torch.Tensor) -> int:
        written = 0
        for target in self._targets.get(region.name, ()):
            dim, start, stop = target.hf_range
            if not region.covers(dim, start, stop):
                continue
            offset = 0 if region.is_whole else region.start
            source = weight_maps.hf_view(tensor, dataclasses.replace(target.piece, hf_start=start - offset))
            view = weight_maps.megatron_view(self._live[target.megatron_name], target.piece)
            view.copy_(source.view(view.shape))
            self._written.add(target)
            written += 1
        return written

    def missing(self) -> list[str]:
        return sorted(
            {t.megatron_name for targets in self._targets.values() for t in targets if t not in self._written}
        )

    def fresh(self) -> ShardSink:
        clone = copy.copy(self)
        clone._written = set()
        return clone


def sink_for(tensors: Parameters) -> receiver.Sink:
    """The sink over ``tensors`` (a backend's live parameters, or its :class:`Staged` copy): a
    :class:`ShardSink` when they have a megatron :meth:`~megafleet_engine.backends.base.Backend.shard_map`,
    else a :class:`NamedSink` over ``tensors.parameters()``."""
    shards = tensors.shard_map()
    if shards is not None:
        return ShardSink(shards.live, shards.specs, shards.hf_shapes)
    return NamedSink(tensors.parameters())


def pointers(tensors: Parameters) -> dict[str, int]:
    """The storage address of every tensor of ``tensors``, read afresh: equal before and after a
    refit when it wrote in place (a rebound parameter shows a new address)."""
    shards = tensors.shard_map()
    if shards is not None:
        return {name: tensor.data_ptr() for name, tensor in shards.live.items()}
    return {name: tensor.data_ptr() for name, tensor in tensors.parameters().items()}
