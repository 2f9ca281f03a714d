"""The refit world's communicator: one rank's client (or, on the trainer, server) of the trainer's
session in its ``TCPStore``, and the transfer group over the ranks that move data, kept from one
refit to the next while nothing changes.

Used by both ends: the trainer's :mod:`~megafleet_protocol.refit.sender` and the engine's
:mod:`~megafleet_protocol.refit.receiver` (through :mod:`megafleet_engine.refit_attempts`). Invariants:
every store key of a refit lives under its round (``round/<version>/``); every blocking call is
bounded by the round's :class:`~megafleet_protocol.refit.deadlines.Deadline`;
:meth:`Communicator.abort` (from any thread) tears the group down so a blocked collective returns.
docs/refit-protocol.md tells the ranks, the session and rounds, group reuse, the deadlines and the
asynchronous ops this implements.

One class, not a session half and a transport half: one :class:`Communicator` owns both the store
and the group under one lock and abort flag (a round's decision keeps or rebuilds the group, the
handshake is the group's first collective, an abort must reach both), so splitting it would split
that state. What it is built from lives beside it: where the world meets and the store
(:mod:`~megafleet_protocol.refit.rendezvous_store`), the deadline
(:mod:`~megafleet_protocol.refit.deadlines`), the round's messages
(:mod:`~megafleet_protocol.refit.round_messages`) and the group itself
(:mod:`~megafleet_protocol.refit.transfer_group`). :class:`Deadline`, :class:`Rendezvous` and
:func:`local_address_towards`, the arguments of :meth:`Communicator.connect`, are importable from
here too.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol import vocabulary
from megafleet_protocol.refit import (
    cuda_streams,
    deadlines,
    errors,
    rendezvous_store,
    round_messages,
    transfer_group,
    wire,
)
from megafleet_protocol.refit.deadlines import Deadline
from megafleet_protocol.refit.rendezvous_store import Rendezvous, local_address_towards

__all__ = ["STORE_PREFIX", "Communicator", "Deadline", "Rendezvous", "local_address_towards"]

log = logging.getLogger(__name__)

STORE_PREFIX = "megafleet/refit/"
"""Every key of the refit in the trainer's store: ``session``, ``round/<version>/...`` and each
group's ``group/<name>/`` prefix."""
SESSION_KEY = "session"
"""The trainer's session id (outside any round): a receiver holding a group of another session never reuses it."""
POLL_SECONDS = 0.0002
"""How often a host wait on an NCCL op or a CUDA event checks for completion, abort and the deadline
(only where the host must wait: the handshake, the end of a transfer; never per bucket)."""
STORE_WAIT_SLICE_SECONDS = 1.0
"""The longest single wait for a store key: how soon an abort ends a wait for a peer that never answers."""


class Communicator:
    """One rank's store client (or server, on the trainer), session and transfer group.

    Build with :meth:`connect`, then :meth:`open_round` for each refit; every method but
    :meth:`abort` is called from one thread at a time (a round's); :meth:`abort` may be called from
    any thread. Close with :meth:`close` either way.
    """

    def __init__(
        self,
        store: c10d.Store,
        *,
        rendezvous: rendezvous_store.Rendezvous,
        group_rank: int,
        backend: vocabulary.CollectiveBackend,
        device: torch.device,
        deadline: deadlines.Deadline,
        local_address: str,
        aborted: threading.Event | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.group_rank = group_rank
        self.backend = backend
        self.device = device
        self.deadline = deadline
        self.local_address = local_address
        self.session = ""
        """The trainer's session id (rank 0 draws it, the others read it from the store)."""
        self.group_name: str | None = None
        """The transfer group held now (``None``: none yet, or dropped)."""
        self.namespace = ""
        """Key prefix of the current round (``round/<version>/``); every :meth:`get`/:meth:`set` uses it."""
        self.reused = False
        """Whether the current round kept the group of an earlier round (no group was built)."""
        self.held_manifest: str | None = None
        """The manifest id the trainer confirmed every receiver holds in the current round (no
        manifest exchange then), or ``None``."""
        self.asked_checksums: frozenset[str] = frozenset()
        """Trainer: the digests every receiver asked for in its hello of the current round (a receiver
        older than digests asks for none)."""
        self.asks_commit = False
        """Receiver: its next hello says it waits for the trainer's commit after it staged."""
        self.commit_ranks: frozenset[int] = frozenset()
        """Trainer: the group ranks whose hello of the current round waits for its commit."""
        self.rounds = 0
        """Rounds opened on this communicator."""
        self._store: c10d.Store | None = store
        self._group: transfer_group.Group | None = None
        self._aborted = aborted or threading.Event()
        self._group_aborted = False
        self._lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        rendezvous: rendezvous_store.Rendezvous,
        *,
        global_rank: int,
        backend: vocabulary.CollectiveBackend,
        device: torch.device,
        deadline: deadlines.Deadline,
        local_address: str,
        aborted: threading.Event | None = None,
    ) -> Communicator:
        """Join the trainer's session as ``global_rank`` (0: the trainer, which hosts the store and
        draws the session id; others wait for the store and read it). No group is built here:
        :meth:`open_round` builds one or keeps the last.

        ``local_address`` is the address the gloo transport binds (this pod's IP). ``aborted``, set
        from another thread, ends the wait for the trainer's store at once and is the
        communicator's abort flag afterwards (the caller may abort before this returns).
        """
        aborted = aborted or threading.Event()
        group_rank = rendezvous.group_rank(global_rank)
        if backend == "nccl":
            torch.cuda.set_device(device)  # the current device is per thread; NCCL uses it
        if group_rank != 0:
            rendezvous_store.wait_listening(
                rendezvous.address,
                rendezvous.port,
                deadline=deadline,
                aborted=aborted,
                what="the trainer's rendezvous store accepted a connection",
            )
        store = rendezvous_store.open_store(rendezvous, is_master=group_rank == 0, deadline=deadline)
        comm = cls(
            store,
            rendezvous=rendezvous,
            group_rank=group_rank,
            backend=backend,
            device=device,
            deadline=deadline,
            local_address=local_address,
            aborted=aborted,
        )
        if group_rank == 0:
            comm.session = secrets.token_hex(16)
            comm.set(SESSION_KEY, comm.session, scoped=False)
        else:
            comm.session = comm.get(SESSION_KEY, what="the trainer's session id", scoped=False).decode()
        return comm

    # -- rounds --------------------------------------------------------------------------------

    def open_round(self, version: int, *, manifest: str | None = None, checksums: tuple[str, ...] = ()) -> bool:
        """Open the round of weight version ``version``: agree with every rank on the transfer group
        (keep the current one, or build a new one and handshake over it); returns whether the
        group was kept (also :attr:`reused`). The trainer waits for every receiver's hello; a
        receiver waits for the trainer's decision.

        ``manifest`` carries the manifest exchange's shortcut: on a receiver, the id of the last
        manifest it accepted (and can take again as it is); on the trainer, the id of the manifest
        it is about to offer. When every receiver holds the trainer's id, the decision says so and
        :attr:`held_manifest` is that id on every rank: the manifest, verdicts and go are skipped.
        ``checksums`` (a receiver): the digests it asks the trainer to seal its buckets with; the
        trainer learns which every receiver asked for (:attr:`asked_checksums`)."""
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)  # this round may run on another thread than the last
        self.namespace = f"round/{version}/"
        self.rounds += 1
        self.held_manifest = None
        if self.group_rank == 0:
            self._decide(version, manifest)
        else:
            self._follow(manifest, checksums)
        return self.reused

    def _decide(self, version: int, manifest: str | None) -> None:
        hellos: dict[int, round_messages.Hello] = {}
        for group_rank in range(1, self.rendezvous.group_size):
            what = f"the hello of rank {self.rendezvous.global_rank(group_rank)}"
            raw = self.get(round_messages.hello_key(group_rank), what=what)
            hellos[group_rank] = round_messages.Hello.decode(raw)
        keep = (
            self.group_name is not None
            and self._group is not None
            and not self._group_aborted
            and all(hello.session == self.session and hello.group == self.group_name for hello in hellos.values())
        )
        name = self.group_name if keep and self.group_name is not None else f"v{version}"
        held = manifest is not None and all(hello.manifest == manifest for hello in hellos.values())
        asked = [frozenset(hello.checksums) for hello in hellos.values()]
        self.asked_checksums = frozenset.intersection(*asked) if asked else frozenset()
        self.commit_ranks = frozenset(rank for rank, hello in hellos.items() if hello.commit)
        self.held_manifest = manifest if held else None
        decision = round_messages.Decision(name, keep, self.held_manifest, commit=bool(self.commit_ranks))
        self.set(round_messages.GROUP_KEY, decision.encode())
        self.reused = keep
        if not keep:
            self._regroup(name)
            self.handshake()

    def _follow(self, manifest: str | None, checksums: tuple[str, ...]) -> None:
        hello = round_messages.Hello(self.session, self.group_name, manifest, checksums, self.asks_commit)
        self.set(round_messages.hello_key(self.group_rank), hello.encode())
        raw = self.get(round_messages.GROUP_KEY, what="the trainer's group decision")
        decision = round_messages.Decision.decode(raw)
        if self.asks_commit and not decision.commit:
            raise errors.ProtocolError(
                "this refit waits for the trainer's commit, but the trainer's SDK does not commit (it is older "
                "than the two-phase commit): nothing was received; use commit operator or local"
            )
        if decision.manifest is not None and decision.manifest != manifest:
            raise errors.ProtocolError(
                f"the trainer says this rank holds manifest {decision.manifest!r}, but it holds {manifest!r}"
            )
        self.held_manifest = decision.manifest
        self.reused = decision.keep
        if decision.keep:
            if decision.group != self.group_name or self._group is None:
                raise errors.ProtocolError(
                    f"the trainer keeps group {decision.group!r}, but this rank holds {self.group_name!r}"
                )
            return
        self._regroup(decision.group)
        self.handshake()

    def _regroup(self, name: str) -> None:
        """Drop the group held (if any) and build group ``name`` over its own store prefix; blocks
        until every rank joined (gloo) or the deadline."""
        self._drop_group()
        prefixed = c10d.PrefixStore(f"{STORE_PREFIX}group/{name}/", self._live_store())
        try:
            group = transfer_group.build(
                prefixed, self.group_rank, self.rendezvous.group_size, self.backend, self.local_address, self.deadline
            )
        except RuntimeError as error:
            raise deadlines.translate(error, self.deadline, "every rank joined the refit group") from None
        with self._lock:
            self._group, self.group_name, self._group_aborted = group, name, False
        if self._aborted.is_set():  # aborted while building: the abort did not see this group
            self._abort_group()

    def _drop_group(self) -> None:
        """Tear the group down locally (abort: it never waits for peers, which may have dropped it too)."""
        self._abort_group()
        with self._lock:
            self._group, self.group_name, self._group_aborted = None, None, False

    def rearm(self, deadline: deadlines.Deadline, aborted: threading.Event) -> None:
        """Give a parked communicator the next attempt's deadline and abort flag (receiver side)."""
        with self._lock:
            if self._group_aborted or self._store is None or self._aborted.is_set():
                raise errors.RefitAborted("the parked refit group was torn down")
            self.deadline = deadline
            self._aborted = aborted

    def check_session(self, timeout_seconds: float) -> None:
        """Raise :class:`RefitError` unless the trainer's store still answers with this
        communicator's session id (within ``timeout_seconds``, at most the deadline): a trainer
        that restarted or reopened its sender on the same port has another session, or none."""
        store = self._live_store()
        bound = min(datetime.timedelta(seconds=timeout_seconds), self.deadline.left("checking the trainer's session"))
        try:
            store.set_timeout(bound)
            value = store.get(STORE_PREFIX + SESSION_KEY).decode()
        except RuntimeError as error:
            raise deadlines.translate(error, self.deadline, "checking the trainer's session") from None
        if value != self.session:
            raise errors.RefitError("the trainer's session changed")

    # -- control messages ----------------------------------------------------------------------

    def set(self, key: str, value: str, *, scoped: bool = True, namespace: str | None = None) -> None:
        """Set ``key`` of the current round (``scoped=False``: outside any round; ``namespace``: of
        that round, which may be over)."""
        full_key = STORE_PREFIX + namespace + key if namespace is not None else self._key(key, scoped)
        self._live_store().set(full_key, value)

    def get(self, key: str, *, what: str, scoped: bool = True) -> bytes:
        """The value of ``key`` of the current round, waiting for it until the deadline or an abort
        (``what`` names it in errors). A store wait cannot be interrupted, so it waits in slices of
        :data:`STORE_WAIT_SLICE_SECONDS` and checks the abort flag between them: an aborted attempt
        (the operator's abort on a receiver, :meth:`WeightSender.abort` on the trainer) stops waiting
        for a peer that is gone."""
        store = self._live_store()
        full_key = self._key(key, scoped)
        while True:
            self._check_open(what)
            timeout = min(self.deadline.left(what), datetime.timedelta(seconds=STORE_WAIT_SLICE_SECONDS))
            try:
                store.wait([full_key], timeout)
                value: bytes = store.get(full_key)
                return value
            except dist.DistStoreError as error:  # this slice timed out (a network error is a DistNetworkError)
                if self._aborted.is_set() or self.deadline.remaining <= deadlines.DEADLINE_SLACK_SECONDS:
                    raise deadlines.translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None
            except RuntimeError as error:
                raise deadlines.translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    def delete(self, keys: list[str], *, namespace: str) -> None:
        """Delete ``keys`` of the round ``namespace`` (best effort: a finished round's messages)."""
        store = self._live_store()
        for key in keys:
            try:
                store.delete_key(STORE_PREFIX + namespace + key)
            except RuntimeError as error:
                log.debug("deleting refit key %s: %s", key, error)

    def _key(self, key: str, scoped: bool) -> str:
        return STORE_PREFIX + (self.namespace if scoped else "") + key

    # -- data ----------------------------------------------------------------------------------

    def handshake(self) -> None:
        """Group rank 0 broadcasts ``[MAGIC, MAJOR, group size]``; the others check it. The first
        collective of a group: for NCCL it also creates the communicator."""
        hello = torch.tensor([wire.HANDSHAKE_MAGIC, wire.PROTOCOL_MAJOR, self.rendezvous.group_size], dtype=torch.int64)
        buffer = (hello if self.group_rank == 0 else torch.zeros_like(hello)).to(self.device)
        self.broadcast(buffer, what="the handshake")
        got = [int(value) for value in buffer.cpu().tolist()]
        if got != [int(value) for value in hello.tolist()]:
            raise errors.ProtocolError(
                f"handshake {got} from the trainer, expected [magic {wire.HANDSHAKE_MAGIC:#x}, "
                f"protocol {wire.PROTOCOL_MAJOR}, group size {self.rendezvous.group_size}]"
            )

    def start_broadcast(self, tensor: torch.Tensor, *, what: str) -> transfer_group.Pending:
        """Start broadcasting ``tensor`` from group rank 0 (in place on the others); :meth:`finish` it.
        NCCL orders it after the work already queued on the calling thread's current stream."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        if self.backend == "gloo":
            options.timeout = self.deadline.left(what)  # gloo ends the op itself at the deadline
        return self._start(lambda group: group.broadcast([tensor], options), what=what, self_bounded=True)

    def start_recv(self, tensor: torch.Tensor, *, src: int, tag: int, what: str) -> transfer_group.Pending:
        """Start receiving ``tensor`` from group rank ``src`` (the whole tensor, in place)."""
        return self._start(lambda group: group.recv([tensor], src, tag), what=what, self_bounded=False)

    def finish(self, pending: transfer_group.Pending, *, stream: torch.cuda.Stream | None = None) -> None:
        """Complete ``pending`` as far as its user needs: gloo waits on the host until it is done;
        NCCL makes ``stream`` (default: the current stream) wait for it, without a host wait."""
        self._check_open(pending.what)
        try:
            if self.backend == "gloo":
                if pending.self_bounded:
                    pending.work.wait()
                else:  # a point-to-point op: wait(timeout) leaves nothing pending behind
                    pending.work.wait(self.deadline.left(pending.what))
                return
            with cuda_streams.on_stream(stream):
                pending.work.wait()
        except RuntimeError as error:
            if isinstance(error, errors.RefitError):
                raise
            raise deadlines.translate(error, self.deadline, pending.what, aborted=self._aborted.is_set()) from None

    def complete(self, pending: transfer_group.Pending) -> None:
        """Wait on the host until ``pending`` is done (NCCL: polled, so an abort or the deadline ends the wait)."""
        if self.backend == "nccl":
            self._poll(pending.work.is_completed, what=pending.what)
        self.finish(pending)

    def wait_event(self, event: torch.cuda.Event, *, what: str) -> None:
        """Wait on the host until the CUDA ``event`` completed, bounded like every other wait."""
        self._poll(event.query, what=what)

    def broadcast(self, tensor: torch.Tensor, *, what: str) -> None:
        """Broadcast ``tensor`` from group rank 0 (in place on the others) and wait until it is done."""
        self.complete(self.start_broadcast(tensor, what=what))

    def send(self, tensor: torch.Tensor, *, dst: int, tag: int, what: str) -> dist.Work:
        """Start sending ``tensor`` to group rank ``dst``; finish it with :meth:`wait`."""
        return self._start(lambda group: group.send([tensor], dst, tag), what=what, self_bounded=False).work

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int, what: str) -> None:
        """Receive ``tensor`` from group rank ``src`` (the whole tensor, in place) and wait until it is done."""
        self.complete(self.start_recv(tensor, src=src, tag=tag, what=what))

    def wait(self, work: dist.Work, *, what: str) -> None:
        """Wait on the host for ``work`` (from :meth:`send`) until the deadline."""
        self.complete(transfer_group.Pending(work, what, self_bounded=False))

    def _start(
        self, start: Callable[[transfer_group.Group], dist.Work], *, what: str, self_bounded: bool
    ) -> transfer_group.Pending:
        self._check_open(what)
        try:
            return transfer_group.Pending(start(self._live_group()), what, self_bounded)
        except RuntimeError as error:
            if isinstance(error, errors.RefitError):
                raise
            raise deadlines.translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    def _poll(self, done: Callable[[], bool], *, what: str) -> None:
        try:
            while not done():
                if self._aborted.wait(POLL_SECONDS):
                    raise errors.RefitAborted(f"the refit was aborted during {what}")
                if self.deadline.passed:
                    self.abort()
                    raise errors.RefitTimeout(f"the refit's {self.deadline.seconds:g} s deadline passed during {what}")
        except RuntimeError as error:
            if isinstance(error, errors.RefitError):
                raise
            raise deadlines.translate(error, self.deadline, what, aborted=self._aborted.is_set()) from None

    # -- teardown ------------------------------------------------------------------------------

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    @property
    def healthy(self) -> bool:
        """Open and holding a group that was not aborted: fit to be parked for the next round (the
        abort flag belongs to the attempt, which checks it)."""
        with self._lock:
            return self._store is not None and self._group is not None and not self._group_aborted

    def abort(self) -> None:
        """Tear the group down so blocked NCCL collectives return (safe from any thread, idempotent)."""
        self._aborted.set()
        self._abort_group()

    def _abort_group(self) -> None:
        with self._lock:
            if self._group_aborted or self._group is None:
                return
            self._group_aborted = True
            group = self._group
        try:
            group.abort()
        except RuntimeError as error:  # already torn down by its peer
            log.debug("aborting the refit group: %s", error)

    def discard(self) -> None:
        """Close a communicator that is no longer wanted (a parked one): its group is aborted, which
        never waits for peers that may be gone, and its abort flag (an attempt's) is left alone."""
        self._abort_group()
        self.close()

    def close(self) -> None:
        """Release the group and the store (the trainer's store stops listening)."""
        if self._aborted.is_set():
            self.abort()  # a group left in an unknown state is torn down, never drained
        with self._lock:
            group, self._group = self._group, None
            self._store = None
            group_aborted = self._group_aborted
        if group is not None and self.backend == "nccl" and not group_aborted:
            # Abort, not shutdown(): a graceful shutdown waits for the receivers' parked side of the
            # group (docs/incidents.md#trainer-close-hang). Nothing is in flight here.
            try:
                group.abort()
            except RuntimeError as error:
                log.warning("closing the refit group: %s", error)

    def _check_open(self, what: str) -> None:
        if self._aborted.is_set():
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        self.deadline.left(what)

    def _live_group(self) -> transfer_group.Group:
        group = self._group
        if group is None or self._group_aborted:
            raise errors.RefitAborted("the refit group is closed")
        return group

    def _live_store(self) -> c10d.Store:
        store = self._store
        if store is None:
            raise errors.RefitAborted("the refit store is closed")
        return store
