"""NeMo's world as this engine joins it ahead of a session's refits (``POST /v1/refit/nemo/join``):
the join's thread, the membership it parks, and the probe of the trainer's store while it is joined.

Made by the refit controller (:meth:`~megafleet_engine.refit_attempts.controller.RefitController.join`),
which admits the join (never while a refit runs) and keeps the last membership; the join runs on a
thread of its own (the trainer's store master waits for every rank, so it takes as long as the
slowest rank) without suspending the engine, then the store probe runs on another. The membership is
parked in the weight target exactly as a successful NeMo refit parks its own
(:class:`~megafleet_engine.refit_attempts.sources.nemo_collective.Joined`), so the session's first
refit reuses it (``reused``, no ``join`` phase) and never joins itself. The stage communicators of
NeMo's M-to-N reshard, joined later for the same session (:mod:`.reshard_stages`), hang on it
(:attr:`NemoMembership.stages`) and end with it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import memberships, reshard_stages
from megafleet_engine.refit_attempts.sources import nemo_collective
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import weight_target
    from megafleet_protocol.refit import nemo

__all__ = ["NemoMembership"]

log = logging.getLogger(__name__)


class NemoMembership:
    """A join of NeMo's world by shard-local rank ``local_rank`` (its thread's outcome): the request,
    and once joined the receiver. ``phase`` and ``store_reachable`` change under ``lock`` (the
    controller's); ``left`` is derived from the receiver's state."""

    def __init__(self, request: nemo_collective.NemoJoinRequest, local_rank: int, lock: threading.Lock) -> None:
        self.request = request
        self.local_rank = local_rank
        self.rank = request.rank_offset + local_rank
        self.lock = lock
        self.phase = "joining"
        self.error: str | None = None
        self.receiver: nemo.NemoReceiver | None = None
        self.aborted = threading.Event()
        self.thread: threading.Thread | None = None
        self.store_reachable: bool | None = None  # written by the store probe's thread
        self.stages: reshard_stages.StageMembership | None = None  # NeMo's reshard, joined after the world

    def snapshot(self) -> memberships.WorldSnapshot:
        phase = self.phase
        if phase == "joined" and (self.receiver is None or self.receiver.closed):
            phase = "left"
        generation = self.receiver.generation if self.receiver is not None else self.request.generation
        stages = self.stages.snapshot() if self.stages is not None else None
        return memberships.WorldSnapshot(
            self.request.session, phase, self.rank, generation, self.error, self.store_reachable, stages
        )

    def leave_stages(self, reason: str | None = None) -> None:
        """Leave the stage communicators hung on this world, if any (the world ends, or a new join)."""
        if self.stages is not None:
            self.stages.leave(reason)

    def holds(self, kept: weight_target.Kept) -> bool:
        """Whether ``kept`` (what the weight target parks) is this membership."""
        return isinstance(kept, nemo_collective.Joined) and kept.receiver is self.receiver

    def start(
        self,
        target: weight_target.WeightTarget,
        *,
        current: Callable[[NemoMembership], bool],
        probe_seconds: Callable[[], float],
    ) -> None:
        """Start the join's thread. ``current`` says whether the controller still keeps this
        membership (not left, not replaced); ``probe_seconds`` is the store probe's period, read
        before each wait."""
        self.thread = threading.Thread(
            target=self._join, args=(target, current, probe_seconds), name="megafleet-nemo-join", daemon=True
        )
        self.thread.start()

    def _join(
        self,
        target: weight_target.WeightTarget,
        current: Callable[[NemoMembership], bool],
        probe_seconds: Callable[[], float],
    ) -> None:
        """The join's thread: rendezvous, communicator, warm-up; the receiver is parked as a NeMo
        refit's would be, so the session's first refit reuses it (``reused``, no ``join`` phase)."""
        from megafleet_protocol.refit import communicator, nemo

        request = self.request
        try:
            device = target.fresh_sink().device
            local_address = request.local_address or communicator.local_address_towards(request.address)
            receiver = nemo.NemoReceiver.connect(
                request.world(self.local_rank),
                backend="nccl" if device.type == "cuda" else "gloo",
                device=device,
                deadline=communicator.Deadline(request.timeout_seconds),
                aborted=self.aborted,
                generation=request.generation,
                local_address=local_address,
            )
        except Exception as error:
            message = str(error) or type(error).__name__
            if not isinstance(error, errors.RefitError):
                log.exception("joining NeMo's world for session %s raised", request.session)
                message = f"{type(error).__name__}: {message}"
            with self.lock:
                if self.phase != "left":  # a leave during the join is not a failure
                    self.phase, self.error = "failed", message
            log.error("joining NeMo's world for session %s failed: %s", request.session, message)
            return
        key = nemo_collective.world_key(request.world(self.local_rank), local_address, request.generation)
        if not current(self):
            receiver.close()
            return
        # a refit built by request.refit() computes this key: it never joins
        target.park(nemo_collective.Joined(key, receiver))
        with self.lock:
            self.request = dataclasses.replace(request, local_address=local_address)
            self.receiver, self.phase = receiver, "joined"
        log.info(
            "joined NeMo's world for session %s as rank %d of %d (%s)",
            request.session, self.rank, request.world_size, receiver.generation,
        )  # fmt: skip
        probe = threading.Thread(
            target=self._probe_store, args=(probe_seconds,), name="megafleet-store-probe", daemon=True
        )
        probe.start()

    def _probe_store(self, probe_seconds: Callable[[], float]) -> None:
        """The store probe's thread, while joined: every ``probe_seconds()``, whether the trainer's
        store still accepts a connection (NeMo keeps it alive for its whole run, so a store that
        does not is a trainer that is gone). A plain connect, never a call on the store client the
        joined group was built over."""
        address, port = self.request.address, self.request.port
        while self.snapshot().phase == "joined":
            reachable = memberships.store_listening(address, port, timeout=memberships.STORE_PROBE_TIMEOUT_SECONDS)
            with self.lock:
                self.store_reachable = reachable
            if self.aborted.wait(probe_seconds()):
                return
