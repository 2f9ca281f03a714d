"""megatron-core's own ``swap_model_weights`` as a refit source: one swap into the live model over the
refit group a megatron-core trainer built (NeMo RL's Megatron synchronizer, ``swap_weights_via_reshard``).

Built by the agent's ``POST /v1/refit/megatron`` through
:meth:`~megafleet_engine.refit_attempts.megatron_group.NativeRefits.refit` (:class:`SwapRequest`, over
the group joined for the session) and run by the refit attempt
(:mod:`megafleet_engine.refit_attempts.attempt`) on its thread: drop any transfer group kept by an
earlier refit, suspend, one swap on the backend thread, and check no parameter's storage moved.

Three modules take part in this refit, one level each: this one is the attempt's step (what one
refit does, with the attempt's phases, status and watchdog);
:mod:`~megafleet_engine.refit_attempts.megatron_group` keeps the group between refits (join, probe,
leave) for the agent; the megatron backend's
:mod:`~megafleet_engine.backends.megatron.native_refit` is what actually calls megatron-core (it
builds the torch.distributed group and runs ``prepare_swap_model_weights`` and ``swap_model_weights``
on the model). A failed or timed-out swap breaks the group for good (:meth:`Swappable.fail`): the
trainer's ranks are stuck in the same collective.

megatron-core's reshard carries no digest. With ``integrity: checksum`` each rank digests its
parameters right after the swap, on the backend thread (:mod:`megafleet_protocol.refit.parameter_digests`:
``mf64`` per group of parameters in name order, on the GPU), and reports them for the operator to compare
across the shards: the same position in every shard holds the same TP/PP ranks, so the same bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import sources, weight_target
    from megafleet_protocol.refit import verification

__all__ = ["SwapRequest", "SwapSource", "Swappable"]


class Swappable(Protocol):
    """A joined megatron-core refit group (:mod:`~megafleet_engine.refit_attempts.megatron_group`)."""

    def swap(self) -> tuple[int, int]:
        """One ``swap_model_weights`` into the live model (on the backend thread): tensors, bytes."""
        ...

    def fail(self, reason: str) -> None:
        """The attempt failed: the group cannot be reused (any thread, never blocks)."""


@dataclasses.dataclass(frozen=True)
class SwapRequest:
    """Receive ``version`` by megatron-core's own ``swap_model_weights`` over ``group``, the refit
    group joined for ``session`` (``POST /v1/refit/megatron``, built by
    :class:`~megafleet_engine.refit_attempts.megatron_group.NativeRefits`)."""

    version: int
    session: str
    rank: int  # this process's rank in the refit group
    world_size: int
    group: Swappable = dataclasses.field(compare=False, repr=False)
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staging: vocabulary.StagingMode = "off"
    commit: vocabulary.CommitMode = "local"  # staged: wait for the trainer's or the operator's commit
    commit_grace_seconds: float = 30.0  # how long past the deadline a staged attempt waits for it
    integrity: vocabulary.Integrity = "none"  # checksum: digest the parameters after the swap

    @property
    def key(self) -> tuple[object, ...]:
        return ("megatron", self.version, self.session)

    def source(self, target: weight_target.WeightTarget) -> SwapSource:
        return SwapSource(self)


class SwapSource:
    """One attempt of a :class:`SwapRequest`."""

    def __init__(self, request: SwapRequest) -> None:
        self.request = request

    def record(self) -> phases.Progress:
        # NeMo's Megatron synchronizer: megatron-core's reshard
        return phases.Progress(
            version=self.request.version,
            source="nemo",
            transport="reshard",
            rank=self.request.rank,
            world_size=self.request.world_size,
        )

    def describe(self) -> str:
        request = self.request
        return (
            f"megatron-core's swap_model_weights over the refit group of session {request.session} as rank "
            f"{request.rank} of {request.world_size}, timeout {request.timeout_seconds:g} s"
        )

    def run(self, run: sources.Run) -> None:
        """Suspend, then one megatron-core swap into the live parameters on the backend thread (and,
        with ``integrity: checksum``, the digests of what it wrote, there too)."""
        from megafleet_protocol.refit import parameter_digests

        run.drop_parked()  # another kind of refit: its group is of no further use
        if run.target.staged:
            raise errors.RefitError("megatron-core's swap writes the live model: it cannot stage")
        run.suspend()
        run.record.enter("receiving")
        before = run.target.live_pointers()
        counts: list[tuple[int, int]] = []
        digested: list[verification.Verification] = []

        def swap() -> int:
            counts.append(self.request.group.swap())
            if self.request.integrity == "checksum":
                digested.append(parameter_digests.digest_tensors(run.target.tensors(), integrity="checksum"))
            return counts[-1][0]

        with run.record.timed("receive"):
            run.apply(swap)
        tensors, nbytes = counts[0] if counts else (0, 0)
        run.record.count(bytes_received=nbytes, tensors_written=tensors)
        run.target.verify_in_place(before)
        if digested:
            run.record.verified(digested[0])

    def keep(self, target: weight_target.WeightTarget) -> None:
        """Nothing to park: the group stays with its membership
        (:mod:`~megafleet_engine.refit_attempts.megatron_group`)."""

    def report(self, error: str | None) -> None:
        """Nothing to tell: megatron-core's swap has no outcome message (the status says it)."""

    def abort(self, reason: str) -> None:
        self.request.group.fail(reason)

    def close(self) -> None:
        """Nothing of the attempt's own to close: the group is the membership's."""

    def runs_over(self, session: str) -> bool:
        return False
