"""Whether this engine holds a staging copy of its weights for refits, decided once at its start.

The engine command (:mod:`megafleet_engine.cli`) measures and allocates right after the backend is
built (:mod:`megafleet_engine.refit_attempts.staging_memory`: the model, its KV cache and CUDA graphs
exist, so the copy never shrinks the KV cache the user sized); the result (:class:`StagingPlan`) is
kept by the engine, reported in ``GET /v1/state``'s capabilities and read by every refit that asks
for staging (:mod:`megafleet_engine.refit_attempts.modes`). ``MEGAFLEET_REFIT_STAGING`` decides whether the copy
is allocated at all: ``off`` never; ``auto`` and ``required`` when the memory rule allows (without
room ``required`` logs an error: the refits that require staging will fail with
``StagingUnavailable``; the pod still serves).

The memory rule (:func:`decide`, a pure function)::

    P = bytes of this rank's parameters (the copy)
    B = receive buffers: 2 x the bucket bytes
    H = headroom (MEGAFLEET_REFIT_STAGING_HEADROOM_MIB)
    F = free memory now: on a GPU, what cudaMemGetInfo reports free plus what torch holds reserved
        but unallocated; on the CPU, min(MemAvailable, the cgroup's limit - usage: v2 or v1)
    stage  <=>  F >= P + B + H

Imports no torch (the engine's module, which the API-server processes load, imports this one).
"""

from __future__ import annotations

import dataclasses

from megafleet_protocol import vocabulary

__all__ = ["OFF", "Needs", "StagingPlan", "decide", "gib"]

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StagingPlan:
    """This engine's staging copy: ``bytes`` when it holds one, else ``reason`` says why not."""

    mode: vocabulary.StagingMode
    """``MEGAFLEET_REFIT_STAGING``."""
    bytes: int | None = None
    """The copy's size on this rank; ``None``: no copy."""
    reason: str | None = None
    """Why there is no copy (the memory rule's numbers, the setting, the backend)."""


OFF = StagingPlan("off", reason="MEGAFLEET_REFIT_STAGING is off: this engine holds no staging copy")


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a staging copy needs, in bytes: the copy, the receive buffers and the headroom."""

    parameters: int
    buffers: int
    headroom: int

    @property
    def total(self) -> int:
        return self.parameters + self.buffers + self.headroom


def decide(mode: vocabulary.StagingMode, needs: Needs, free: int, *, measured: str = "free") -> StagingPlan:
    """The memory rule: a copy of ``needs.parameters`` bytes when ``free >= needs.total`` (and
    ``mode`` is not ``off``, and the backend can stage at all: ``needs.parameters > 0``)."""
    if mode == "off":
        return OFF
    if needs.parameters <= 0:
        return StagingPlan(mode, reason="this backend cannot stage a refit: it writes weights in place only")
    if free >= needs.total:
        return StagingPlan(mode, bytes=needs.parameters)
    return StagingPlan(
        mode,
        reason=f"needs {gib(needs.total)} GiB (P {gib(needs.parameters)} + B {gib(needs.buffers)} + "
        f"H {gib(needs.headroom)} GiB), {measured} {gib(free)} GiB",
    )


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f}"
