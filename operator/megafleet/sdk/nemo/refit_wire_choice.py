"""Which refit wire an adapter uses: the one its handle names (``refit_wire="megafleet"`` or
``"nemo"``; :mod:`~megafleet.sdk.nemo.refit_wires` says what each does).

Called by :class:`~megafleet.sdk.nemo.MegafleetGeneration` when it is made, and when a pickled copy
is restored.
"""

from __future__ import annotations

from collections.abc import Callable

from megafleet.sdk import weights as weight_senders
from megafleet.sdk.nemo import clients as connection
from megafleet.sdk.nemo import refit_wire_megafleet, refit_wire_nemo, refit_wires

__all__ = ["choose"]


def choose(
    handle: connection.Handle, connect: Callable[[], connection.Clients], weights: weight_senders.NamedTensors | None
) -> refit_wires.Wire:
    """The refit wire ``handle.refit_wire`` names."""
    if handle.refit_wire == "megafleet":
        return refit_wire_megafleet.MegafleetWire(connect, weights, handle.backend)
    options = refit_wire_nemo.NemoOptions(
        trainer_bucket_bytes=handle.trainer_bucket_bytes,
        trainer_gpu_memory_bytes=handle.trainer_gpu_memory_bytes,
        join_timeout_s=handle.join_timeout_s,
    )
    return refit_wire_nemo.NemoWire(connect, handle.fleet_name, options)
