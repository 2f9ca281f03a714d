"""What one refit attempt does with the sequences in flight and where it writes, decided once when it
starts, from its request and what the engine can do.

Called by the refit attempt (:mod:`megafleet_engine.refit_attempts.attempt`) before it touches the
engine; :func:`resolve` is a pure function (table-tested). Rules:

* ``keep`` stays ``keep`` only when the KV-cache mode is one of the backend's ``keep_modes``;
  otherwise the attempt drains, and the report says so with the reason (never a silent downgrade);
* ``staging: auto`` stages when the engine holds a staging copy, else writes in place with the
  reason; ``required`` without a copy is ``unavailable`` (the attempt fails with that message before
  it touches the engine, which serves on); ``off`` writes in place;
* a ``trainer`` or ``operator`` commit holds only for a staged attempt: in place the live weights are
  already written when the receive completes, so the attempt cannot wait and switches as ``local``
  does (the report says why).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megafleet_engine.refit_attempts import phases
from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    from megafleet_engine import refit_staging

__all__ = ["Modes", "resolve"]


@dataclasses.dataclass(frozen=True)
class Modes:
    """One attempt's choices: what it does with the sequences in flight and where it writes."""

    in_flight: phases.InFlight
    """Requested and effective in-flight mode, the KV-cache mode and why they differ."""
    staging: phases.Staging
    """Requested staging and whether it stages."""
    unavailable: str | None = None
    """Why the attempt cannot run at all (``StagingUnavailable: ...``: staging required, no copy)."""
    commit: phases.Commit = dataclasses.field(default_factory=lambda: phases.Commit("local", "local"))
    """Who lets the version go live: the request's commit when staged, else local."""

    @property
    def keep(self) -> bool:
        return self.in_flight.effective == "keep"

    @property
    def staged(self) -> bool:
        return self.staging.effective == "staged"

    @property
    def waits_for_commit(self) -> bool:
        """A staged attempt that waits for the trainer's or the operator's commit before it switches."""
        return self.staged and self.commit.effective != "local"

    @property
    def suspend_mode(self) -> vocabulary.SuspendMode:
        """What a suspend does when the attempt suspends (drain unless it aborts)."""
        return "abort" if self.in_flight.effective == "abort" else "drain"


def resolve(
    *,
    in_flight: vocabulary.InFlightMode,
    kv_cache_mode: vocabulary.KvCacheMode,
    staging: vocabulary.StagingMode,
    backend: str,
    keep_modes: frozenset[vocabulary.KvCacheMode],
    copy: refit_staging.StagingPlan,
    commit: vocabulary.CommitMode = "local",
) -> Modes:
    """The modes of an attempt that asked for ``in_flight``, ``kv_cache_mode``, ``staging`` and
    ``commit``, on an engine whose ``backend`` (its name, for the reason) keeps under ``keep_modes``
    and whose staging ``copy`` was decided at its start."""
    modes = _resolve(in_flight, kv_cache_mode, staging, backend, keep_modes, copy)
    if commit == "local":
        return modes
    if modes.staged:
        return dataclasses.replace(modes, commit=phases.Commit(requested=commit, effective=commit))
    why = "this shard receives in place and cannot wait for a commit; it switches when its own receive completes"
    return dataclasses.replace(modes, commit=phases.Commit(requested=commit, effective="local", reason=why))


def _resolve(
    in_flight: vocabulary.InFlightMode,
    kv_cache_mode: vocabulary.KvCacheMode,
    staging: vocabulary.StagingMode,
    backend: str,
    keep_modes: frozenset[vocabulary.KvCacheMode],
    copy: refit_staging.StagingPlan,
) -> Modes:
    effective, reason = in_flight, None
    if in_flight == "keep" and kv_cache_mode not in keep_modes:
        effective = "drain"
        if keep_modes:
            allowed = " or ".join(sorted(keep_modes))
            reason = f"the {backend} backend keeps with {allowed}, not {kv_cache_mode}; drained"
        else:
            reason = f"the {backend} backend cannot keep sequences across a refit; drained"
    report = phases.InFlight(requested=in_flight, effective=effective, kv_cache_mode=kv_cache_mode, reason=reason)
    if staging == "off":
        return Modes(report, phases.Staging(requested="off", effective="inPlace"))
    if copy.bytes is not None:
        return Modes(report, phases.Staging(requested=staging, effective="staged", bytes=copy.bytes))
    in_place = phases.Staging(requested=staging, effective="inPlace", reason=copy.reason)
    if staging == "required":
        return Modes(report, in_place, f"StagingUnavailable: staging is required, but {copy.reason or 'no copy'}")
    return Modes(report, in_place)
