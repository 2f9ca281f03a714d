"""NeMo RL's class-level hooks of a generation backend, as a fleet answers them.

:class:`ClassHooks` is a base of :class:`~megafleet.sdk.nemo.MegafleetGeneration`: NeMo RL calls these
on the class before (or instead of) building the backend, so they never need a connection. Its
development line hands ``validate_settings`` the master config; the async flags read from it are
remembered here (:meth:`ClassHooks.validated_flags`) for the driver's adapter, which GRPO builds from
``policy.generation`` alone (:mod:`~megafleet.sdk.nemo.async_flags`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from megafleet.sdk.nemo import async_flags
from megafleet.sdk.nemo import config as config_

__all__ = ["ClassHooks"]


class ClassHooks:
    """The class-level parts of NeMo RL's ``GenerationInterface`` and ``MegatronGeneration``."""

    _validated_flags: ClassVar[async_flags.AsyncFlags | None] = None

    @classmethod
    def validate_settings(cls, master_config: Any) -> None:
        """Refuse a NeMo RL master config (a mapping or its pydantic ``MasterConfig``) the fleet cannot
        serve (colocated inference); remember its async flags for this class's refits. NeMo's fleet
        health (``async_rl.generation_fleet_health``) is served: ``attach_fleet_health`` feeds its
        monitor from the fleet's shard states.

        Raises:
            NotImplementedError: ``policy.generation.colocated.enabled`` is set.
        """
        policy = async_flags.field(master_config, "policy") or {}
        config_.refuse_unsupported_config(async_flags.field(policy, "generation") or {})
        cls._validated_flags = async_flags.from_master_config(master_config)

    @classmethod
    def validated_flags(cls) -> async_flags.AsyncFlags | None:
        """The async flags of the master config last given to :meth:`validate_settings`, if any."""
        return cls._validated_flags

    @staticmethod
    def effective_megatron_cfg(config: Mapping[str, Any]) -> dict[str, Any]:
        """The policy's ``megatron_cfg`` as given: the fleet's own parallelism is in its spec."""
        return dict(config.get("megatron_cfg") or {})

    @classmethod
    def nvlink_domain_span(cls, config: Mapping[str, Any]) -> int:
        """1: the fleet runs on its own nodes and adds no NVLink domain to the trainer's placement."""
        return 1

    @classmethod
    def init_cluster_placement_groups(cls, cluster: Any, config: Mapping[str, Any]) -> None:
        """Nothing to place: the fleet's pods are placed by Kubernetes, not in NeMo RL's cluster."""

    @staticmethod
    def frontend_ranks(cluster: Any, config: Mapping[str, Any]) -> list[int]:
        """No rank of NeMo RL's cluster hosts a frontend (``[]``): the fleet's frontends are in
        ``dp_openai_server_base_urls``."""
        return []

    @classmethod
    def verify_served_addresses(cls, served_urls: list[str | None], reserved_urls: list[str]) -> None:
        """Check that the servers came up at the pre-published addresses.

        Raises:
            RuntimeError: the sets of URLs differ.
        """
        served = sorted(url for url in served_urls if url)
        if served != sorted(reserved_urls):
            raise RuntimeError(
                "the fleet's frontends serve at different addresses than the ones pre-published: "
                f"reserved {sorted(reserved_urls)}, serving {served}"
            )
