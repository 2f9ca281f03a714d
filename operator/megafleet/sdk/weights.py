"""The trainer's side of a rendezvous refit attempt, for :meth:`megafleet.sdk.fleet.Fleet.refit`.

:func:`sender` turns "where my weights are" into the ``send`` callable a refit runs per attempt: it
sends the tensors as the attempt's version with the fleet's transport and bucket size through a
:class:`~megafleet_protocol.refit.sender.WeightSender` on the attempt's port and world size::

    send = weights.sender(model.named_parameters, backend="nccl", keep_open=True)
    for step in range(steps):
        ...  # train
        await fleet.refit(step + 1, rendezvous=v1alpha1.RendezvousSource(address=pod_ip, port=29600), send=send)
    send.close()

With ``keep_open`` (NeMo RL's pattern: ``init_collective`` once, then ``update_weights_from_collective``
per step) the sender stays open after a successful attempt, and the next attempt with the same
address, port, world size and trainer world size sends through it, so the engines keep their
transfer group too (no store, no group, no handshake per refit). Anything else closes it and opens a
new one: another port (a retry's attempt 2, or another base port), another membership size, a failed
or superseded attempt. Without ``keep_open`` every attempt opens and closes its own sender.

Needs torch (the ``engine`` extra), like :mod:`megafleet_protocol.refit.sender`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from megafleet.sdk import fleet
from megafleet_protocol import vocabulary
from megafleet_protocol.refit import sender as weight_sender_module

__all__ = ["NamedTensors", "Sender", "sender"]

NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""Hugging Face names and full tensors, produced again for every attempt (e.g. ``model.named_parameters``)."""

SenderKey = tuple[str, int, int, int]
"""What a kept sender serves: address, port, world size, trainer world size."""


class Sender:
    """A ``send`` for :meth:`~megafleet.sdk.fleet.Fleet.refit` built on
    :class:`~megafleet_protocol.refit.sender.WeightSender`
    (made by :func:`sender`); callable once per attempt, from the fleet client's threads.

    Args:
        weights: called once per attempt for the tensors to send.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (GPU), as the fleet's engines use.
        timeout_seconds: bound of each send (joining included).
        device: where buckets are staged (see :class:`~megafleet_protocol.refit.sender.WeightSender`).
        reports: when given, each attempt's :class:`~megafleet_protocol.refit.sender.SendReport` is appended.
        keep_open: keep the sender (its store and transfer group) open for the next attempt on the
            same port and world size; :meth:`close` it when done.
    """

    def __init__(
        self,
        weights: NamedTensors,
        *,
        backend: vocabulary.CollectiveBackend = "gloo",
        timeout_seconds: float = 300.0,
        device: torch.device | str | None = None,
        reports: list[weight_sender_module.SendReport] | None = None,
        keep_open: bool = False,
    ) -> None:
        self.weights = weights
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        self.device = device
        self.reports = reports
        self.keep_open = keep_open
        self._lock = threading.Lock()
        self._kept: tuple[SenderKey, weight_sender_module.WeightSender] | None = None

    def __call__(self, attempt: fleet.Attempt) -> None:
        weight_sender = self._take(attempt)
        finished = threading.Event()
        lock = threading.Lock()

        def abort_when_superseded() -> None:
            # Give the attempt up as soon as the operator moves on (a member died): it ends a wait for
            # a peer that is gone instead of running to the deadline. The fleet client sets the event
            # when the Refit ends, so this thread always ends too; a send that already finished (and
            # may be kept for the next Refit) is left alone.
            attempt.superseded.wait()
            with lock:
                if not finished.is_set():
                    weight_sender.abort()

        threading.Thread(target=abort_when_superseded, name="refit-abort", daemon=True).start()
        try:
            report = weight_sender.send(
                ((name, tensor.detach()) for name, tensor in self.weights()),
                bucket_size_mib=attempt.bucket_size_mib,
                version=attempt.version,
                transport=attempt.transport,
            )
        except BaseException:
            finished.set()
            weight_sender.close()
            raise
        with lock:
            finished.set()
            kept = self.keep_open and weight_sender.usable and not attempt.superseded.is_set()
        if kept:
            self._keep(_key(attempt), weight_sender)
        else:
            weight_sender.close()
        if self.reports is not None:
            self.reports.append(report)

    def close(self) -> None:
        """Close the kept sender, if any (its store stops listening; engines close their group at
        their next refit). Idempotent."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept[1].close()

    def _take(self, attempt: fleet.Attempt) -> weight_sender_module.WeightSender:
        """The kept sender when it serves this attempt's rendezvous, else a new one (the kept one is
        closed first: it may hold the port)."""
        with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            key, weight_sender = kept
            if key == _key(attempt) and weight_sender.usable:
                return weight_sender
            weight_sender.close()
        weight_sender = weight_sender_module.WeightSender(
            attempt.port,
            attempt.world_size,
            backend=self.backend,
            address=attempt.address,
            trainer_world_size=attempt.trainer_world_size,
            timeout_seconds=self.timeout_seconds,
            device=self.device,
        )
        try:
            weight_sender.init()
        except BaseException:
            weight_sender.close()
            raise
        return weight_sender

    def _keep(self, key: SenderKey, weight_sender: weight_sender_module.WeightSender) -> None:
        with self._lock:
            old, self._kept = self._kept, (key, weight_sender)
        if old is not None and old[1] is not weight_sender:
            old[1].close()


sender = Sender
"""A ``send`` for :meth:`~megafleet.sdk.fleet.Fleet.refit` (the :class:`Sender` class itself)."""


def _key(attempt: fleet.Attempt) -> SenderKey:
    return (attempt.address, attempt.port, attempt.world_size, attempt.trainer_world_size)
