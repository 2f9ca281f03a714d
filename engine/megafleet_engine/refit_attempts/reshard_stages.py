"""The stage communicators of NeMo RL's M-to-N reshard as this engine joins them beside a session's
NeMo world (``POST /v1/refit/nemo/reshard/join``, NeMo's ``init_nccl_reshard_comm_group``): the
request, the join's thread and the membership it keeps for the session's reshard refits.

Made by the refit controller (:meth:`~megafleet_engine.refit_attempts.controller.RefitController.join_stages`),
which admits the join only on a rank that holds the session's NeMo world (NeMo joins its world first,
then the stages) and hangs the membership on that world's
(:class:`~megafleet_engine.refit_attempts.nemo_world.NemoMembership`): leaving the world leaves the
stages too. The join runs on a thread of its own without suspending the engine (each stage's store
master, the stage's first trainer rank, waits for every rank of the stage). The membership is what a
reshard refit receives the bulk over
(:class:`~megafleet_engine.refit_attempts.sources.nemo_reshard.Stages`); a failed refit over it breaks
it for good (the stages' trainer ranks are in the same exchange), as a failed refit breaks NeMo's world.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Literal

from megafleet_engine.refit_attempts import memberships
from megafleet_protocol import agent_api
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import weight_target
    from megafleet_protocol.refit import nemo_reshard

__all__ = ["StageJoinRequest", "StageMembership"]

log = logging.getLogger(__name__)

Phase = Literal["joining", "joined", "failed", "left"]


@dataclasses.dataclass(frozen=True)
class StageJoinRequest:
    """Join every stage communicator for ``session``: stage ``s``'s store is ``stages[s]``; each has
    ``sub_world_size`` ranks, the stage's ``trainer_ranks_per_stage`` first; this shard's rank 0 is
    ``rank_offset`` in every one (``trainer_ranks_per_stage`` + the shard's prefix among the
    inference ranks), its other ranks follow."""

    session: str
    stages: tuple[tuple[str, int], ...]
    trainer_ranks_per_stage: int
    sub_world_size: int
    rank_offset: int
    timeout_seconds: float = 240.0
    local_address: str | None = None  # where this rank's transport binds; None: the route to each stage

    @classmethod
    def of(cls, body: agent_api.NemoReshardJoinRequest, local_address: str | None) -> StageJoinRequest:
        """The agent's body as a request (``local_address``: where this pod's transports bind)."""
        return cls(
            session=body.session,
            stages=tuple((stage.address, stage.port) for stage in body.stages),
            trainer_ranks_per_stage=body.trainer_ranks_per_stage,
            sub_world_size=body.sub_world_size,
            rank_offset=body.rank_offset,
            timeout_seconds=body.timeout_seconds,
            local_address=local_address,
        )

    def rank(self, local_rank: int) -> int:
        """Shard-local rank ``local_rank``'s rank in every stage communicator (:class:`ValueError`: not
        an inference rank of them)."""
        rank = self.rank_offset + local_rank
        if not self.trainer_ranks_per_stage <= rank < self.sub_world_size:
            raise ValueError(
                f"rank {rank} (rankOffset {self.rank_offset} + local rank {local_rank}) is not an inference rank "
                f"of the stage communicators: those are {self.trainer_ranks_per_stage} .. {self.sub_world_size - 1}"
            )
        return rank

    def worlds(self, local_rank: int) -> list[nemo_reshard.StageWorld]:
        """Every stage's communicator as shard-local rank ``local_rank`` joins it, in stage order."""
        from megafleet_protocol.refit import nemo_reshard

        rank = self.rank(local_rank)
        return [
            nemo_reshard.StageWorld(stage, address, port, self.sub_world_size, rank, self.trainer_ranks_per_stage)
            for stage, (address, port) in enumerate(self.stages)
        ]


class StageMembership:
    """A join of the stage communicators by shard-local rank ``local_rank`` (its thread's outcome) and
    the receiver once joined; implements the reshard source's
    :class:`~megafleet_engine.refit_attempts.sources.nemo_reshard.Stages`. Its state changes under its
    own lock (never held while calling out)."""

    def __init__(self, request: StageJoinRequest, local_rank: int) -> None:
        self.request = request
        self.local_rank = local_rank
        self.rank = request.rank(local_rank)
        self._lock = threading.Lock()
        self._phase: Phase = "joining"
        self._error: str | None = None
        self._receiver: nemo_reshard.ReshardReceiver | None = None
        self.aborted = threading.Event()
        self.thread: threading.Thread | None = None

    def snapshot(self) -> memberships.ReshardSnapshot:
        with self._lock:
            phase, receiver = self._phase, self._receiver
            error = self._error
        if phase == "joined" and (receiver is None or receiver.closed):
            phase = "left"
        return memberships.ReshardSnapshot(phase, len(self.request.stages), self.rank, error)

    def start(self, target: weight_target.WeightTarget) -> None:
        """Start the join's thread (NCCL when ``target``'s weights are on a GPU, else gloo)."""
        self.thread = threading.Thread(target=self._join, args=(target,), name="megafleet-reshard-join", daemon=True)
        self.thread.start()

    def _join(self, target: weight_target.WeightTarget) -> None:
        from megafleet_protocol.refit import communicator, nemo_reshard

        request = self.request
        try:
            device = target.fresh_sink().device
            receiver = nemo_reshard.ReshardReceiver.connect(
                request.worlds(self.local_rank),
                backend="nccl" if device.type == "cuda" else "gloo",
                deadline=communicator.Deadline(request.timeout_seconds),
                aborted=self.aborted,
                local_address=request.local_address,
            )
        except Exception as error:
            message = str(error) or type(error).__name__
            if not isinstance(error, errors.RefitError):
                log.exception("joining the stage communicators of session %s raised", request.session)
                message = f"{type(error).__name__}: {message}"
            with self._lock:
                if self._phase != "left":  # a leave during the join is not a failure
                    self._phase, self._error = "failed", message
            log.error("joining the stage communicators of session %s failed: %s", request.session, message)
            return
        with self._lock:
            kept = self._phase == "joining"
            if kept:
                self._receiver, self._phase = receiver, "joined"
        if not kept:  # left while joining
            receiver.close()
            return
        log.info(
            "joined %d stage communicators of session %s as rank %d of %d",
            len(request.stages), request.session, self.rank, request.sub_world_size,
        )  # fmt: skip

    # -- what a reshard refit uses (the source's Stages) --------------------------------------------

    def receiver(self) -> nemo_reshard.ReshardReceiver:
        """The joined receiver; :class:`RefitError` unless joined (a refit never joins)."""
        with self._lock:
            phase, receiver, error = self._phase, self._receiver, self._error
        if phase != "joined" or receiver is None or receiver.closed:
            state = "left" if phase == "joined" else phase
            detail = f": {error}" if error else ""
            raise errors.RefitError(
                f"this rank's stage communicators for session {self.request.session!r} are {state}{detail}; "
                "a reshard refit never joins them"
            )
        return receiver

    def fail(self, reason: str) -> None:
        """A refit over the stages failed (any thread): they cannot be reused, their trainer ranks are
        in the same exchange."""
        self._end("failed", f"a reshard refit failed, the stage communicators cannot be reused: {reason}")

    def leave(self, reason: str | None = None) -> None:
        """Leave every stage communicator (a leave of the session, another join, shutdown); idempotent."""
        self._end("left", reason)

    def _end(self, phase: Phase, error: str | None) -> None:
        self.aborted.set()
        with self._lock:
            if self._phase in ("failed", "left"):
                return
            self._phase, self._error = phase, error
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.abort()
