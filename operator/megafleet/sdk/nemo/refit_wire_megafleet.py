"""``refit_wire="megafleet"``: megafleet's own refit wire, sent by this process.

Each refit is a Refit with a rendezvous source (the address and base port ``init_collective``
named); for every attempt the operator starts, this process's
:class:`~megafleet_protocol.refit.sender.WeightSender` sends the tensors given as ``weights=`` (kept
open across refits, so its store and transfer group are reused). NeMo RL's own trainer broadcast is
not used: the policy's ``init_collective``/``broadcast_weights_for_collective`` must not run.
Called by :class:`~megafleet.sdk.nemo.MegafleetGeneration`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megafleet.api import v1alpha1
from megafleet.sdk import errors
from megafleet.sdk import weights as weight_senders
from megafleet.sdk.nemo import async_flags, refit_wires
from megafleet.sdk.nemo import clients as connection
from megafleet_protocol import vocabulary

__all__ = ["MegafleetWire"]

log = logging.getLogger(__name__)


class MegafleetWire:
    """Refits sent by this process (see the module docstring); one per adapter, on the driver."""

    def __init__(
        self,
        connect: Callable[[], connection.Clients],
        weights: weight_senders.NamedTensors | None,
        backend: vocabulary.CollectiveBackend,
    ) -> None:
        self._connect = connect
        self._weights = weights
        self.backend: vocabulary.CollectiveBackend = backend
        self._rendezvous: v1alpha1.RendezvousSource | None = None
        self._sender: weight_senders.Sender | None = None  # kept open across refits
        self._refit_info: set[str] | None = None

    def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int, backend: str | None) -> None:
        """Record the trainer's rendezvous: ``ip`` and the base ``port`` of its store (each attempt
        uses the next port) and ``train_world_size``; ``world_size`` is only what the caller expects
        (the operator sets the membership from the live shards)."""
        if backend is not None:
            self.backend = "nccl" if backend == "nccl" else "gloo"
        self._close_sender()  # another rendezvous: the next refit opens a new session
        self._rendezvous = v1alpha1.RendezvousSource(address=ip, port=port, trainer_world_size=train_world_size)
        log.info("refits rendezvous at %s:%d (the caller expects a world of %d)", ip, port, world_size)

    def set_membership(self, shards: Sequence[int] | None) -> None:
        """Nothing: the operator refits the live shards itself."""

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any] | None) -> None:
        """Remember the names every refit must send; ``None`` (MegatronGeneration's call) checks nothing."""
        self._refit_info = None if state_dict_info is None else set(state_dict_info)

    def sender_spec(self) -> refit_wires.CollectiveSenderSpec:
        """NeMo RL's defaults: the trainer's own broadcast is not used."""
        return refit_wires.CollectiveSenderSpec()

    def inference_world_size(self) -> int | None:
        """``None``: the receiving ranks are the live shards the operator picks per refit."""
        return None

    def begin(self, version: int, modes: async_flags.RefitModes) -> None:
        """Nothing to start early: the Refit is made when the weights are at hand."""

    def update(
        self, version: int, timeout: float, weights: weight_senders.NamedTensors | None, modes: async_flags.RefitModes
    ) -> None:
        """Create the Refit (asking for ``modes``), send for each attempt, wait until it succeeded
        (the fleet client then routes to its member shards).

        Raises:
            RuntimeError: ``init_collective`` was not called.
            ValueError: no weights, or other names than ``prepare_refit_info`` listed.
            RefitFailed: the Refit failed (after the operator's retry) or did not finish in time.
        """
        if self._rendezvous is None:
            raise RuntimeError("call init_collective(ip, port, world_size, train_world_size=...) before refitting")
        named = weights or self._weights
        if named is None:
            raise ValueError("no weights: pass weights= here or to MegafleetGeneration(...)")
        self._check_names(named)
        if self._sender is None:
            self._sender = weight_senders.sender(named, backend=self.backend, keep_open=True)
        send = self._sender
        send.weights = named
        rendezvous = self._rendezvous
        clients = self._connect()
        if clients.fleet is None:
            raise errors.FleetError("refits need the API server: this adapter was made with fixed frontends")
        refit = clients.fleet.refit(version, rendezvous=rendezvous, send=send, timeout=timeout, **modes.fleet_options())
        result = clients.loop.run(refit)
        log.info("refit %s: version %d on shards %s", result.name, version, list(result.members))

    def end(self) -> None:
        """Nothing to end: the fleet resumed its engines inside the Refit."""

    def close(self) -> None:
        self._close_sender()

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _check_names(self, named: weight_senders.NamedTensors) -> None:
        if self._refit_info is None:
            return
        sent = {name for name, _ in named()}
        if sent != self._refit_info:
            missing, extra = sorted(self._refit_info - sent), sorted(sent - self._refit_info)
            raise ValueError(f"the weights differ from prepare_refit_info: missing {missing[:5]}, extra {extra[:5]}")
