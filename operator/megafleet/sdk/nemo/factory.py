"""A stand-in for NeMo RL's generation classes: GRPO's ``setup`` builds its backend by name
(``grpo.MegatronGeneration`` or ``grpo.VllmGeneration``) and also calls class methods on that name
(``nvlink_domain_span``, ``init_cluster_placement_groups``) and ``isinstance`` against it, so the user
replaces the name with :func:`nemo_factory`'s result, a class, before calling ``setup``
(docs/nemo-rl.md, "Wiring")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from megafleet.sdk.nemo import adapter, async_flags

__all__ = ["BoundGeneration", "nemo_factory"]


class BoundGeneration(adapter.MegafleetGeneration):
    """:class:`~megafleet.sdk.nemo.adapter.MegafleetGeneration` with NeMo RL's constructor: the fleet
    and the adapter's options are bound to the class (:func:`nemo_factory` makes one subclass per
    call), so GRPO builds it with NeMo RL's keyword arguments and its class methods answer on the
    class GRPO holds.

    ``config`` is ``policy`` (``MegatronGeneration``'s, read through its ``generation`` key) or the
    generation config itself (``VllmGeneration``'s). With ``defer_model_load`` (GRPO with NeMo Gym)
    it waits until the fleet is Ready, so ``dp_openai_server_base_urls`` lists its frontends at once.

    Raises:
        NotImplementedError: a colocated setup (``policy=`` given): the fleet has its own GPUs.
    """

    fleet_name: ClassVar[str] = ""
    fleet_namespace: ClassVar[str | None] = None
    adapter_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(
        self,
        config: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        cluster: Any = None,
        policy: Any = None,
        name_prefix: str = "megafleet_generation",
        processor: Any = None,
        weights_path: str | None = None,
        skip_weight_load: bool = False,
        reserved_http_server_ports: dict[int, int] | None = None,
        defer_model_load: bool = False,
    ) -> None:
        if not self.fleet_name:
            raise TypeError("BoundGeneration is built through nemo_factory(fleet_name, ...), which binds the fleet")
        if policy is not None:
            raise NotImplementedError(
                "colocated generation is not supported by megafleet: set policy.generation.colocated.enabled=false"
            )
        generation_cfg = dict((config or {}).get("generation", config or {}))
        if tokenizer is not None and "_pad_token_id" not in generation_cfg:
            generation_cfg["_pad_token_id"] = tokenizer.pad_token_id
        super().__init__(self.fleet_name, self.fleet_namespace, config=generation_cfg, **self.adapter_options)
        if defer_model_load:  # GRPO with NeMo Gym reads the frontend URLs before load_and_start()
            self.prepare_for_generation()


def nemo_factory(
    fleet_name: str, namespace: str | None = None, *, master_config: Any = None, **options: Any
) -> type[BoundGeneration]:
    """The class that stands in for NeMo RL's ``MegatronGeneration``/``VllmGeneration`` in GRPO: a
    :class:`BoundGeneration` subclass bound to ``fleet_name`` in ``namespace``; ``options`` go to the
    adapter's constructor. ``master_config`` (NeMo RL's, a mapping or its ``MasterConfig``) gives the
    async flags every Refit honours (:mod:`~megafleet.sdk.nemo.async_flags`): GRPO hands the backend
    only ``policy.generation``. Every class-level call GRPO makes on the name it replaces
    (``nvlink_domain_span``, ``init_cluster_placement_groups``, ``validate_settings``, ``isinstance``)
    answers on the result."""
    if master_config is not None:
        options.setdefault("async_flags", async_flags.from_master_config(master_config))
    attributes: dict[str, Any] = {
        "fleet_name": fleet_name,
        "fleet_namespace": namespace,
        "adapter_options": dict(options),
        "__module__": __name__,
        "__doc__": f"MegafleetGeneration of fleet {fleet_name!r}, built with NeMo RL's constructor arguments.",
    }
    return type(f"MegafleetGeneration_{fleet_name.replace('-', '_')}", (BoundGeneration,), attributes)
