"""``invalidate_kv_cache()``'s answer, read from the status of the fleet's last Refit.

NeMo RL asks after a refit (its trajectory collector's ``resume_after_refit``, the single
controller's ``_sync_weights``), from the copy of the adapter that generates: in async GRPO a
pickled copy in the collector's actor, which did not make the Refit. So the answer comes from the
API server: the fleet's last Succeeded Refit (:func:`last_refit`, the highest version; versions only
go up) and its ``status.inFlight`` (:func:`answer`): no KV computed with the old weights serves after
it when the sequences running at the refit were drained or aborted, or kept with ``kvCacheMode:
recompute``. Kept with ``persist`` or ``offload`` the old KV serves on: ``False`` (NeMo then prints
its own warning, which is accurate).

Called by :meth:`~megafleet.sdk.nemo.MegafleetGeneration.invalidate_kv_cache`. Pure: JSON objects in.
"""

from __future__ import annotations

from collections.abc import Iterable

from megafleet.objects import Object

__all__ = ["answer", "last_refit"]

_INVALIDATING_IN_FLIGHT = ("drain", "abort")
"""Effective in-flight modes after which nothing computed before the refit serves."""


def last_refit(refits: Iterable[Object], fleet: str) -> Object | None:
    """The Succeeded Refit of ``fleet`` with the highest version, if any."""
    succeeded = [
        refit
        for refit in refits
        if ((refit.get("spec") or {}).get("fleetRef") or {}).get("name") == fleet
        and (refit.get("status") or {}).get("phase") == "Succeeded"
    ]
    return max(succeeded, key=lambda refit: int(refit["spec"]["version"]), default=None)


def answer(refit: Object) -> bool | None:
    """Whether no KV computed with the weights before ``refit`` serves after it, from its
    ``status.inFlight`` (``effective``, ``kvCacheMode``); ``None`` when the status has no such report
    (an operator that does not report it)."""
    report = (refit.get("status") or {}).get("inFlight") or {}
    effective = report.get("effective")
    if effective is None:
        return None
    return effective in _INVALIDATING_IN_FLIGHT or report.get("kvCacheMode") == "recompute"
