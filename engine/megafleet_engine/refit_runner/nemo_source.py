"""NeMo RL's collective as a refit source of the engine: one refit from a NeMo trainer's packed broadcast
(:mod:`megafleet_protocol.refit.nemo`) written into the engine's sink, in place.

Called by the refit attempt (:mod:`~megafleet_engine.refit_runner.controller`) of a
``POST /v1/refit/nemo`` request: the attempt joins the trainer's world once (:meth:`NemoReceiver.connect`,
kept between refits like a parked communicator: NeMo builds its world once per run), suspends the
engine, then calls :func:`receive` with the sink and the attempt's ``apply`` (the backend thread), and
resumes only when it returns (docs/refit-protocol.md, "NeMo RL's collective").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    import torch

    from megafleet_protocol.refit import communicator, nemo, receiver

__all__ = ["receive", "writer"]


def writer(sink: receiver.Sink, apply: receiver.Apply) -> nemo.Write:
    """NeMo's ``post_unpack_func`` over ``sink``: each bucket's whole tensors written through
    ``apply`` (which returns once the copies were issued, before the next bucket reuses the buffer)."""
    from megafleet_protocol.refit import wire

    def write(tensors: list[tuple[str, torch.Tensor]]) -> int:
        def copy() -> int:
            return sum(sink.write(wire.Region.whole(name), tensor) for name, tensor in tensors)

        return apply(copy)

    return write


def receive(
    joined: nemo.NemoReceiver,
    sink: receiver.Sink,
    *,
    specs: Sequence[nemo.TensorSpec],
    bucket_bytes: int,
    apply: receiver.Apply,
    deadline: communicator.Deadline,
) -> nemo.Stats:
    """Receive one refit over ``joined`` into ``sink``: the refit info is checked against what the
    sink holds first (:class:`ManifestMismatch` before any byte), and the version must be complete
    afterwards (:class:`RefitError` naming what was left unwritten)."""
    stats = joined.receive(
        specs,
        bucket_bytes=bucket_bytes,
        device=sink.device,
        write=writer(sink, apply),
        deadline=deadline,
        required=sink.required(),
    )
    missing = sink.missing()
    if missing:
        raise errors.RefitError(f"NeMo's refit left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
    return stats
