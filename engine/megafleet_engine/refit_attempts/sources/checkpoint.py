"""A checkpoint as a refit source: every shard reads the version from a path it can see itself.

Built by the agent's ``POST /v1/refit/checkpoint`` (:class:`CheckpointRequest`) and run by the refit
attempt (:mod:`megafleet_engine.refit_attempts.attempt`) on its thread: drop any transfer group kept
by an earlier refit (the next rendezvous joins afresh), hold the engine (suspend or pause), then the
backend's ``load_checkpoint`` on the backend thread, which must write every parameter in place (or,
staged, into the staging copy on the attempt's thread while the engine serves). Nothing is kept
afterwards and no trainer is told (it reads the status). With ``integrity: checksum`` the rank digests
the tensors it loaded (:mod:`megafleet_protocol.refit.parameter_digests`, right after the load, where
it ran) for the operator to compare across the shards that loaded the same checkpoint: a shard that
read other bytes (a checkpoint rewritten during the load, a stale or failing volume) disagrees.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_engine.refit_attempts import sources, weight_target
    from megafleet_protocol.refit import verification

__all__ = ["CheckpointRequest", "CheckpointSource"]


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    """Load ``version`` from the checkpoint at ``path`` (``POST /v1/refit/checkpoint``)."""

    version: int
    path: str
    timeout_seconds: float = 300.0
    suspend_mode: vocabulary.InFlightMode = "drain"
    kv_cache_mode: vocabulary.KvCacheMode | None = None
    staging: vocabulary.StagingMode = "off"
    commit: vocabulary.CommitMode = "local"  # staged: wait for the trainer's or the operator's commit
    commit_grace_seconds: float = 30.0  # how long past the deadline a staged attempt waits for it
    integrity: vocabulary.Integrity = "none"  # checksum: digest what was loaded, for the members' agreement

    @property
    def key(self) -> tuple[object, ...]:
        return ("checkpoint", self.version, self.path)

    def source(self, target: weight_target.WeightTarget) -> CheckpointSource:
        return CheckpointSource(self)


class CheckpointSource:
    """One attempt of a :class:`CheckpointRequest`."""

    def __init__(self, request: CheckpointRequest) -> None:
        self.request = request

    def record(self) -> phases.Progress:
        return phases.Progress(version=self.request.version, source="checkpoint")

    def describe(self) -> str:
        return f"checkpoint {self.request.path}, timeout {self.request.timeout_seconds:g} s"

    def run(self, run: sources.Run) -> None:
        from megafleet_protocol.refit import parameter_digests

        run.drop_parked()  # another kind of refit: the next rendezvous joins afresh
        check_exists(self.request.path)  # before the engine is touched: nothing in flight is disturbed
        run.suspend()
        run.record.enter("applying")
        target = run.target
        before = target.live_pointers()
        digested: list[verification.Verification] = []

        def load() -> int:
            loaded = target.load_checkpoint(self.request.path)
            if self.request.integrity == "checksum":  # where the load ran, before anything else writes
                digested.append(parameter_digests.digest_tensors(target.tensors(), integrity="checksum"))
            return loaded

        with run.record.timed("apply"):
            run.apply(load)
        target.verify_in_place(before)
        if digested:
            run.record.verified(digested[0])

    def keep(self, target: weight_target.WeightTarget) -> None:
        """Nothing to keep: a checkpoint builds no group."""

    def report(self, error: str | None) -> None:
        """Nobody to tell: the caller reads the status."""

    def abort(self, reason: str) -> None:
        """Nothing to unblock: a load already on the backend thread runs to its end (the engine
        stays stale), and one that had not started yet is refused."""

    def close(self) -> None:
        """Nothing was opened."""

    def runs_over(self, session: str) -> bool:
        return False


def check_exists(path: str) -> None:
    """Raise :class:`RefitError` when ``path`` is an absolute path with nothing there (a checkpoint on
    a volume of the pod); anything else (``tiny://``, ``random://``, a name a backend resolves itself)
    is the backend's to resolve."""
    if Path(path).is_absolute() and not Path(path).exists():
        raise errors.RefitError(f"checkpoint {path} does not exist; nothing was written")
