"""NeMo RL's two async flags and the in-flight modes of the Refits the adapter creates.

NeMo RL's async GRPO has ``grpo.async_grpo.in_flight_weight_updates`` (its trajectory collector does
not wait for its own generations before a refit) and ``recompute_kv_cache_after_weight_updates``
(after the refit it asks ``invalidate_kv_cache()``: the KV computed with the old weights must not
serve on); its single controller keeps generations in flight through every refit and has the second
flag as ``async_rl.recompute_kv_cache_after_weight_updates``. GRPO hands the generation backend only
``policy.generation``, so :func:`resolve` takes the flags from the first of: the ``master_config``
given to :func:`~megafleet.sdk.nemo.factory.nemo_factory`, the one NeMo RL's development line hands
to ``validate_settings`` (remembered by the adapter's class), and the generation config's
``mcore_generation_config.kv_cache_management_mode`` (NeMo's setup sets ``recompute`` from the flag
before it builds the backend). :func:`modes_for` turns them into what every Refit carries: in flight
``keep`` (else ``drain``: NeMo has then waited for its own generations) and ``kvCacheMode:
recompute`` with the recompute flag.

Called by the adapter when it refits (both refit wires create Refits, so both honour the flags) and
by the factory. Pure; NeMo RL's configs are read as mappings or as its pydantic models alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megafleet_protocol import vocabulary

__all__ = [
    "AsyncFlags",
    "RefitModes",
    "field",
    "from_generation_config",
    "from_master_config",
    "modes_for",
    "resolve",
]


@dataclasses.dataclass(frozen=True)
class AsyncFlags:
    """NeMo RL's two async flags, and where they were read (for the log)."""

    in_flight_weight_updates: bool = False
    """The trainer refits while its own generations run (they must keep running)."""
    recompute_kv_cache_after_weight_updates: bool = False
    """No KV computed with old weights may serve after a refit (AReaL-style; off: Magistral-style)."""
    source: str = "NeMo RL's defaults"


@dataclasses.dataclass(frozen=True)
class RefitModes:
    """What a Refit asks of the engines for the sequences running when it lands."""

    in_flight: vocabulary.InFlightMode
    kv_cache_mode: vocabulary.KvCacheMode | None
    """``None``: the fleet's own ``engine.kvCacheMode``."""

    def spec_fields(self) -> dict[str, str]:
        """The Refit spec's fields, by their JSON names (``inFlight``, ``kvCacheMode``)."""
        fields: dict[str, str] = {"inFlight": self.in_flight}
        if self.kv_cache_mode is not None:
            fields["kvCacheMode"] = self.kv_cache_mode
        return fields

    def fleet_options(self) -> dict[str, Any]:
        """The same as keyword arguments of :meth:`megafleet.sdk.fleet.Fleet.refit`."""
        options: dict[str, Any] = {"in_flight": self.in_flight}
        if self.kv_cache_mode is not None:
            options["kv_cache_mode"] = self.kv_cache_mode
        return options


def modes_for(flags: AsyncFlags) -> RefitModes:
    """In flight ``keep`` with ``in_flight_weight_updates``, else ``drain``; ``kvCacheMode: recompute``
    with the recompute flag, else the fleet's."""
    return RefitModes(
        in_flight="keep" if flags.in_flight_weight_updates else "drain",
        kv_cache_mode="recompute" if flags.recompute_kv_cache_after_weight_updates else None,
    )


def resolve(*candidates: AsyncFlags | None) -> AsyncFlags:
    """The first flags found, in the order given; NeMo RL's defaults (both off) when none is."""
    return next((flags for flags in candidates if flags is not None), AsyncFlags())


def from_master_config(master_config: Any) -> AsyncFlags | None:
    """The flags of NeMo RL's master config (a mapping or its pydantic ``MasterConfig``): the single
    controller's ``async_rl`` (always in flight) when present, else ``grpo.async_grpo`` (in flight only
    when async GRPO is ``enabled``); ``None`` when it has neither."""
    async_rl = field(master_config, "async_rl")
    if async_rl is not None:
        return AsyncFlags(
            in_flight_weight_updates=True,  # the single controller keeps generations running through refits
            recompute_kv_cache_after_weight_updates=bool(field(async_rl, "recompute_kv_cache_after_weight_updates")),
            source="async_rl (NeMo RL's single controller)",
        )
    async_grpo = field(field(master_config, "grpo"), "async_grpo")
    if async_grpo is None:
        return None
    enabled = bool(field(async_grpo, "enabled"))  # sync GRPO never generates while it refits
    return AsyncFlags(
        in_flight_weight_updates=enabled and bool(field(async_grpo, "in_flight_weight_updates")),
        recompute_kv_cache_after_weight_updates=bool(field(async_grpo, "recompute_kv_cache_after_weight_updates")),
        source="grpo.async_grpo",
    )


def from_generation_config(config: Mapping[str, Any]) -> AsyncFlags | None:
    """What NeMo RL's generation config says: its setup writes ``kv_cache_management_mode:
    recompute`` from the recompute flag (with megatron training); the in-flight flag is not in it.
    ``None`` when the config names no mode."""
    mode = (config.get("mcore_generation_config") or {}).get("kv_cache_management_mode")
    if mode is None:
        return None
    return AsyncFlags(
        recompute_kv_cache_after_weight_updates=mode == "recompute",
        source="policy.generation.mcore_generation_config.kv_cache_management_mode",
    )


def field(obj: Any, name: str) -> Any:
    """``obj[name]`` of a mapping, ``obj.name`` of a pydantic model (NeMo RL's configs are either);
    ``None`` when absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)
