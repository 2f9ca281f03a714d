"""The trainer's packed-bucket target ``B`` (proposal 0001, section 5): NeMo RL's packed broadcast
carries no sizes, so the fleet must unpack with exactly the target the trainer packs with.

Called by :class:`~megafleet.sdk.nemo.wire_nemo.NemoWire` when it hands out a sender spec and before
``init_collective`` creates anything. Pure, apart from reading the environment's ratio. Order:

1. a target already handed out by ``get_collective_sender_spec`` (the collective synchronizer passes
   it to the trainer's broadcast: exact by construction);
2. ``trainer_bucket_bytes``, given explicitly;
3. ``trainer_gpu_memory_bytes`` x ``NRL_REFIT_BUFFER_MEMORY_RATIO`` (default 0.02), as NeMo RL's
   policy workers compute it: ``min(int(memory x ratio), 5 GiB)``;
4. otherwise :class:`ValueError`, naming options 2 and 3 (the GPU model is never guessed from its name:
   ``total_memory`` differs by SKU and driver).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megafleet_protocol.refit import nemo as nemo_wire

__all__ = ["RATIO_VARIABLE", "MissingBucketSize", "memory_ratio", "resolve"]

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
