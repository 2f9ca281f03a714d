"""The lockstep of a model-parallel shard (tensor/pipeline parallel > 1): what the first rank tells
the other ranks, and how they follow it.

Called by :class:`.backend.MegatronBackend` (a refit's suspend, resume, settle, switch and discard;
the staging decision at build; close) and :class:`.batch_runner.Runner` (one tick per engine step).
Every rank of the model-parallel group builds the backend with the same arguments; the first rank's
``generate`` broadcasts one small :class:`Tick` per engine step (sequences joining and leaving) and
the refit's controls, and the other ranks run :func:`follow` (``serve_followers``), which applies them
in the same order and steps in lockstep, so every rank applies a weight switch between the same two
steps. ``None`` (the first rank's close) ends the followers. A follower that fails to apply a tick
stays in the loop: the first rank fails alike and sends a reset.

Only the first rank's backend thread broadcasts (two threads on one group would interleave their
collectives). A control raised on another thread (a staged refit's discard, on the refit's thread)
is posted (:meth:`Lockstep.post`) and goes out before the next tick that thread broadcasts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch

from megafleet_engine.backends import base
from megafleet_protocol import vocabulary

__all__ = ["Lockstep", "Tick", "follow"]

log = logging.getLogger(__name__)


Control = Literal["", "suspend", "resume", "reset", "settle", "switch", "discard"]
"""A tick's control: ``""`` a step (sequences joining and leaving); ``suspend``/``resume`` megatron's
engine around a refit (``keep``: with sequences in flight); ``reset`` after a failed step; ``settle``
every rank's answer to "do you hold ``version``"; ``switch`` the weights changed under running
sequences (apply ``mode``; ``staged``: first copy the staging copy into the live weights);
``discard`` a staged refit failed (every rank forgets its own writes' outcomes)."""


@dataclasses.dataclass(frozen=True)
class Tick:
    """What the first rank of a model-parallel group tells the others before each engine step
    (``control`` empty: sequences joining, megatron ids leaving), or a control message."""

    join: tuple[base.SequenceRequest, ...] = ()
    leave: tuple[int, ...] = ()
    control: Control = ""
    mode: vocabulary.KvCacheMode = "persist"
    version: int = -1  # settle, switch, discard: the weight version concerned
    timeout_seconds: float = 0.0  # settle: how long a rank may still take to finish its writes
    staged: bool = False  # switch, resume: copy the staging copy into the live weights first
    keep: bool = False  # suspend, resume: the running sequences stay (a refit that keeps them)


class Lockstep:
    """This rank's place in its shard's model-parallel group: ``group`` is the model-parallel
    process group when it spans several ranks (else ``None``), ``leader`` whether this is the first
    rank, ``device`` this rank's CUDA device index (the current device is per thread)."""

    def __init__(self, group: Any, *, leader: bool, device: int) -> None:
        self.group = group
        self.leader = leader
        self.device = device
        self._posted: list[Tick] = []
        self._posted_lock = threading.Lock()

    @property
    def spans_ranks(self) -> bool:
        """Whether the group has ranks other than this one (else nothing is broadcast)."""
        return self.group is not None

    def post(self, tick: Tick) -> None:
        """First rank, any thread: send ``tick`` before the next one the backend thread broadcasts
        (ticks go out only from that thread). Nothing to send without other ranks."""
        if self.spans_ranks:
            with self._posted_lock:
                self._posted.append(tick)

    def broadcast(self, tick: Tick | None) -> Tick | None:
        """The first rank's ``tick``, on every rank (the first rank sends, after whatever was
        posted with :meth:`post`; the others pass ``None``)."""
        if self.leader and self._posted:
            with self._posted_lock:
                posted, self._posted = self._posted, []
            for earlier in posted:
                self._send(earlier)
        return self._send(tick)

    def _send(self, tick: Tick | None) -> Tick | None:
        box: list[Any] = [tick]
        source = torch.distributed.get_global_rank(self.group, 0)
        torch.distributed.broadcast_object_list(box, src=source, group=self.group)
        result: Tick | None = box[0]
        return result

    def agree(self, ok: bool) -> bool:
        """Whether every rank of the group says ``ok`` (an all-reduce, MIN)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=torch.device("cuda", self.device))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def follow(lockstep: Lockstep, handle: Callable[[Tick], None]) -> None:
    """On a rank other than the first: ``handle`` every tick the first rank broadcasts, until it
    broadcasts ``None``."""
    torch.cuda.set_device(lockstep.device)
    while True:
        tick = lockstep.broadcast(None)
        if tick is None:
            return
        try:
            handle(tick)
        except Exception:  # the first rank fails alike and sends a reset: stay in lockstep for it
            log.exception("model-parallel follower: applying %s failed", tick.control or "a step")
