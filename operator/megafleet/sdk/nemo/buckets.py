"""The trainer's packed-bucket target ``B`` (proposal 0001, section 5): NeMo RL's packed broadcast
carries no sizes, so the fleet must unpack with exactly the target the trainer packs with.

Called by :class:`~megafleet.sdk.nemo.refit_wire_nemo.NemoWire` when it hands out a sender spec and before
``init_collective`` creates anything. Pure, apart from reading the environment's ratio and Ray's
runtime env (:func:`ray_runtime_env`). Order:

1. a target already handed out by ``get_collective_sender_spec`` (the collective synchronizer passes
   it to the trainer's broadcast: exact by construction);
2. ``trainer_bucket_bytes``, given explicitly;
3. ``trainer_gpu_memory_bytes`` x ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (default 0.02), as NeMo RL's
   policy workers compute it: ``min(int(memory x ratio), 5 GiB)``; when the Ray runtime env (where
   NeMo's policy workers run) sets another ratio, :func:`ratio_mismatch` says so and the wire warns;
4. otherwise :class:`ValueError`, naming options 2 and 3 (the GPU model is never guessed from its name:
   ``total_memory`` differs by SKU and driver).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from megafleet_protocol.refit import nemo as nemo_wire

__all__ = [
    "RATIO_VARIABLE",
    "MissingBucketSize",
    "memory_ratio",
    "mismatch_hint",
    "ratio_mismatch",
    "ray_runtime_env",
    "resolve",
]

RATIO_VARIABLE = "NRL_REFIT_BUFFER_MEMORY_RATIO"
"""NeMo RL's environment variable for the share of a trainer GPU's memory one bucket takes."""


class MissingBucketSize(ValueError):
    """Nothing says what bucket target the trainer packs with."""


def memory_ratio(environ: Mapping[str, str] | None = None) -> float:
    """``NRL_REFIT_BUFFER_MEMORY_RATIO`` from ``environ`` (default: this process's), else NeMo's 0.02."""
    raw = (os.environ if environ is None else environ).get(RATIO_VARIABLE)
    return float(raw) if raw else nemo_wire.DEFAULT_BUFFER_MEMORY_RATIO


def resolve(
    handed_out: int | None,
    trainer_bucket_bytes: int | None,
    trainer_gpu_memory_bytes: int | None,
    ratio: float,
) -> int:
    """``B`` in the order of the module docstring.

    Raises:
        MissingBucketSize: none of the three is known.
    """
    if handed_out is not None:
        return handed_out
    if trainer_bucket_bytes is not None:
        return trainer_bucket_bytes
    if trainer_gpu_memory_bytes is not None:
        return nemo_wire.nemo_bucket_bytes(trainer_gpu_memory_bytes, ratio)
    raise MissingBucketSize(
        "the trainer's packed-bucket size is unknown, and NeMo RL's broadcast carries no sizes: pass "
        "trainer_bucket_bytes=<bytes> (exact) or trainer_gpu_memory_bytes=<torch.cuda.get_device_properties(0)"
        f".total_memory on a trainer GPU> (with {RATIO_VARIABLE}, default "
        f"{nemo_wire.DEFAULT_BUFFER_MEMORY_RATIO}, from this process's environment) to nemo_factory(...) or "
        "MegafleetGeneration(...); NeMo RL's collective synchronizer needs neither (it asks "
        "get_collective_sender_spec())"
    )


def mismatch_hint(bucket_bytes: int) -> str:
    """The likely cause of a session refit that fails or times out while the fleet receives: the
    trainer packs with another target than the session's ``bucketBytes`` (named in the message)."""
    return (
        f"likely cause: the trainer packs its buckets with another target than the session's bucketBytes "
        f"{bucket_bytes} (NeMo RL's packed broadcast carries no sizes): check the trainer's "
        f"min(GPU total_memory x {RATIO_VARIABLE}, 5 GiB), with the ratio of the Ray runtime env its workers "
        "run in, or pass trainer_bucket_bytes=<exact bytes>, or let NeMo RL's collective synchronizer take "
        "buffer_size_bytes from get_collective_sender_spec()"
    )


def ray_runtime_env() -> Mapping[str, Any] | None:
    """The runtime env of this process's Ray job (NeMo RL's workers inherit it), or ``None`` when
    Ray is not imported or not initialised (nothing is started or imported here)."""
    ray: Any = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    found = ray.get_runtime_context().runtime_env
    return dict(found) if found else None


def ratio_mismatch(driver_ratio: float, runtime_env: Mapping[str, Any] | None) -> str | None:
    """A warning when the Ray runtime env's ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (what NeMo's policy
    workers pack with) differs from ``driver_ratio`` (what ``B`` was computed with); ``None`` when it
    is not set there or agrees."""
    raw = ((runtime_env or {}).get("env_vars") or {}).get(RATIO_VARIABLE)
    if raw is None:
        return None
    try:
        theirs = float(raw)
    except ValueError:
        return f"the Ray runtime env sets {RATIO_VARIABLE}={raw!r}, which is not a number"
    if theirs == driver_ratio:
        return None
    return (
        f"the Ray runtime env sets {RATIO_VARIABLE}={raw} but this driver computes the trainer's bucket size "
        f"with {driver_ratio:g}: NeMo RL's policy workers would pack buckets of another size and every refit "
        f"would fail; set the same ratio in the driver's environment or pass trainer_bucket_bytes=<exact bytes>"
    )
