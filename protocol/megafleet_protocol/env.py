"""The ``MEGAFLEET_*`` environment variables of an engine pod, one constant per variable.

The operator writes them on every engine pod (:mod:`megafleet.desired`); the engine reads them once
at start with :func:`megafleet_protocol.engine_settings.from_env`, where each variable's meaning, unit and default are
documented. ``tests/unit/test_protocol_env.py`` builds a pod's env with the operator and reads it
with the engine, so a name that drifts on either side fails there.
"""

from __future__ import annotations

__all__ = [
    "AGENT_PORT",
    "AGENT_TOKEN_FILE",
    "API_KEY",
    "API_KEY_FILE",
    "API_SERVERS",
    "BACKEND",
    "CUDA_GRAPHS",
    "DTYPE",
    "FLEET",
    "FRONTEND_PORT",
    "FUSED_KERNELS",
    "HOST",
    "INFORMATIONAL",
    "KV_CACHE_GIB",
    "KV_CACHE_MODE",
    "LOCAL_GPUS",
    "LOCAL_RANKS",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MAX_BATCH_SIZE",
    "MAX_SEQUENCE_LENGTH",
    "METRICS_PORT",
    "MODEL_SOURCE",
    "PIPELINE_PARALLEL",
    "PREFILL_GRAPHS",
    "PREFIX",
    "RANK",
    "REFIT_STAGING",
    "REFIT_STAGING_HEADROOM_MIB",
    "REFIT_WAIT_SECONDS",
    "SERVED_MODEL_NAME",
    "SET_BY_OPERATOR",
    "SHARD",
    "TENSOR_PARALLEL",
    "TERMINATION_LOG",
    "USER_SETTINGS",
    "WEIGHTS_INITIAL",
    "WORLD_SIZE",
]

PREFIX = "MEGAFLEET_"

FLEET = "MEGAFLEET_FLEET"
SHARD = "MEGAFLEET_SHARD"
INFORMATIONAL = (FLEET, SHARD)
"""Written by the operator for people and logs reading a pod's env; the engine does not read them."""

MODEL_SOURCE = "MEGAFLEET_MODEL_SOURCE"
SERVED_MODEL_NAME = "MEGAFLEET_SERVED_MODEL_NAME"
BACKEND = "MEGAFLEET_BACKEND"
DTYPE = "MEGAFLEET_DTYPE"
MAX_SEQUENCE_LENGTH = "MEGAFLEET_MAX_SEQUENCE_LENGTH"
MAX_BATCH_SIZE = "MEGAFLEET_MAX_BATCH_SIZE"
WEIGHTS_INITIAL = "MEGAFLEET_WEIGHTS_INITIAL"
KV_CACHE_MODE = "MEGAFLEET_KV_CACHE_MODE"
KV_CACHE_GIB = "MEGAFLEET_KV_CACHE_GIB"
CUDA_GRAPHS = "MEGAFLEET_CUDA_GRAPHS"
FUSED_KERNELS = "MEGAFLEET_FUSED_KERNELS"
PREFILL_GRAPHS = "MEGAFLEET_PREFILL_GRAPHS"
REFIT_WAIT_SECONDS = "MEGAFLEET_REFIT_WAIT_SECONDS"
REFIT_STAGING = "MEGAFLEET_REFIT_STAGING"
REFIT_STAGING_HEADROOM_MIB = "MEGAFLEET_REFIT_STAGING_HEADROOM_MIB"
HOST = "MEGAFLEET_HOST"
FRONTEND_PORT = "MEGAFLEET_FRONTEND_PORT"
AGENT_PORT = "MEGAFLEET_AGENT_PORT"
METRICS_PORT = "MEGAFLEET_METRICS_PORT"
AGENT_TOKEN_FILE = "MEGAFLEET_AGENT_TOKEN_FILE"
API_KEY = "MEGAFLEET_API_KEY"
API_KEY_FILE = "MEGAFLEET_API_KEY_FILE"
API_SERVERS = "MEGAFLEET_API_SERVERS"
RANK = "MEGAFLEET_RANK"
WORLD_SIZE = "MEGAFLEET_WORLD_SIZE"
TENSOR_PARALLEL = "MEGAFLEET_TENSOR_PARALLEL"
PIPELINE_PARALLEL = "MEGAFLEET_PIPELINE_PARALLEL"
MASTER_ADDR = "MEGAFLEET_MASTER_ADDR"
MASTER_PORT = "MEGAFLEET_MASTER_PORT"
LOCAL_GPUS = "MEGAFLEET_LOCAL_GPUS"
LOCAL_RANKS = "MEGAFLEET_LOCAL_RANKS"
TERMINATION_LOG = "MEGAFLEET_TERMINATION_LOG"

SET_BY_OPERATOR = (
    FLEET,
    SHARD,
    HOST,
    MODEL_SOURCE,
    SERVED_MODEL_NAME,
    BACKEND,
    DTYPE,
    MAX_SEQUENCE_LENGTH,
    MAX_BATCH_SIZE,
    WEIGHTS_INITIAL,
    KV_CACHE_MODE,
    CUDA_GRAPHS,
    REFIT_STAGING,
    REFIT_STAGING_HEADROOM_MIB,
    TENSOR_PARALLEL,
    PIPELINE_PARALLEL,
    FRONTEND_PORT,
    AGENT_PORT,
    METRICS_PORT,
    AGENT_TOKEN_FILE,
    API_KEY,
    RANK,
    WORLD_SIZE,
    LOCAL_GPUS,
    MASTER_ADDR,
    MASTER_PORT,
)
"""What the operator writes on every engine pod (``API_KEY`` with ``spec.frontend.apiKeySecret``): a
fleet's ``spec.engine.env`` may not set them, so the checked ports, ranks and model stay the
operator's. The others (``KV_CACHE_GIB``, ``REFIT_WAIT_SECONDS``, ...) are the user's to set."""

USER_SETTINGS = (
    KV_CACHE_GIB,
    REFIT_WAIT_SECONDS,
    FUSED_KERNELS,
    PREFILL_GRAPHS,
    API_SERVERS,
    LOCAL_RANKS,
    API_KEY_FILE,
    TERMINATION_LOG,
)
"""The engine settings a fleet's ``spec.engine.env`` may set (every name that is neither the
operator's nor informational; docs/operations.md lists them). The operator checks their values with
the engine's own parser before it creates a pod, so a value the engine refuses is ``InvalidSpec``
naming the variable."""
