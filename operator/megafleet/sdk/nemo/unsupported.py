"""What a fleet cannot do, in NeMo RL's names: each method raises ``NotImplementedError`` saying
what to use instead, so nothing is silently accepted.

:class:`Unsupported` is a base of :class:`~megafleet.sdk.nemo.MegafleetGeneration`; its methods keep
NeMo RL's signatures (the surface test walks them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megafleet.sdk.nemo import refs

__all__ = ["Unsupported"]


class Unsupported:
    """The parts of NeMo RL's ``GenerationInterface`` and ``MegatronGeneration`` a fleet refuses."""

    @property
    def worker_group(self) -> Any:
        """Not available: the fleet has no Ray worker group (its shards are pods).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet has no Ray worker group: its shards are pods; read the fleet's status "
            "(megafleet.sdk.fleet.Fleet.get) for shards and their phases"
        )

    @classmethod
    def reserve_http_server_addresses(
        cls, cluster: Any, config: Mapping[str, Any]
    ) -> tuple[list[str], dict[int, int], list[Any]]:
        """Not needed: the operator reserves the fleet's endpoints (``status.endpoints``, the
        ``<fleet>-endpoints`` ConfigMap).

        Raises:
            NotImplementedError: always; read ``dp_openai_server_base_urls`` after
                ``prepare_for_generation()`` instead.
        """
        raise NotImplementedError(
            "MegafleetGeneration reserves no ports in NeMo RL's cluster: the operator publishes the fleet's "
            "frontend URLs; read dp_openai_server_base_urls after prepare_for_generation()"
        )

    def update_weights_via_ipc_zmq(self) -> refs.ObjectRefs:
        """Not available: CUDA IPC needs the engines in the trainer's processes (colocated).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet runs in its own pods: CUDA IPC (colocated) refits cannot reach it; "
            "use init_collective + update_weights_from_collective"
        )

    def preinit_nvshmem_collective(self) -> refs.ObjectRefs:
        """Not available: megafleet refits send over gloo or nccl.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "refit_backend='nvshmem' is not supported by megafleet; use 'nccl' (GPU engines) or 'gloo'"
        )

    def pause_generation(self, mode: str) -> None:
        """Not available: clients cannot pause a fleet; the fleet pauses itself during each Refit.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet is not paused by its clients: it suspends itself during each Refit; "
            "stop sending requests instead"
        )

    def continue_generation(self) -> None:
        """Not available: see :meth:`pause_generation`."""
        raise NotImplementedError("a megafleet fleet is not paused by its clients: there is nothing to continue")

    def pause_generation_for_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: generation-prefix checkpointing.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("generation-prefix checkpointing is not supported for MegafleetGeneration")

    def resume_generation_after_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: see :meth:`pause_generation_for_checkpoint`."""
        raise NotImplementedError("generation-prefix checkpointing is not supported for MegafleetGeneration")

    def resume_generation_after_cut(self, *, timeout_s: float | None = None) -> bool:
        """Not available: generation-prefix buffer swapping.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("generation-prefix buffer swapping is not supported for MegafleetGeneration")

    def finish_generation_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: see :meth:`resume_generation_after_cut`."""
        raise NotImplementedError("generation-prefix buffer swapping is not supported for MegafleetGeneration")

    def setup_token_capture(self, dp_cfg: Any, staging_partition: str, *, capture_media: bool = False) -> None:
        """Not available: the fleet's frontends capture no tokens for NeMo RL's data plane.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "token capture is not supported for MegafleetGeneration: every answer already carries its "
            "token ids, logprobs and weight version"
        )
