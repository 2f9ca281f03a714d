"""The trainer's side of a rendezvous refit attempt, for :meth:`megafleet.sdk.fleet.Fleet.refit`.

:func:`sender` turns "where my weights are" into the ``send`` callable a refit runs per attempt: it
opens a :class:`~megafleet.sdk.trainer.WeightSender` on the attempt's port and world size, sends the
tensors as the attempt's version with the fleet's transport and bucket size, and closes it::

    await fleet.refit(3, rendezvous=v1alpha1.RendezvousSource(address=pod_ip, port=29600),
                      send=weights.sender(model.named_parameters, backend="nccl"))

Needs torch (the ``engine`` extra), like :mod:`megafleet.sdk.trainer`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from megafleet.sdk import fleet, trainer
from megafleet_engine.refit import communicator

__all__ = ["NamedTensors", "sender"]

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""Hugging Face names and full tensors, produced again for every attempt (e.g. ``model.named_parameters``)."""


def sender(
    weights: NamedTensors,
    *,
    backend: communicator.Backend = "gloo",
    timeout_seconds: float = 300.0,
    device: torch.device | str | None = None,
    reports: list[trainer.SendReport] | None = None,
) -> fleet.SendFn:
    """A ``send`` for :meth:`~megafleet.sdk.fleet.Fleet.refit` built on :class:`~megafleet.sdk.trainer.WeightSender`.

    Args:
        weights: called once per attempt for the tensors to send.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (GPU), as the fleet's engines use.
        timeout_seconds: bound of joining, and of sending, each.
        device: where buckets are staged (see :class:`~megafleet.sdk.trainer.WeightSender`).
        reports: when given, each attempt's :class:`~megafleet.sdk.trainer.SendReport` is appended.
    """

    def send(attempt: fleet.Attempt) -> None:
        with trainer.WeightSender(
            attempt.port,
            attempt.world_size,
            backend=backend,
            address=attempt.address,
            trainer_world_size=attempt.trainer_world_size,
            timeout_seconds=timeout_seconds,
            device=device,
        ) as weight_sender:
            # Give the attempt up as soon as the operator moves on (a member died): it ends a wait for
            # a peer that is gone instead of running to the deadline. The fleet client sets the event
            # when the Refit ends, so this thread always ends too.
            threading.Thread(
                target=_abort_when_set, args=(attempt.superseded, weight_sender), name="refit-abort", daemon=True
            ).start()
            weight_sender.init()
            report = weight_sender.send(
                ((name, tensor.detach()) for name, tensor in weights()),
                bucket_size_mib=attempt.bucket_size_mib,
                version=attempt.version,
                transport=attempt.transport,
            )
        if reports is not None:
            reports.append(report)

    return send


def _abort_when_set(superseded: threading.Event, weight_sender: trainer.WeightSender) -> None:
    superseded.wait()
    weight_sender.abort()  # idempotent, and harmless once the sender finished or closed
