"""The refit's transfer group: a gloo or NCCL process group built by hand over the ranks that move
data (trainer rank 0 and every fleet rank), and the ops in flight on it.

Called by :class:`~megafleet_protocol.refit.communicator.Communicator`, which builds a group with
:func:`build` when a round does not keep the last one, and hands :class:`Pending` ops to the
trainer's :mod:`~megafleet_protocol.refit.sender` and an engine rank's
:mod:`~megafleet_protocol.refit.receiver`. The group is built directly over a ``PrefixStore`` of
the trainer's store, never through ``torch.distributed.init_process_group``: an engine rank already
uses the default group for its own shard (docs/refit-protocol.md).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import deadlines

__all__ = ["Group", "Pending", "build"]

NCCL_TIMEOUT_MARGIN_SECONDS = 600.0
"""NCCL's own per-op timeout is set this far past the deadline, so the refit watchdog (which aborts
the group at the deadline) always acts first: NCCL's timeout handling may end the whole process."""


class Group(Protocol):
    """What we call on a hand-built gloo or NCCL backend (torch's stubs do not list its collectives)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...
    def abort(self) -> None: ...
    def shutdown(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Pending:
    """An op in flight (:meth:`Communicator.start_broadcast`, :meth:`Communicator.start_recv`)."""

    work: dist.Work
    what: str
    self_bounded: bool  # a gloo broadcast: it ends itself at the deadline


def build(
    store: c10d.Store,
    rank: int,
    size: int,
    backend: vocabulary.CollectiveBackend,
    local_address: str,
    deadline: deadlines.Deadline,
) -> Group:
    """Group rank ``rank`` of ``size`` over ``store``; blocks until every rank joined (gloo) or the
    deadline. ``local_address`` is where gloo binds; NCCL times its ops out well after the deadline."""
    timeout = deadline.left("building the refit group")
    distributed: Any = dist  # the option classes' constructors and fields are not in torch's stubs
    if backend == "gloo":
        options = distributed.ProcessGroupGloo._Options()
        options._devices = [distributed.ProcessGroupGloo.create_device(hostname=local_address)]
        options._timeout = timeout
        return cast(Group, distributed.ProcessGroupGloo(store, rank, size, options))
    options = distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout + datetime.timedelta(seconds=NCCL_TIMEOUT_MARGIN_SECONDS)
    return cast(Group, distributed.ProcessGroupNCCL(store, rank, size, options))
