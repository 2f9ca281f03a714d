"""Measuring the memory of the staging rule and allocating the staging copy, once at engine start.

Called by the engine command (:mod:`megafleet_engine.cli`) right after the backend is built;
:func:`plan` measures ``F`` (:func:`free_memory`), decides by :func:`megafleet_engine.refit_staging.decide`
and lets the backend allocate its copy (``prepare_staging``) when the rule allows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from megafleet_engine import refit_staging
from megafleet_protocol import vocabulary

if TYPE_CHECKING:
    from megafleet_engine.backends import base

__all__ = ["BUCKET_BYTES", "free_memory", "plan"]

log = logging.getLogger(__name__)

BUCKET_BYTES = 1024 * 2**20
"""The bucket size the receive buffers are counted with (the rendezvous's default bucketSizeMiB)."""


def free_memory(device: str) -> tuple[int, str]:
    """``F`` of the memory rule on ``device`` (``cpu`` or ``cuda:N``), and how it was measured."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + spare, "free (cudaMemGetInfo plus reserved but unallocated)"
    available = _meminfo_available(Path("/proc/meminfo"))
    limit = _cgroup_room(Path("/sys/fs/cgroup"))
    if limit is not None and limit < available:
        return limit, "free (cgroup limit - usage)"
    return available, "free (MemAvailable)"


def plan(
    backend: base.Backend, mode: vocabulary.StagingMode, *, device: str, headroom_bytes: int
) -> refit_staging.StagingPlan:
    """Decide for ``backend`` on ``device`` and allocate the copy when the rule allows (once)."""
    if mode == "off":
        return refit_staging.OFF
    decided_at_build = _decided_at_build(backend, mode)
    if decided_at_build is not None:
        return decided_at_build
    needs = refit_staging.Needs(backend.staging_bytes(), 2 * BUCKET_BYTES, headroom_bytes)
    free, measured = free_memory(device) if needs.parameters > 0 else (0, "free")
    decided = refit_staging.decide(mode, needs, free, measured=measured)
    if decided.bytes is not None:
        backend.prepare_staging()
        log.info(
            "refit staging: a copy of %s GiB is allocated (%s %s GiB)",
            refit_staging.gib(decided.bytes),
            measured,
            refit_staging.gib(free),
        )
    elif mode == "required":
        log.error("refit staging is required but there is no room for it: %s", decided.reason)
    else:
        log.info("refit staging: no copy (%s); refits write in place", decided.reason)
    return decided


def _decided_at_build(backend: base.Backend, mode: vocabulary.StagingMode) -> refit_staging.StagingPlan | None:
    """The decision a backend made itself while it was built (megatron: after its KV buffer and graphs,
    every rank of a model-parallel shard alike), or ``None`` when it leaves the rule to :func:`plan`."""
    reason = getattr(backend, "staging_reason", _UNDECIDED)
    if reason is _UNDECIDED:
        return None
    if reason is None:
        return refit_staging.StagingPlan(mode, bytes=backend.staging_bytes())
    if mode == "required":
        log.error("refit staging is required but there is no room for it: %s", reason)
    return refit_staging.StagingPlan(mode, reason=str(reason))


_UNDECIDED = object()


def _meminfo_available(meminfo: Path) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def _cgroup_room(root: Path) -> int | None:
    """The room left under this process's cgroup memory limit, or ``None`` without a limit: cgroup v2's
    ``memory.max - memory.current``, else cgroup v1's ``memory/memory.limit_in_bytes -
    memory/memory.usage_in_bytes`` (a container sees its own cgroup there; v1's "no limit" is a number
    near 2**63, taken as none)."""
    for limit_file, usage_file in (("memory.max", "memory.current"), _CGROUP_V1):
        try:
            limit = (root / limit_file).read_text().strip()
            current = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or (limit.isdigit() and int(limit) >= _CGROUP_V1_UNLIMITED):
            return None
        try:
            return max(int(limit) - current, 0)
        except ValueError:
            continue
    return None


_CGROUP_V1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
_CGROUP_V1_UNLIMITED = 2**62
"""cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712)."""
