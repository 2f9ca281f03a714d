"""NeMo RL's ``policy.generation`` config as the adapter reads and reports it.

Called by the adapter's constructor and ``validate_settings``: :func:`refuse_unsupported_config`
refuses, loudly, what a fleet cannot do (``bad_words``, colocated inference); :func:`nemo_cfg` is the
``cfg`` NeMo RL reads back from a MegatronGeneration (``backend`` ``megatron``, the async rollout
path). Pure.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from megafleet_protocol import vocabulary

__all__ = [
    "SUPPORTED_REFIT_BACKENDS",
    "RefitPayloadMode",
    "kv_cache_management_mode",
    "nemo_cfg",
    "refuse_unsupported_config",
]

log = logging.getLogger(__name__)

RefitPayloadMode = Literal["hf_export", "logical_weights"]
"""NeMo RL's names for what a refit carries; megafleet's refits carry Hugging Face tensors."""
SUPPORTED_REFIT_BACKENDS = ("gloo", "nccl")
"""``refit_backend`` values of ``init_collective`` the fleet's transfer speaks."""


def nemo_cfg(
    config: Mapping[str, Any],
    backend: vocabulary.CollectiveBackend,
    kv_cache_mode: vocabulary.KvCacheMode | None,
    max_sequence_length: int | None,
) -> dict[str, Any]:
    """``config`` as NeMo RL reads it from a MegatronGeneration: not colocated, backend ``megatron``,
    ``mcore_generation_config`` filled in from what the adapter knows (its
    ``kv_cache_management_mode`` stays NeMo's own, see :func:`kv_cache_management_mode`), no
    ``vllm_cfg`` (a vLLM generation config given to the adapter keeps everything else)."""
    cfg = dict(config)
    if cfg.get("backend") not in (None, "megatron"):
        log.info("MegafleetGeneration reads as backend 'megatron' (was %r): NeMo RL's async path", cfg["backend"])
    cfg["backend"] = "megatron"
    # NeMo's rollouts read a length limit from cfg["vllm_cfg"] before mcore_generation_config: a vLLM
    # config's own max_model_len must not hide the fleet's
    cfg.pop("vllm_cfg", None)
    cfg["colocated"] = {**(cfg.get("colocated") or {}), "enabled": False}
    cfg["mcore_generation_config"] = {
        **(cfg.get("mcore_generation_config") or {}),
        "refit_backend": backend,
        "kv_cache_management_mode": kv_cache_management_mode(config, kv_cache_mode),
        "expose_http_server": True,
        "max_model_len": max_sequence_length,
    }
    return cfg


def kv_cache_management_mode(config: Mapping[str, Any], fleet_mode: vocabulary.KvCacheMode | None) -> str | None:
    """The ``kv_cache_management_mode`` the adapter's ``cfg`` reports: NeMo's own when its generation
    config names one (its setup writes ``recompute`` there from
    ``recompute_kv_cache_after_weight_updates``), else the fleet's ``engine.kvCacheMode``."""
    given = (config.get("mcore_generation_config") or {}).get("kv_cache_management_mode")
    return fleet_mode if given is None else given


def refuse_unsupported_config(config: Mapping[str, Any]) -> None:
    """Raise ``NotImplementedError`` for a non-empty ``bad_words`` or colocated inference."""
    if config.get("bad_words"):
        raise NotImplementedError(
            "policy.generation.bad_words is not supported by megafleet's engines (they cannot ban token "
            "sequences); remove bad_words from the generation config"
        )
    if (config.get("colocated") or {}).get("enabled"):
        raise NotImplementedError(
            "colocated generation is not supported by megafleet: the fleet has its own GPUs; "
            "set policy.generation.colocated.enabled=false"
        )
