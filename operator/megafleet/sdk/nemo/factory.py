"""A stand-in for NeMo RL's generation constructors: GRPO's ``setup`` builds its backend by name
(``grpo.MegatronGeneration`` or ``grpo.VllmGeneration``), so the user replaces that name with
:func:`nemo_factory`'s result before calling it (docs/nemo-rl.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megafleet.sdk.nemo import adapter, async_flags

__all__ = ["nemo_factory"]


def nemo_factory(
    fleet_name: str, namespace: str | None = None, *, master_config: Any = None, **options: Any
) -> Callable[..., adapter.MegafleetGeneration]:
    """A stand-in for NeMo RL's ``MegatronGeneration``/``VllmGeneration`` constructors (GRPO's
    ``setup`` builds the backend by name): called with their keyword arguments, it returns a
    :class:`~megafleet.sdk.nemo.adapter.MegafleetGeneration` of ``fleet_name`` with
    ``config["generation"]`` (or ``config`` itself when it has no ``generation`` key); ``options`` go
    to the adapter's constructor. ``master_config`` (NeMo RL's, a mapping or its ``MasterConfig``)
    gives the async flags every Refit honours (:mod:`~megafleet.sdk.nemo.async_flags`): GRPO hands
    the backend only ``policy.generation``. With ``defer_model_load`` (``VllmGeneration``'s, GRPO with
    NeMo Gym) it waits until the fleet is Ready, so ``dp_openai_server_base_urls`` lists its frontends
    at once.

    Raises (when called):
        NotImplementedError: a colocated setup (``policy=`` given): the fleet has its own GPUs.
    """

    if master_config is not None:
        options.setdefault("async_flags", async_flags.from_master_config(master_config))

    def build(
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
    ) -> adapter.MegafleetGeneration:
        if policy is not None:
            raise NotImplementedError(
                "colocated generation is not supported by megafleet: set policy.generation.colocated.enabled=false"
            )
        generation_cfg = dict((config or {}).get("generation", config or {}))
        if tokenizer is not None and "_pad_token_id" not in generation_cfg:
            generation_cfg["_pad_token_id"] = tokenizer.pad_token_id
        generation = adapter.MegafleetGeneration(fleet_name, namespace, config=generation_cfg, **options)
        if defer_model_load:  # GRPO with NeMo Gym reads the frontend URLs before load_and_start()
            generation.prepare_for_generation()
        return generation

    return build
