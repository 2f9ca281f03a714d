"""CUDA streams and events for work that overlaps a refit transfer, that do nothing on CPU.

Called by both ends while buckets are in flight: the trainer's :mod:`~megafleet_protocol.refit.sender`
packs the next bucket and an engine rank's :mod:`~megafleet_protocol.refit.receiver` writes the last
one on a side stream, and :meth:`Communicator.finish
<megafleet_protocol.refit.communicator.Communicator.finish>` makes a stream wait for an NCCL op.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["new_event", "on_stream", "side_stream"]


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A CUDA stream of ``device`` for work that overlaps a transfer (packing, writing), or ``None`` on CPU."""
    if device.type != "cuda":
        return None
    make: Any = torch.cuda.Stream  # untyped constructor in torch's stubs
    stream: torch.cuda.Stream = make(device)
    return stream


def new_event() -> torch.cuda.Event:
    """A CUDA event (no timing) to order streams and to wait for on the host."""
    make: Any = torch.cuda.Event  # untyped constructor in torch's stubs
    event: torch.cuda.Event = make()
    return event


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.stream(stream)``, or nothing on CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
