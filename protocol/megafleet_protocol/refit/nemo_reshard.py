"""The receiving side of NeMo RL's M-to-N reshard (``refit_transport: nccl_reshard``): a fleet rank joins
the communicator of every training pipeline stage (``init_nccl_reshard_comm_group``) and, per refit,
receives from each stage's ranks exactly the slices of that stage's bulk parameters it keeps, then
fills in the rest of its box from its replicas; no rank holds a whole tensor it does not keep. NeMo's
"misc" tensors ride its packed broadcast over the world joined by ``init_collective``
(:class:`~megafleet_protocol.refit.nemo.NemoReceiver`), strictly after the bulk, as NeMo sends them.

Used by the engine's reshard refit source and by tests that play NeMo's trainer. The plan of every
message is :mod:`~megafleet_protocol.refit.nemo_reshard_plan`'s (NeMo's exact-transfer reshard); this
module runs a rank's steps of it. Each stage communicator is NeMo's ``StatelessProcessGroup``: a store
at the stage's address and port whose rank 0 is the stage's first trainer rank, NeMo's unique id and
its warm-up broadcast (the rendezvous of :mod:`~megafleet_protocol.refit.nemo_rendezvous`), this rank
being ``train_ranks_per_stage + rank prefix + shard-local rank``.

Transport: gloo over each stage's store (the CPU stand-in for NCCL; point-to-point messages tagged
with their index in the plan, replica fan-out over a gloo group of the replicas only). The NCCL
transport runs the same steps (grouped sends and receives, then the fan-out over a split of the
stage communicator) and is left for GPUs (docs/refit-protocol.md, "NeMo RL's M-to-N reshard").
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from megafleet_protocol.refit import (
    deadlines,
    errors,
    nemo_rendezvous,
    nemo_reshard_info,
    nemo_reshard_plan,
    rendezvous_store,
    wire,
)

__all__ = ["GLOO_PREFIX", "ReshardReceiver", "ReshardStats", "StageWorld", "Write", "replica_prefix"]

log = logging.getLogger(__name__)

GLOO_PREFIX = "megafleet/nemo-reshard-gloo/"
"""Store prefix of a stage's gloo communicator (both ends use the same one)."""

Write = Callable[[wire.Region, torch.Tensor], int]
"""``write(region, tensor)``: copy a received slice into the live parameters; how many it wrote."""


def replica_prefix(members: Sequence[int]) -> str:
    """The store prefix of the gloo group of one replica group (under :data:`GLOO_PREFIX`)."""
    return f"replicas/{'-'.join(str(member) for member in members)}/"


@dataclasses.dataclass(frozen=True)
class StageWorld:
    """One training pipeline stage's communicator as a fleet rank joins it: the stage's store at
    ``address:port``, ``world_size`` (``train_ranks_per_stage`` + every inference rank), this rank."""

    stage: int
    address: str
    port: int
    world_size: int
    rank: int
    train_ranks: int

    def nemo_world(self) -> nemo_rendezvous.NemoWorld:
        return nemo_rendezvous.NemoWorld(self.address, self.port, self.world_size, self.rank, self.train_ranks)


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """What one refit's bulk took in."""

    params: int
    bytes_received: int
    regions_written: int


class _Group(Protocol):
    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> dist.Work: ...
    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work: ...
    def abort(self) -> None: ...


def gloo_group(
    store: c10d.Store, rank: int, size: int, *, local_address: str, timeout: datetime.timedelta | float
) -> _Group:
    """A gloo process group of ``size`` ranks over ``store`` (tests' trainers build theirs the same way);
    ``timeout`` bounds its construction and each of its operations."""
    distributed: Any = dist  # the option classes' constructors and fields are not in torch's stubs
    options = distributed.ProcessGroupGloo._Options()
    options._devices = [distributed.ProcessGroupGloo.create_device(hostname=local_address)]
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    options._timeout = datetime.timedelta(seconds=max(seconds, 0.001))
    return cast(_Group, distributed.ProcessGroupGloo(store, rank, size, options))


class _Stage:
    """One joined stage communicator (gloo) and the gloo groups of its replica groups."""

    def __init__(self, world: StageWorld, store: c10d.Store, group: _Group, local_address: str) -> None:
        self.world = world
        self.store = store  # kept open: the stage's store counts its clients
        self.group = group
        self.local_address = local_address
        self.replicas: dict[tuple[int, ...], _Group] = {}
        self.aborted = False

    def run(self, works: list[dist.Work], deadline: deadlines.Deadline, what: str) -> None:
        if self.aborted:
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            raise deadlines.translate(error, deadline, what, aborted=self.aborted) from None

    def replica_group(self, members: tuple[int, ...], deadline: deadlines.Deadline) -> _Group:
        found = self.replicas.get(members)
        if found is None:
            store = c10d.PrefixStore(GLOO_PREFIX + replica_prefix(members), self.store)
            what = f"building the gloo group of replicas {list(members)} of stage {self.world.stage}"
            try:
                found = gloo_group(
                    store,
                    members.index(self.world.rank),
                    len(members),
                    local_address=self.local_address,
                    timeout=deadline.left(what),
                )
            except RuntimeError as error:
                raise deadlines.translate(error, deadline, what) from None
            self.replicas[members] = found
        return found

    def abort(self) -> None:
        self.aborted = True
        for group in (self.group, *self.replicas.values()):
            try:
                group.abort()
            except RuntimeError as error:
                log.debug("aborting a gloo group of stage %d: %s", self.world.stage, error)


class ReshardReceiver:
    """One fleet rank's membership of every stage communicator: joined once (NeMo builds them once per
    run, and again at a rebuild), then :meth:`receive` per refit. :meth:`abort` may be called from
    any thread."""

    def __init__(self, stages: Sequence[_Stage]) -> None:
        self._stages = {stage.world.stage: stage for stage in stages}
        self.refits = 0

    @property
    def worlds(self) -> list[StageWorld]:
        return [stage.world for stage in self._stages.values()]

    @classmethod
    def connect(
        cls,
        worlds: Sequence[StageWorld],
        *,
        backend: Literal["gloo", "nccl"],
        deadline: deadlines.Deadline,
        aborted: threading.Event | None = None,
        local_address: str | None = None,
    ) -> ReshardReceiver:
        """Join every stage's communicator, in stage order (each stage's trainer ranks wait in their
        own; NeMo's generation workers join them in this order): rendezvous, group, warm-up."""
        if backend != "gloo":
            raise NotImplementedError(
                "the fleet's NCCL transport of NeMo's reshard is not built yet: it runs the same plan over "
                "NCCL point-to-point and a split of each stage communicator (docs/refit-protocol.md)"
            )
        joined: list[_Stage] = []
        try:
            for world in sorted(worlds, key=lambda world: world.stage):
                store, generation, _unique_id = nemo_rendezvous.rendezvous(
                    world.nemo_world(), deadline=deadline, aborted=aborted
                )
                bind = local_address or rendezvous_store.local_address_towards(world.address)
                what = f"every rank joined the gloo group of stage {world.stage}"
                try:
                    group = gloo_group(
                        c10d.PrefixStore(GLOO_PREFIX, store),
                        world.rank,
                        world.world_size,
                        local_address=bind,
                        timeout=deadline.left(what),
                    )
                except RuntimeError as error:
                    raise nemo_rendezvous.failed(error, deadline, what) from None
                stage = _Stage(world, store, group, bind)
                joined.append(stage)
                _warm_up(stage, generation, deadline)
        except BaseException:
            for stage in joined:
                stage.abort()
            raise
        return cls(joined)

    def receive(
        self,
        receives: Sequence[nemo_reshard_info.Receive],
        *,
        write: Write,
        deadline: deadlines.Deadline,
    ) -> ReshardStats:
        """Receive one refit's bulk: for each entry of this rank's receive map (in the trainer's order,
        stage after stage), this rank's pieces from the stage's senders, then its replica group's
        fan-out; each finished box is handed to ``write``."""
        received = written = 0
        for entry in receives:
            stage = self._stages.get(entry.param.stage)
            if stage is None:
                raise errors.ProtocolError(
                    f"{entry.param.name} comes from pipeline stage {entry.param.stage}, whose communicator "
                    f"this rank never joined (stages {sorted(self._stages)})"
                )
            buffer, count = _receive_param(stage, entry, deadline)
            received += count
            written += write(entry.region, buffer)
        self.refits += 1
        return ReshardStats(len(receives), received, written)

    @property
    def closed(self) -> bool:
        return any(stage.aborted for stage in self._stages.values())

    def abort(self) -> None:
        """Tear every stage communicator down (any thread); the receiver is unusable afterwards."""
        for stage in self._stages.values():
            stage.abort()

    def close(self) -> None:
        """Leave every stage communicator (a rebuild makes new ones)."""
        self.abort()


def _warm_up(stage: _Stage, generation: nemo_rendezvous.Generation, deadline: deadlines.Deadline) -> None:
    data = torch.zeros(1, dtype=torch.float32)
    what = f"the warm-up of stage {stage.world.stage}"
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = deadline.left(what)
    stage.run([stage.group.broadcast([data], options)], deadline, what)
    if generation == "nemo" and float(data.item()) != 1.0:
        raise errors.ProtocolError(f"{what} carried {float(data.item())}, not 1.0")


def _receive_param(
    stage: _Stage, entry: nemo_reshard_info.Receive, deadline: deadlines.Deadline
) -> tuple[torch.Tensor, int]:
    """This rank's box of one parameter: its pieces (straight into the box when contiguous there,
    else through a staging tensor), then its replica group's fan-out."""
    param, box = entry.param, entry.box
    steps = param.plan().steps(stage.world.rank)
    if steps.sends or steps.copies:
        raise errors.ProtocolError(f"{param.name}: the plan has rank {stage.world.rank} send, but it is a receiver")
    buffer = torch.empty([stop - start for start, stop in box], dtype=param.dtype)
    works, staged, count = [], [], 0
    for transfer in steps.receives:
        view = buffer[nemo_reshard_plan.local(transfer.overlap, box)]
        target = view if view.is_contiguous() else torch.empty(view.shape, dtype=param.dtype)
        if target is not view:
            staged.append((view, target))
        works.append(stage.group.recv([target], transfer.source, transfer.tag))
        count += target.numel() * target.element_size()
    stage.run(works, deadline, f"receiving {param.name} from stage {stage.world.stage}")
    for view, target in staged:
        view.copy_(target)
    if steps.group is not None and buffer.numel():
        _fan_out(stage, steps, buffer, box, deadline, param.name)
    return buffer, count


def _fan_out(
    stage: _Stage,
    steps: nemo_reshard_plan.RankSteps,
    buffer: torch.Tensor,
    box: nemo_reshard_plan.Box,
    deadline: deadlines.Deadline,
    name: str,
) -> None:
    assert steps.group is not None
    members = steps.group.members
    group = stage.replica_group(members, deadline)
    what = f"the {steps.fan_out} of {name} among replicas {list(members)}"
    if steps.fan_out == "broadcast":
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = deadline.left(what)
        stage.run([group.broadcast([buffer], options)], deadline, what)
        return
    assert steps.stripe is not None
    height = steps.stripe[0][1] - steps.stripe[0][0]
    stripes = [buffer.narrow(0, start, height) for start in range(0, buffer.shape[0], height)]
    mine = stripes[members.index(stage.world.rank)].clone()
    stage.run([group.allgather([stripes], [mine])], deadline, what)
