"""The seam between NeMo RL's refit calls and how the weights travel.

The adapter (:class:`~megafleet.sdk.nemo.MegafleetGeneration`) owns the call surface and the version
rule; a :class:`Wire` does the refit itself. Two implement it:

* :class:`~megafleet.sdk.nemo.refit_wire_megafleet.MegafleetWire` (``refit_wire="megafleet"``): a Refit with
  a rendezvous source, sent by this process's ``WeightSender`` from the tensors given as ``weights=``.
* :class:`~megafleet.sdk.nemo.refit_wire_nemo.NemoWire` (``refit_wire="nemo"``): NeMo RL's own trainer
  broadcast, received by the fleet over a ``RefitSession`` it joins at ``init_collective``.

Both create Refits, so both carry the in-flight modes of NeMo RL's async flags
(:mod:`~megafleet.sdk.nemo.async_flags`). Every call that NeMo RL puts in a ``ray.get`` blocks until
the fleet is done and raises on failure:
GRPO reads the trainer's futures before ours, so a failure reported as a value would leave it hanging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from megafleet.sdk import weights as weight_senders
from megafleet.sdk.nemo import async_flags

__all__ = ["CollectiveSenderSpec", "Wire"]


@dataclasses.dataclass(frozen=True)
class CollectiveSenderSpec:
    """NeMo RL's ``CollectiveSenderSpec``: how the trainer's own broadcast sends (``None`` = the
    trainer's defaults)."""

    nccl_peer: str = "nemo"
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None


class Wire(Protocol):
    """One way of refitting a fleet; the adapter calls it in NeMo RL's order."""

    def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int, backend: str | None) -> None:
        """The trainer's ``init_collective``; ``backend`` is the Megatron synchronizer's ``refit_backend``."""

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any] | None) -> None:
        """The trainer's tensor list (NeMo RL's ``prepare_refit_info``), in its order."""

    def set_membership(self, shards: Sequence[int] | None) -> None:
        """The fleet's shards in the trainer's next world (NeMo's refit membership; ``None``: every shard)."""

    def sender_spec(self) -> CollectiveSenderSpec:
        """What the trainer's broadcast should use (``get_collective_sender_spec``)."""

    def inference_world_size(self) -> int | None:
        """The fleet's ranks in NeMo RL's world, if this wire knows it (``get_inference_world_size``)."""

    def begin(self, version: int, modes: async_flags.RefitModes) -> None:
        """A refit to ``version`` starts (``suspend_for_refit``, the Megatron synchronizer's order); its
        Refit asks for ``modes``."""

    def update(
        self, version: int, timeout: float, weights: weight_senders.NamedTensors | None, modes: async_flags.RefitModes
    ) -> None:
        """Refit to ``version`` with a Refit asking for ``modes`` (unless :meth:`begin` made it);
        returns once the fleet serves it, raises otherwise."""

    def end(self) -> None:
        """The refit :meth:`begin` started is over (``resume_after_refit``)."""

    def close(self) -> None:
        """Release what this wire holds (``shutdown``); the adapter's clients are still open."""
