"""The geometry of NeMo RL's M-to-N reshard (``refit_transport: nccl_reshard``): which slice of each
bulk tensor every rank of a training pipeline stage's communicator sends, which every inference rank
receives, and how an inference rank's replicas fill in the rest. Pure arithmetic, no communication.

Used by the fleet's receiver (:mod:`~megafleet_protocol.refit.nemo_reshard`), which runs a rank's
steps over gloo (and, on GPUs, the same steps over NCCL), and by tests that play NeMo's trainer. The
plan is NeMo's own exact-transfer reshard (``xferdtensor``'s Python path), which both ends of a stage's
communicator compute from the same refit info, so their point-to-point messages pair up:

* **Regions.** A parameter's placement over a rank mesh gives each rank a box of the global tensor:
  ``Shard(d)`` on a mesh dimension cuts tensor dimension ``d`` as ``torch.chunk`` does (ceil-sized
  chunks, trailing ones short or empty), several mesh dimensions on one tensor dimension cut in mesh
  order; ``Replicate`` does not cut.
* **Replica groups.** Inference ranks with the same box form a group; its representative is the
  first member at coordinate 0 on every replicated mesh dimension (else the first member), and the
  group's order is the representative, then the others in mesh order.
* **Striped plan** (when every group with several members can split its box's dimension 0 evenly,
  and every remote piece is contiguous at its sender or its receiver): each member of a group
  receives one equal stripe of dimension 0 directly from the sources that overlap it, then the group
  all-gathers the stripes in its order. Remote sources of one region are used in turn.
* **Exact plan** (otherwise): each group's representative receives the whole box from the first
  holder of each overlapping source region, then broadcasts it to the group (root: the
  representative).

Transfers are ``(source, receiver, overlap)`` sorted by that triple; every rank issues its messages in
that order. docs/refit-protocol.md ("NeMo RL's M-to-N reshard") tells the whole wire.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = [
    "Box",
    "Mesh",
    "ParamPlan",
    "Placement",
    "RankSteps",
    "Transfer",
    "parse_placements",
    "plan",
    "regions",
]

Box = tuple[tuple[int, int], ...]
"""A box of a tensor: ``(start, stop)`` per dimension."""

Placement = int | None
"""A placement on one mesh dimension: the tensor dimension it shards (``Shard(d)``), or ``None``
(``Replicate``)."""


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A rank mesh as NeMo's refit info carries it (``{"mesh": nested list of ranks}``): row-major,
    the last dimension fastest."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def parse(cls, wire: Any) -> Mesh:
        """From the wire form (``{"mesh": [[...], ...]}``, or the nested list itself)."""
        nested = wire["mesh"] if isinstance(wire, Mapping) else wire
        shape: list[int] = []
        level: Any = nested
        while isinstance(level, list | tuple):
            shape.append(len(level))
            level = level[0] if level else None
        flat: list[int] = []

        def walk(node: Any) -> None:
            if isinstance(node, list | tuple):
                for child in node:
                    walk(child)
            else:
                flat.append(int(node))

        walk(nested)
        if math.prod(shape) != len(flat) or not flat:
            raise ValueError(f"a rank mesh must be a non-empty rectangular nested list, not {nested!r}")
        return cls(tuple(shape), tuple(flat))

    def coordinates(self, index: int) -> tuple[int, ...]:
        found: list[int] = []
        for size in reversed(self.shape):
            found.append(index % size)
            index //= size
        return tuple(reversed(found))


def parse_placements(wire: Sequence[Any]) -> tuple[Placement, ...]:
    """NeMo's wire placements: ``{"dim": d}`` is ``Shard(d)``, ``{}`` is ``Replicate``."""
    parsed: list[Placement] = []
    for placement in wire:
        if not isinstance(placement, Mapping):
            raise ValueError(f"a placement on the wire is a mapping ({{'dim': d}} or {{}}), not {placement!r}")
        parsed.append(int(placement["dim"]) if "dim" in placement else None)
    return tuple(parsed)


def regions(mesh: Mesh, placements: Sequence[Placement], shape: Sequence[int]) -> dict[int, Box]:
    """Each rank's box of a tensor of ``shape`` placed over ``mesh`` (in mesh order)."""
    if len(placements) != len(mesh.shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh.shape)}-dimensional mesh")
    ndim = len(shape)
    cuts: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if placement is not None:
            dim = placement + ndim if placement < 0 else placement
            if not 0 <= dim < ndim:
                raise ValueError(f"Shard({placement}) does not fit a {ndim}-dimensional tensor")
            cuts.setdefault(dim, []).append(mesh_dim)
    found: dict[int, Box] = {}
    for index, rank in enumerate(mesh.ranks):
        coordinates = mesh.coordinates(index)
        box = [(0, int(size)) for size in shape]
        for dim, mesh_dims in cuts.items():
            start, size = 0, int(shape[dim])
            for mesh_dim in mesh_dims:
                parts = mesh.shape[mesh_dim]
                chunk = -(-size // parts) if size else 0
                offset = min(size, coordinates[mesh_dim] * chunk)
                start, size = start + offset, min(chunk, size - offset)
            box[dim] = (start, start + size)
        found[rank] = tuple(box)
    return found


def intersect(left: Box, right: Box) -> Box | None:
    """The overlap of two boxes, or ``None`` when they share no element."""
    overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(left, right, strict=True))
    return None if any(start >= stop for start, stop in overlap) else overlap


def numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def local(box: Box, within: Box) -> tuple[slice, ...]:
    """``box`` as slices of the local tensor that holds ``within``."""
    return tuple(slice(start - base, stop - base) for (start, stop), (base, _) in zip(box, within, strict=True))


def contiguous_in(box: Box, within: Box) -> bool:
    """Whether ``box`` is one contiguous run of the row-major tensor that holds ``within``."""
    outer = [stop - start for start, stop in within]
    inner = [stop - start for start, stop in box]
    outer_stride = expected = 1
    for outer_size, inner_size in zip(reversed(outer), reversed(inner), strict=True):
        if inner_size > 1:
            if outer_stride != expected:
                return False
            expected *= inner_size
        outer_stride *= outer_size
    return True


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One piece of a parameter: ``overlap`` (a box of the global tensor) from ``source`` to
    ``receiver``; ``tag`` is its index in the plan's order (the gloo transport's message tag)."""

    source: int
    receiver: int
    overlap: Box
    tag: int


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """Inference ranks holding the same box, in the group's order (representative first)."""

    box: Box
    members: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """The reshard of one parameter between a source and a destination mesh."""

    kind: Literal["striped", "exact"]
    shape: tuple[int, ...]
    sources: dict[int, Box]
    destinations: dict[int, Box]
    transfers: tuple[Transfer, ...]
    groups: tuple[ReplicaGroup, ...]  # active ones only: several members, a non-empty box
    stripes: dict[int, Box]  # striped: each member's stripe of its group's box

    def steps(self, rank: int) -> RankSteps:
        """What ``rank`` does, in order: its sends, its receives, then its group's fan-out."""
        group = next((g for g in self.groups if rank in g.members), None)
        return RankSteps(
            rank=rank,
            sends=tuple(t for t in self.transfers if t.source == rank and t.receiver != rank),
            receives=tuple(t for t in self.transfers if t.receiver == rank and t.source != rank),
            copies=tuple(t for t in self.transfers if t.receiver == rank and t.source == rank),
            group=group,
            fan_out=None if group is None else ("all_gather" if self.kind == "striped" else "broadcast"),
            stripe=self.stripes.get(rank),
        )


@dataclasses.dataclass(frozen=True)
class RankSteps:
    """One rank's part of a :class:`ParamPlan`."""

    rank: int
    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]
    copies: tuple[Transfer, ...]
    group: ReplicaGroup | None
    fan_out: Literal["all_gather", "broadcast"] | None
    stripe: Box | None


def plan(
    shape: Sequence[int],
    source: tuple[Mesh, tuple[Placement, ...]],
    destination: tuple[Mesh, tuple[Placement, ...]],
) -> ParamPlan:
    """The reshard of a tensor of ``shape`` from ``source`` (mesh, placements) to ``destination``."""
    return _plan(tuple(int(size) for size in shape), source, destination)


@functools.lru_cache(maxsize=1024)
def _plan(
    shape: tuple[int, ...],
    source: tuple[Mesh, tuple[Placement, ...]],
    destination: tuple[Mesh, tuple[Placement, ...]],
) -> ParamPlan:
    sources = regions(*source, shape)
    destinations = regions(*destination, shape)
    groups = _replica_groups(destination[0], destination[1], destinations)
    held: dict[Box, list[int]] = {}
    for rank, box in sources.items():
        held.setdefault(box, []).append(rank)
    active = tuple(ReplicaGroup(box, members) for box, members in groups if len(members) > 1 and numel(box) > 0)
    striped = _striped(groups, held, sources, destinations)
    if striped is not None:
        transfers, stripes = striped
        return ParamPlan("striped", shape, sources, destinations, transfers, active, stripes)
    pieces: list[tuple[int, int, Box]] = []
    for box, members in groups:
        representative = members[0]
        for source_box, holders in held.items():
            overlap = intersect(source_box, box)
            if overlap is not None:
                pieces.append((representative if representative in holders else holders[0], representative, overlap))
    return ParamPlan("exact", shape, sources, destinations, _ordered(pieces), active, {})


def _replica_groups(
    mesh: Mesh, placements: Sequence[Placement], destinations: Mapping[int, Box]
) -> list[tuple[Box, tuple[int, ...]]]:
    """Destination ranks grouped by box, each group in its order (representative first)."""
    by_box: dict[Box, list[int]] = {}
    for rank in mesh.ranks:
        by_box.setdefault(destinations[rank], []).append(rank)
    replicated = [dim for dim, placement in enumerate(placements) if placement is None]
    coordinates = {rank: mesh.coordinates(index) for index, rank in enumerate(mesh.ranks)}
    found = []
    for box, members in by_box.items():
        preferred = [rank for rank in members if all(coordinates[rank][dim] == 0 for dim in replicated)]
        representative = (preferred or members)[0]
        found.append((box, (representative, *(rank for rank in members if rank != representative))))
    return found


def _striped(
    groups: Sequence[tuple[Box, tuple[int, ...]]],
    held: Mapping[Box, list[int]],
    sources: Mapping[int, Box],
    destinations: Mapping[int, Box],
) -> tuple[tuple[Transfer, ...], dict[int, Box]] | None:
    targets: list[tuple[Box, int]] = []
    stripes: dict[int, Box] = {}
    for box, members in groups:
        if numel(box) == 0:
            continue
        if len(members) == 1:
            targets.append((box, members[0]))
            continue
        if not box or (box[0][1] - box[0][0]) % len(members):
            return None
        height = (box[0][1] - box[0][0]) // len(members)
        for index, member in enumerate(members):
            start = box[0][0] + index * height
            stripe = ((start, start + height), *box[1:])
            targets.append((stripe, member))
            stripes[member] = stripe
    if not stripes:
        return None
    uses = dict.fromkeys(held, 0)
    pieces: list[tuple[int, int, Box]] = []
    for target, receiver in targets:
        for source_box, holders in held.items():
            overlap = intersect(source_box, target)
            if overlap is None:
                continue
            if receiver in holders:
                sender = receiver
            else:
                sender = holders[uses[source_box] % len(holders)]
                uses[source_box] += 1
            pieces.append((sender, receiver, overlap))
    transfers = _ordered(pieces)
    for transfer in transfers:
        if transfer.source == transfer.receiver:
            continue
        if not (
            contiguous_in(transfer.overlap, sources[transfer.source])
            or contiguous_in(transfer.overlap, destinations[transfer.receiver])
        ):
            return None  # would need packing at the sender and staging at the receiver: the exact plan
    return transfers, stripes


def _ordered(pieces: list[tuple[int, int, Box]]) -> tuple[Transfer, ...]:
    return tuple(Transfer(s, r, box, tag) for tag, (s, r, box) in enumerate(sorted(pieces)))
