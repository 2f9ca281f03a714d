"""The megafleet wire as a refit source: receive a version from a trainer using megafleet's SDK, over
the trainer+fleet world's transfer group (broadcast or reshard, :mod:`megafleet_protocol.refit`).

Built by the agent's ``POST /v1/refit/prepare`` (:class:`RendezvousRequest`) and run by the refit
attempt (:mod:`megafleet_engine.refit_attempts.attempt`) on its thread: the suspend starts first and
overlaps the join; a transfer group parked by the last successful refit of the same rendezvous is
reused when the trainer's store still answers with its session, else a new one is built once the
suspend ended; the receiver (:func:`megafleet_protocol.refit.receiver.receive`) writes in place
through the attempt's backend thread. A staged attempt whose commit is the trainer's
(``commit: trainer``) asks for it in its hello, reports ``staged/<r>`` once verified and waits for
the trainer's ``commit`` (:mod:`megafleet_protocol.refit.commit_round`) before it switches. After the
engine serves the version the group is parked for the next refit and the trainer is told ``done``; a
failure is told to the trainer (``staged/<r>`` too while it waits for a commit) before the group is
aborted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import sources, weight_target
    from megafleet_protocol.refit import communicator, deadlines, receiver

__all__ = ["RendezvousRequest", "RendezvousSource"]

log = logging.getLogger(__name__)

MIB = 2**20
SESSION_CHECK_SECONDS = 5.0
"""Bound of asking a parked communicator's store for the trainer's session (it answers at once or is gone)."""


@dataclasses.dataclass(frozen=True)
class RendezvousRequest:
    """Receive ``version`` from the trainer's world (``POST /v1/refit/prepare``)."""

    version: int
    address: str
    port: int
    world_size: int
    rank_offset: int  # global rank of the shard's rank 0
    trainer_world_size: int = 1
    transport: vocabulary.Transport = "broadcast"
    bucket_size_mib: int = 1024
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staging: vocabulary.StagingMode = "off"
    local_address: str | None = None  # where this rank's gloo transport binds; None: the route to the trainer
    integrity: vocabulary.Integrity = "none"  # checksum: ask for sealed buckets and check every trailer
    collective: vocabulary.CollectiveBackend | None = None  # None: NCCL on a GPU engine, gloo on a CPU one
    commit: vocabulary.CommitMode = "local"  # staged: wait for the trainer's or the operator's commit
    commit_grace_seconds: float = 30.0  # how long past the deadline a staged attempt waits for it

    @property
    def key(self) -> tuple[object, ...]:
        """What makes two requests the same attempt (a repeated call is answered, not rerun)."""
        return ("rendezvous", self.version, self.address, self.port, self.world_size, self.rank_offset)

    def source(self, target: weight_target.WeightTarget) -> RendezvousSource:
        """:class:`ValueError` when ``target``'s rank is not a fleet rank of this world."""
        return RendezvousSource(self, target.rank)


@dataclasses.dataclass(frozen=True)
class Parked:
    """A communicator kept after a successful refit, the rendezvous it serves (rendezvous, this
    rank's global rank, the address its transport binds) and the manifest it took."""

    key: tuple[object, ...]
    comm: communicator.Communicator
    accepted: receiver.Accepted | None = None

    def discard(self) -> None:
        self.comm.discard()


class RendezvousSource:
    """One attempt of a :class:`RendezvousRequest` as shard-local rank ``rank``."""

    def __init__(self, request: RendezvousRequest, rank: int) -> None:
        from megafleet_protocol.refit import communicator

        self.request = request
        self.rank = rank
        self.rendezvous = communicator.Rendezvous(
            request.address, request.port, request.world_size, trainer_world_size=request.trainer_world_size
        )
        self.global_rank = request.rank_offset + rank
        self.rendezvous.group_rank(self.global_rank)  # ValueError: not a fleet rank
        self._lock = threading.Lock()  # guards _comm (the attempt's thread sets it, an abort reads it)
        self._comm: communicator.Communicator | None = None
        self._key: tuple[object, ...] | None = None  # the rendezvous key this attempt's communicator serves
        self._received: receiver.Received | None = None  # what the transfer took in
        self._served: tuple[communicator.Communicator | None, str | None, bool] = (None, None, False)
        self._told = False  # the trainer got this attempt's outcome
        self._asks_commit = False  # this attempt stages and waits for the trainer's commit
        self._staged_told = False  # the trainer got this attempt's staged report

    def record(self) -> phases.Progress:
        request = self.request
        return phases.Progress(
            version=request.version,
            source="rendezvous",
            transport=request.transport,
            rank=self.global_rank,
            world_size=request.world_size,
        )

    def describe(self) -> str:
        request = self.request
        return (
            f"{request.transport} from {request.address}:{request.port} as rank "
            f"{self.global_rank} of {request.world_size}, timeout {request.timeout_seconds:g} s"
        )

    def run(self, run: sources.Run) -> None:
        import torch

        from megafleet_protocol.refit import communicator, receiver

        request, record = self.request, run.record
        suspended = run.start_suspend()
        record.enter("joining")
        sink = run.target.fresh_sink()
        before = run.target.live_pointers()
        with record.timed("join"):
            local_address = request.local_address or communicator.local_address_towards(request.address)
            backend = request.collective or ("nccl" if sink.device.type == "cuda" else "gloo")
            self._key = (self.rendezvous, self.global_rank, local_address, backend)
            comm, accepted = self._take_parked(run, self._key)
            if comm is None:
                # a new group is built: its buffers come after whatever the suspend frees
                run.wait_suspended(suspended)
                comm = communicator.Communicator.connect(
                    self.rendezvous,
                    global_rank=self.global_rank,
                    backend=backend,
                    device=sink.device if backend == "nccl" else torch.device("cpu"),
                    deadline=run.deadline,
                    local_address=local_address,
                    aborted=run.aborted,
                )
        with self._lock:
            self._comm = comm
        if record.finished:  # aborted while joining: the abort did not see this group
            comm.abort()
            raise errors.RefitAborted("the refit was aborted while joining")
        self._asks_commit = comm.asks_commit = run.target.staged and request.commit == "trainer"
        self._received = receiver.receive(
            comm,
            sink,
            version=request.version,
            transport=request.transport,
            bucket_limit_bytes=request.bucket_size_mib * MIB,
            apply=run.apply,
            record=record,
            accepted=accepted,
            before_transfer=lambda: run.wait_suspended(suspended),
            after_writes=lambda: run.target.verify_in_place(before),
            integrity=request.integrity,
        )
        if self._asks_commit:
            run.wait_for_commit(lambda deadline: self._trainer_commit(comm, deadline))

    def _trainer_commit(self, comm: communicator.Communicator, deadline: deadlines.Deadline) -> None:
        """Tell the trainer this rank staged the version, and wait for its commit until ``deadline``."""
        from megafleet_protocol.refit import commit_round

        self._staged_told = True
        commit_round.report_staged(comm, commit_round.Staged(ok=True))
        commit_round.await_commit(comm, deadline)

    def _take_parked(
        self, run: sources.Run, key: tuple[object, ...]
    ) -> tuple[communicator.Communicator | None, receiver.Accepted | None]:
        """The parked communicator, rearmed for this attempt, and the manifest it took, if it serves
        ``key`` and the trainer's store still answers with its session; else ``None`` (and the
        parked one is closed)."""
        parked = run.take_parked(key, Parked)
        if parked is None:
            return None, None
        try:
            parked.comm.rearm(run.deadline, run.aborted)
            parked.comm.check_session(SESSION_CHECK_SECONDS)
            return parked.comm, parked.accepted
        except errors.RefitError as error:
            log.info("not reusing the parked refit group: %s", error)
        parked.discard()
        return None, None

    def keep(self, target: weight_target.WeightTarget) -> None:
        """Park this attempt's communicator for the next refit, if it is healthy; the trainer is
        told ``done`` over it afterwards (:meth:`report`), in this round's namespace."""
        with self._lock:
            comm, self._comm = self._comm, None
        namespace = comm.namespace if comm is not None else None
        parked = False
        if comm is not None and self._key is not None and comm.healthy and not comm.aborted:
            accepted = self._received.accepted if self._received is not None else None
            target.park(Parked(self._key, comm, accepted))
            parked = True
        self._served = (comm, namespace, parked)

    def report(self, error: str | None) -> None:
        if self._told:
            return
        self._told = True
        if error is not None:  # while the communicator is this attempt's
            with self._lock:
                comm = self._comm
            if comm is not None:
                if self._asks_commit and not self._staged_told:  # the trainer waits for it before done
                    _tell_staged(comm, error)
                _tell(comm, comm.namespace, ok=False, error=error)
            return
        comm, namespace, parked = self._served
        if comm is not None and self._received is not None:  # the trainer learns it once this version serves
            # In this round's namespace, on the (now parked) store client: its calls are serialised
            # by torch, and a next attempt that took it already waits in slices of at most 1 s.
            _tell(comm, namespace, ok=True, bytes_received=self._received.nbytes)
        if comm is not None and not parked:
            comm.close()

    def abort(self, reason: str) -> None:
        with self._lock:
            comm = self._comm
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is not None:  # not parked: this attempt failed
            comm.close()

    def runs_over(self, session: str) -> bool:
        return False


def _tell(
    comm: communicator.Communicator, namespace: str | None, *, ok: bool, error: str = "", bytes_received: int = 0
) -> None:
    """Report the outcome (``done``) to the trainer in the round ``namespace`` (``None`` or empty: no
    round was opened, nothing to tell); best effort (it may be gone, or the store unreachable)."""
    from megafleet_protocol.refit import wire

    if not namespace:
        return
    done = wire.Done(ok=ok, error=error, bytes_received=bytes_received)
    try:
        comm.set(wire.done_key(comm.group_rank), done.encode(), namespace=namespace)
    except RuntimeError as error:
        log.debug("could not report the refit outcome to the trainer: %s", error)


def _tell_staged(comm: communicator.Communicator, error: str) -> None:
    """Report to the trainer that this rank did not stage (best effort, as :func:`_tell`)."""
    from megafleet_protocol.refit import commit_round

    if not comm.namespace:
        return
    try:
        commit_round.report_staged(comm, commit_round.Staged(ok=False, error=error), namespace=comm.namespace)
    except RuntimeError as failure:
        log.debug("could not report the staging failure to the trainer: %s", failure)
