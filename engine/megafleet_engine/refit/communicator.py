"""The refit world's communicator: rendezvous through the trainer's ``TCPStore`` and a process group
built by hand over the ranks that move data.

Used by both ends of a refit: the receiver (:mod:`megafleet_engine.refit.receiver`, one communicator
per attempt) and the trainer SDK (:mod:`megafleet.sdk.trainer`). Gloo on CPU, NCCL on GPU, the same
code. The group is constructed directly (``ProcessGroupGloo``/``ProcessGroupNCCL`` over a
``PrefixStore``), never through ``torch.distributed.init_process_group``: an engine rank already uses
the default group for its own shard (TP/PP), and tests hold a trainer and receivers in one process.

**Ranks.** The trainer+fleet world numbers trainer ranks ``0..T-1`` first, then every live shard's
ranks at its rank offset (:func:`megafleet.planner.layout.rank_offsets`). Protocol 1 moves data from
trainer rank 0 only (it holds Hugging Face tensors, gathered by the trainer as NeMo RL's
``hf_export`` payload does), so the transfer group is trainer rank 0 plus every fleet rank: group
rank 0 is the trainer, fleet global rank ``g`` is group rank ``g - T + 1``. Trainer ranks ``1..T-1``
keep their numbers (offsets stay those of the membership) and take no part.

**Deadlines.** Every blocking call is bounded by the attempt's :class:`Deadline`: connecting to the
store, waiting for a key, building the group, each collective (gloo: the op's own timeout; NCCL:
completion is polled). :meth:`Communicator.abort`, called by the watchdog from another thread, tears
the group down: that is what makes a blocked NCCL collective return. Gloo's ``abort`` does not
interrupt an op in progress (measured with torch 2.15: a pending broadcast stays blocked until its
peer goes away), which is why gloo ops carry per-op timeouts that never reach past the deadline, and
why a gloo receive never uses ``Work.wait(timeout)`` on a collective (that leaves the op pending and
the group's destructor blocked until the peer exits).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_engine.refit import errors, wire

__all__ = ["Backend", "Communicator", "Deadline", "Rendezvous", "local_address_towards"]

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
STORE_PREFIX = "megafleet/refit/"
NCCL_TIMEOUT_MARGIN_SECONDS = 600.0
"""NCCL's own per-op timeout is set this far past the deadline, so the refit watchdog (which aborts
the group at the deadline) always acts first: NCCL's timeout handling may end the whole process."""
NCCL_POLL_SECONDS = 0.002
"""How often a wait on an NCCL op checks for completion, abort and the deadline."""
STORE_PROBE_FIRST_SECONDS = 0.02
STORE_PROBE_MAX_SECONDS = 0.5
"""Backoff between probes for the trainer's store, which the trainer may open after the agents join."""
STORE_WAIT_SLICE_SECONDS = 1.0
"""The longest single wait for a store key: how soon an abort ends a wait for a peer that never answers."""
DEADLINE_SLACK_SECONDS = 0.25
"""A torch wait that fails this close to the deadline ran out of time (its own timer may end a moment
early), and is reported as the deadline passing."""


class Deadline:
    """The instant a refit attempt must be over by (monotonic clock)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    @property
    def remaining(self) -> float:
        """Seconds left; zero or negative once passed."""
        return self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.remaining <= 0

    def left(self, what: str) -> datetime.timedelta:
        """The time left as a timeout for the step ``what``; :class:`RefitTimeout` if none is left."""
        remaining = self.remaining
        if remaining <= 0:
            raise errors.RefitTimeout(f"the refit's {self.seconds:g} s deadline passed before {what}")
        return datetime.timedelta(seconds=remaining)


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where and how large the trainer+fleet world of one attempt is.

    Attributes:
        address: host or IP of the trainer's rank 0, where its ``TCPStore`` listens.
        port: the store's port; a fresh one per attempt.
        world_size: trainer ranks plus the ranks of every live shard.
        trainer_world_size: trainer ranks (they come first).
    """

    address: str
    port: int
    world_size: int
    trainer_world_size: int = 1

    def __post_init__(self) -> None:
        if self.trainer_world_size < 1 or self.world_size <= self.trainer_world_size:
            raise ValueError(
                f"a refit world of {self.world_size} ranks with {self.trainer_world_size} trainer ranks has no fleet"
            )

    @property
    def group_size(self) -> int:
        """Ranks of the transfer group: trainer rank 0 and every fleet rank."""
        return self.world_size - self.trainer_world_size + 1

    def group_rank(self, global_rank: int) -> int:
        """The transfer-group rank of global rank ``global_rank`` (trainer rank 0 or a fleet rank)."""
        if global_rank == 0:
            return 0
        if not self.trainer_world_size <= global_rank < self.world_size:
            raise ValueError(
                f"rank {global_rank} is not trainer rank 0 nor a fleet rank "
                f"({self.trainer_world_size}..{self.world_size - 1}) of this refit world"
            )
        return global_rank - self.trainer_world_size + 1

    def global_rank(self, group_rank: int) -> int:
        return 0 if group_rank == 0 else group_rank + self.trainer_world_size - 1


class _Group(Protocol):
    """What we call on a hand-built gloo or NCCL backend (torch's stubs do not list its collectives)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...
    def abort(self) -> None: ...
    def shutdown(self) -> None: ...


class Communicator:
    """One attempt's store client (or server, on the trainer) and transfer group.

    Build with :meth:`connect`; every method but :meth:`abort` is called from one thread (the
    attempt's); :meth:`abort` may be called from any thread. Close with :meth:`close` either way.
    """

    def __init__(
        self,
        store: c10d.Store,
        group: _Group,
        *,
        rendezvous: Rendezvous,
        group_rank: int,
        backend: Backend,
        device: torch.device,
        deadline: Deadline,
        aborted: threading.Event | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.group_rank = group_rank
        self.backend = backend
        self.device = device
        self.deadline = deadline
        self._store: c10d.Store | None = store
        self._group: _Group | None = group
        self._aborted = aborted or threading.Event()
        self._group_aborted = False
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        rendezvous: Rendezvous,
        *,
        global_rank: int,
        backend: Backend,
        device: torch.device,
        deadline: Deadline,
        local_address: str,
        aborted: threading.Event | None = None,
    ) -> Communicator:
        """Join the attempt's world as ``global_rank`` (0: the trainer, which hosts the store).

        Blocks until every rank of the transfer group has joined (gloo) or the deadline passes.
        ``local_address`` is the address the gloo transport binds (this pod's IP). ``aborted``, set
        from another thread, ends the wait for the trainer's store at once and is the
        communicator's abort flag afterwards (the caller may abort before this returns).
        """
        aborted = aborted or threading.Event()
        group_rank = rendezvous.group_rank(global_rank)
        if backend == "nccl":
            torch.cuda.set_device(device)  # the current device is per thread; NCCL uses it
        if group_rank != 0:
            _wait_for_store(rendezvous, deadline, aborted)
        store = _store(rendezvous, is_master=group_rank == 0, deadline=deadline)
        prefixed = c10d.PrefixStore(STORE_PREFIX + "group", store)
        try:
            group = _group(prefixed, group_rank, rendezvous.group_size, backend, local_address, deadline)
        except RuntimeError as error:
            raise _translate(error, deadline, "every rank joined the refit group") from None
        return cls(
            store,
            group,
            rendezvous=rendezvous,
            group_rank=group_rank,
            backend=backend,
            device=device,
            deadline=deadline,
            aborted=aborted,
        )

    # -- control messages ----------------------------------------------------------------------

    def set(self, key: str, value: str) -> None:
        self._live_store().set(STORE_PREFIX + key, value)

    def get(self, key: str, *, what: str) -> bytes:
        """The value of ``key``, waiting for it until the deadline or an abort (``what`` names it in
        errors). A store wait cannot be interrupted, so it waits in slices of
        :data:`STORE_WAIT_SLICE_SECONDS` and checks the abort flag between them: an aborted attempt
        (the operator's abort on a receiver, :meth:`WeightSender.abort` on the trainer) stops waiting
        for a peer that is gone."""
        store = self._live_store()
        full_key = STORE_PREFIX + key
        while True:
            self._check_open(what)
            timeout = min(self.deadline.left(what), datetime.timedelta(seconds=STORE_WAIT_SLICE_SECONDS))
            try:
                store.wait([full_key], timeout)
                value: bytes = store.get(full_key)
                return value
            except dist.DistStoreError as error:  # this slice timed out (a network error is a DistNetworkError)
                if self._aborted.is_set() or self.deadline.remaining <= DEADLINE_SLACK_SECONDS:
                    raise _translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None
            except RuntimeError as error:
                raise _translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    # -- data ----------------------------------------------------------------------------------

    def handshake(self) -> None:
        """Group rank 0 broadcasts ``[MAGIC, MAJOR, group size]``; the others check it. The first
        collective: for NCCL it also creates the communicator."""
        hello = torch.tensor([wire.HANDSHAKE_MAGIC, wire.PROTOCOL_MAJOR, self.rendezvous.group_size], dtype=torch.int64)
        buffer = (hello if self.group_rank == 0 else torch.zeros_like(hello)).to(self.device)
        self.broadcast(buffer, what="the handshake")
        got = [int(value) for value in buffer.cpu().tolist()]
        if got != [int(value) for value in hello.tolist()]:
            raise errors.ProtocolError(
                f"handshake {got} from the trainer, expected [magic {wire.HANDSHAKE_MAGIC:#x}, "
                f"protocol {wire.PROTOCOL_MAJOR}, group size {self.rendezvous.group_size}]"
            )

    def broadcast(self, tensor: torch.Tensor, *, what: str) -> None:
        """Broadcast ``tensor`` from group rank 0 (in place on the others)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        if self.backend == "gloo":
            options.timeout = self.deadline.left(what)  # gloo ends the op itself at the deadline
        self._finish(lambda: self._live_group().broadcast([tensor], options), what=what, self_bounded=True)

    def send(self, tensor: torch.Tensor, *, dst: int, tag: int, what: str) -> dist.Work:
        """Start sending ``tensor`` to group rank ``dst``; finish it with :meth:`wait`."""
        self._check_open(what)
        try:
            return self._live_group().send([tensor], dst, tag)
        except RuntimeError as error:
            raise _translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int, what: str) -> None:
        """Receive ``tensor`` from group rank ``src`` (the whole tensor, in place)."""
        self._finish(lambda: self._live_group().recv([tensor], src, tag), what=what, self_bounded=False)

    def wait(self, work: dist.Work, *, what: str) -> None:
        """Wait for ``work`` (from :meth:`send`) until the deadline."""
        self._finish(lambda: work, what=what, self_bounded=False)

    def _finish(self, start: Callable[[], dist.Work], *, what: str, self_bounded: bool) -> None:
        self._check_open(what)
        try:
            work = start()
            if self.backend == "gloo":
                if self_bounded:
                    work.wait()
                else:  # a point-to-point op: wait(timeout) leaves nothing pending behind
                    work.wait(self.deadline.left(what))
                return
            while not work.is_completed():
                if self._aborted.wait(NCCL_POLL_SECONDS):
                    raise errors.RefitAborted(f"the refit was aborted during {what}")
                if self.deadline.passed:
                    self.abort()
                    raise errors.RefitTimeout(f"the refit's {self.deadline.seconds:g} s deadline passed during {what}")
            work.wait()
        except RuntimeError as error:
            if isinstance(error, errors.RefitError):
                raise
            raise _translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    # -- teardown ------------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self) -> None:
        """Tear the group down so blocked NCCL collectives return (safe from any thread, idempotent)."""
        self._aborted.set()
        with self._lock:
            if self._group_aborted:
                return
            self._group_aborted = True
            group = self._group
        if group is not None:
            try:
                group.abort()
            except RuntimeError as error:  # already torn down by its peer
                log.debug("aborting the refit group: %s", error)

    def close(self) -> None:
        """Release the group and the store (the trainer's store stops listening)."""
        if self._aborted.is_set():
            self.abort()  # a group left in an unknown state is torn down, never drained
        with self._lock:
            group, self._group = self._group, None
            self._store = None
        if group is not None and self.backend == "nccl" and not self._group_aborted:
            try:
                group.shutdown()
            except RuntimeError as error:
                log.warning("shutting the refit group down: %s", error)

    def _check_open(self, what: str) -> None:
        if self._aborted.is_set():
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        self.deadline.left(what)

    def _live_group(self) -> _Group:
        group = self._group
        if group is None:
            raise errors.RefitAborted("the refit group is closed")
        return group

    def _live_store(self) -> c10d.Store:
        store = self._store
        if store is None:
            raise errors.RefitAborted("the refit store is closed")
        return store


def _wait_for_store(rendezvous: Rendezvous, deadline: Deadline, aborted: threading.Event) -> None:
    """Wait until the trainer's store accepts connections, or the deadline or an abort.

    A plain TCP probe, retried with backoff: ``TCPStore``'s own client retries until its timeout
    but overruns it (by ~80 % when measured with torch 2.15) and cannot be interrupted, so probing
    first keeps a receiver whose trainer never comes exactly to its deadline and abortable.
    """
    what = "the trainer's rendezvous store accepted a connection"
    delay = STORE_PROBE_FIRST_SECONDS
    while True:
        remaining = deadline.left(what).total_seconds()
        try:
            with socket.create_connection((rendezvous.address, rendezvous.port), timeout=min(remaining, 5.0)):
                return
        except OSError:
            pass
        if aborted.wait(min(delay, max(deadline.remaining, 0.0))):
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        delay = min(delay * 2, STORE_PROBE_MAX_SECONDS)


def _store(rendezvous: Rendezvous, *, is_master: bool, deadline: Deadline) -> c10d.Store:
    """The trainer's store server (listening on its address only) or a client of it."""
    what = "connecting to the trainer's rendezvous store" if not is_master else "starting the rendezvous store"
    timeout = deadline.left(what)
    try:
        if not is_master:
            return c10d.TCPStore(rendezvous.address, rendezvous.port, None, False, timeout)
        listener = _listen(rendezvous.address, rendezvous.port)
        try:
            store = c10d.TCPStore(
                rendezvous.address,
                rendezvous.port,
                None,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it
        return store
    except RuntimeError as error:
        raise _translate(error, deadline, what) from None


def _listen(address: str, port: int) -> socket.socket:
    """A listening socket on ``address:port`` only (the store would otherwise listen everywhere)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise errors.RefitError(
            f"cannot listen on {address}:{port} for the refit rendezvous: {error.strerror}"
        ) from None
    return listener


def _group(store: c10d.Store, rank: int, size: int, backend: Backend, local_address: str, deadline: Deadline) -> _Group:
    timeout = deadline.left("building the refit group")
    distributed: Any = dist  # the option classes' constructors and fields are not in torch's stubs
    if backend == "gloo":
        options = distributed.ProcessGroupGloo._Options()
        options._devices = [distributed.ProcessGroupGloo.create_device(hostname=local_address)]
        options._timeout = timeout
        return cast(_Group, distributed.ProcessGroupGloo(store, rank, size, options))
    options = distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout + datetime.timedelta(seconds=NCCL_TIMEOUT_MARGIN_SECONDS)
    return cast(_Group, distributed.ProcessGroupNCCL(store, rank, size, options))


def _translate(error: RuntimeError, deadline: Deadline, what: str, *, aborted: bool = False) -> errors.RefitError:
    """A torch error of a refit step as a :class:`RefitError` that says which step failed and why."""
    if aborted:
        return errors.RefitAborted(f"the refit was aborted during {what}")
    if deadline.remaining <= DEADLINE_SLACK_SECONDS:
        return errors.RefitTimeout(f"the refit's {deadline.seconds:g} s deadline passed during {what}")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return errors.RefitError(f"{what} failed: {first_line}")


def local_address_towards(host: str) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])
