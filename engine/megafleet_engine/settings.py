"""The engine pod's one settings object, read from ``MEGAFLEET_*`` environment variables.

The operator sets these variables on every engine pod (DESIGN.md section 5: ranks, world size,
master address, agent token); a person running ``megafleet-engine`` by hand sets them too.
:func:`from_env` is called once by :mod:`megafleet_engine.cli`; everything else receives the
resulting :class:`Settings` (or the parts it needs) as an argument and never reads the
environment itself. Invalid values raise :class:`SettingsError` naming the variable.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

__all__ = ["BackendName", "Dtype", "KvCacheMode", "Settings", "SettingsError", "WeightsInitial", "from_env"]

BackendName = Literal["transformers", "megatron"]
Dtype = Literal["bfloat16", "float16", "float32"]
WeightsInitial = Literal["checkpoint", "refit"]
KvCacheMode = Literal["persist", "offload", "recompute"]

PREFIX = "MEGAFLEET_"


class SettingsError(ValueError):
    """An environment variable is missing or has an invalid value; the message names it."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything one engine pod needs to start; immutable once read."""

    model_source: str
    """``MEGAFLEET_MODEL_SOURCE`` (required): checkpoint location the backend loads the model config,
    tokenizer and (with ``weights_initial == "checkpoint"``) weights from; ``tiny://llama`` is the
    built-in tiny test model."""

    served_model_name: str = ""
    """``MEGAFLEET_SERVED_MODEL_NAME``: the ``model`` clients send in the OpenAI API. Default: the
    model source, so a hand-started engine answers to what it was started with; the operator
    always sets it (spec.model.servedName, else the fleet's name)."""

    backend: BackendName = "transformers"
    """``MEGAFLEET_BACKEND``: ``transformers`` or ``megatron``. Default ``transformers`` because it
    runs anywhere (CPU included) with no extra install; the operator always sets it."""

    dtype: Dtype = "bfloat16"
    """``MEGAFLEET_DTYPE``: parameter data type. Default ``bfloat16``, the API's default."""

    max_sequence_length: int = 4096
    """``MEGAFLEET_MAX_SEQUENCE_LENGTH``: longest prompt plus completion, in tokens. Default 4096,
    the API's default; requests beyond it are rejected with 400."""

    max_batch_size: int = 64
    """``MEGAFLEET_MAX_BATCH_SIZE``: most sequences decoded together, in sequences. Default 64, the
    API's default."""

    weights_initial: WeightsInitial = "checkpoint"
    """``MEGAFLEET_WEIGHTS_INITIAL``: ``checkpoint`` (serve weight version 0 from the checkpoint at
    start) or ``refit`` (start without a weight version, state ``loading``, and answer 503 until the
    first refit delivers weights; NeMo RL's ``skip_weight_load``)."""

    host: str = "127.0.0.1"
    """``MEGAFLEET_HOST``: address every server binds (the pod IP). Default loopback, so a
    hand-started engine is not reachable from other machines by accident."""

    frontend_port: int = 8000
    """``MEGAFLEET_FRONTEND_PORT``: TCP port of the OpenAI frontend (spec.frontend.port). Default
    8000. A pod with several frontend ranks gives the k-th one ``frontend_port + k``. 0 binds
    any free port (tests)."""

    agent_port: int = 8471
    """``MEGAFLEET_AGENT_PORT``: TCP port of the agent API the operator calls. Default 8471, the
    operator's fixed agent port. 0 binds any free port (tests)."""

    metrics_port: int = 9400
    """``MEGAFLEET_METRICS_PORT``: TCP port of the Prometheus ``/metrics`` endpoint. Default 9400,
    the operator's fixed metrics port. 0 binds any free port (tests)."""

    agent_token_file: Path | None = None
    """``MEGAFLEET_AGENT_TOKEN_FILE``: file holding the agent's bearer token (a mounted Secret, read
    on every agent call so a rotated Secret takes effect). Required to serve the agent: it
    suspends engines and replaces weights, so it is never unauthenticated."""

    api_key_file: Path | None = None
    """``MEGAFLEET_API_KEY_FILE``: file holding the API key clients must send as
    ``Authorization: Bearer`` on ``/v1/*`` (spec.frontend.apiKeySecret mounted as a file). Default
    unset: no key, unless ``MEGAFLEET_API_KEY`` is set."""

    api_key: str | None = dataclasses.field(default=None, repr=False)
    """``MEGAFLEET_API_KEY``: the API key itself, for when the Secret is passed as an environment
    variable (``secretKeyRef``, what the operator does today). At most one of this and
    ``MEGAFLEET_API_KEY_FILE``; set but empty is an error, never "no key". Kept out of ``repr``."""

    rank: int = 0
    """``MEGAFLEET_RANK``: global rank, in the shard's world, of this pod's first process (local
    rank 0); local process ``i`` has rank ``rank + i``. Default 0."""

    world_size: int = 1
    """``MEGAFLEET_WORLD_SIZE``: ranks in the shard's process group (TP x PP x CP). Default 1; above
    1 every rank joins the group through torch.distributed."""

    tensor_parallel: int = 1
    """``MEGAFLEET_TENSOR_PARALLEL``: TP size, in ranks. Default 1. With the pipeline size it
    decides which ranks are frontend ranks (``tp_rank == 0 and pp_rank == 0``)."""

    pipeline_parallel: int = 1
    """``MEGAFLEET_PIPELINE_PARALLEL``: PP size, in ranks. Default 1."""

    master_addr: str = "127.0.0.1"
    """``MEGAFLEET_MASTER_ADDR``: host of rank 0's rendezvous (the shard's headless Service DNS
    name). Default loopback: a one-pod shard rendezvouses with itself."""

    master_port: int = 29500
    """``MEGAFLEET_MASTER_PORT``: TCP port of rank 0's rendezvous. Default 29500, torch's default."""

    local_gpus: int = 0
    """``MEGAFLEET_LOCAL_GPUS``: GPUs of this pod, one rank process each; 0 runs one process on
    CPU. Default 0."""

    local_rank_count: int = 0
    """``MEGAFLEET_LOCAL_RANKS``: rank processes this pod runs. Default 0: one per local GPU, or one
    on CPU. On CPU it may be set above 1 to run a multi-rank pod (tests of the pod's rank
    processes on machines without GPUs); with GPUs it must equal ``MEGAFLEET_LOCAL_GPUS``."""

    kv_cache_mode: KvCacheMode = "persist"
    """``MEGAFLEET_KV_CACHE_MODE``: ``persist``, ``offload`` or ``recompute``: what happens to KV
    caches across a refit (spec.engine.kvCacheMode). Default ``persist``, the API's default."""

    cuda_graphs: bool = True
    """``MEGAFLEET_CUDA_GRAPHS``: ``true`` or ``false``: capture decode CUDA graphs at start (megatron
    backend; the operator sets it from spec.engine.cudaGraphs). Default ``true``."""

    kv_cache_gib: int = 20
    """``MEGAFLEET_KV_CACHE_GIB``: GPU memory for the paged KV cache of the megatron backend, in GiB.
    Default 20 (an 8B model in bf16 leaves far more on an H200; raise it for long sequences)."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def model_name(self) -> str:
        """The served model name, defaulting to the model source."""
        return self.served_model_name or self.model_source

    @property
    def local_ranks(self) -> int:
        """Rank processes this pod runs: one per GPU, or one on CPU (unless ``MEGAFLEET_LOCAL_RANKS``)."""
        return self.local_rank_count or max(self.local_gpus, 1)

    def is_frontend_rank(self, rank: int) -> bool:
        """Whether global ``rank`` hosts an OpenAI frontend: ``tp_rank == 0 and pp_rank == 0``.

        Megatron order (TP fastest, PP slowest): ``tp_rank = rank % TP`` and
        ``pp_rank = rank // (world_size // PP)``.
        """
        return rank % self.tensor_parallel == 0 and rank < self.world_size // self.pipeline_parallel


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read :class:`Settings` from ``environ`` (default: the process environment)."""
    env = os.environ if environ is None else environ
    reader = _Reader(env)
    source = reader.text("MODEL_SOURCE")
    if not source:
        raise SettingsError(f"{PREFIX}MODEL_SOURCE is required: the checkpoint location (or tiny://llama)")
    defaults = Settings(model_source=source)
    return Settings(
        model_source=source,
        served_model_name=reader.text("SERVED_MODEL_NAME"),
        backend=reader.choice("BACKEND", get_args(BackendName), defaults.backend),  # type: ignore[arg-type]
        dtype=reader.choice("DTYPE", get_args(Dtype), defaults.dtype),  # type: ignore[arg-type]
        max_sequence_length=reader.integer("MAX_SEQUENCE_LENGTH", defaults.max_sequence_length),
        max_batch_size=reader.integer("MAX_BATCH_SIZE", defaults.max_batch_size),
        weights_initial=reader.choice("WEIGHTS_INITIAL", get_args(WeightsInitial), defaults.weights_initial),  # type: ignore[arg-type]
        host=reader.text("HOST") or defaults.host,
        frontend_port=reader.integer("FRONTEND_PORT", defaults.frontend_port),
        agent_port=reader.integer("AGENT_PORT", defaults.agent_port),
        metrics_port=reader.integer("METRICS_PORT", defaults.metrics_port),
        agent_token_file=reader.path("AGENT_TOKEN_FILE"),
        api_key_file=reader.path("API_KEY_FILE"),
        api_key=reader.secret("API_KEY"),
        rank=reader.integer("RANK", defaults.rank),
        world_size=reader.integer("WORLD_SIZE", defaults.world_size),
        tensor_parallel=reader.integer("TENSOR_PARALLEL", defaults.tensor_parallel),
        pipeline_parallel=reader.integer("PIPELINE_PARALLEL", defaults.pipeline_parallel),
        master_addr=reader.text("MASTER_ADDR") or defaults.master_addr,
        master_port=reader.integer("MASTER_PORT", defaults.master_port),
        local_gpus=reader.integer("LOCAL_GPUS", defaults.local_gpus),
        local_rank_count=reader.integer("LOCAL_RANKS", defaults.local_rank_count),
        kv_cache_mode=reader.choice("KV_CACHE_MODE", get_args(KvCacheMode), defaults.kv_cache_mode),  # type: ignore[arg-type]
        cuda_graphs=reader.choice("CUDA_GRAPHS", ("true", "false"), "true" if defaults.cuda_graphs else "false")
        == "true",
        kv_cache_gib=reader.integer("KV_CACHE_GIB", defaults.kv_cache_gib),
    )


@dataclasses.dataclass(frozen=True)
class _Reader:
    """Typed access to ``MEGAFLEET_*`` variables; empty counts as unset."""

    env: Mapping[str, str]

    def text(self, name: str) -> str:
        return self.env.get(PREFIX + name, "").strip()

    def integer(self, name: str, default: int) -> int:
        raw = self.text(name)
        if not raw:
            return default
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{PREFIX}{name} must be an integer, got {raw!r}") from None

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        raw = self.text(name) or default
        if raw not in allowed:
            raise SettingsError(f"{PREFIX}{name} must be one of {', '.join(allowed)}, got {raw!r}")
        return raw

    def secret(self, name: str) -> str | None:
        """A secret value: unset is ``None``; set but blank is an error (an empty Secret key must not
        turn authentication off)."""
        if PREFIX + name not in self.env:
            return None
        value = self.text(name)
        if not value:
            raise SettingsError(f"{PREFIX}{name} is set but empty")
        return value

    def path(self, name: str) -> Path | None:
        raw = self.text(name)
        return Path(raw) if raw else None


def _check(settings: Settings) -> None:
    """Reject values no engine can run with; each message names the variable and the rule."""
    for name, value, low in (
        ("MAX_SEQUENCE_LENGTH", settings.max_sequence_length, 2),
        ("MAX_BATCH_SIZE", settings.max_batch_size, 1),
        ("WORLD_SIZE", settings.world_size, 1),
        ("TENSOR_PARALLEL", settings.tensor_parallel, 1),
        ("PIPELINE_PARALLEL", settings.pipeline_parallel, 1),
        ("RANK", settings.rank, 0),
        ("LOCAL_GPUS", settings.local_gpus, 0),
        ("LOCAL_RANKS", settings.local_rank_count, 0),
        ("KV_CACHE_GIB", settings.kv_cache_gib, 1),
    ):
        if value < low:
            raise SettingsError(f"{PREFIX}{name} must be at least {low}, got {value}")
    for name, port in (
        ("FRONTEND_PORT", settings.frontend_port),
        ("AGENT_PORT", settings.agent_port),
        ("METRICS_PORT", settings.metrics_port),
        ("MASTER_PORT", settings.master_port),
    ):
        if not 0 <= port <= 65535:
            raise SettingsError(f"{PREFIX}{name} must be a TCP port (0 to 65535), got {port}")
    ports = [p for p in (settings.frontend_port, settings.agent_port, settings.metrics_port) if p != 0]
    if len(set(ports)) != len(ports):
        raise SettingsError(
            f"{PREFIX}FRONTEND_PORT, {PREFIX}AGENT_PORT and {PREFIX}METRICS_PORT must differ, got "
            f"{settings.frontend_port}, {settings.agent_port} and {settings.metrics_port}"
        )
    if settings.world_size % (settings.tensor_parallel * settings.pipeline_parallel):
        raise SettingsError(
            f"{PREFIX}WORLD_SIZE {settings.world_size} is not a multiple of {PREFIX}TENSOR_PARALLEL x "
            f"{PREFIX}PIPELINE_PARALLEL = {settings.tensor_parallel * settings.pipeline_parallel}"
        )
    if settings.local_gpus and settings.local_rank_count not in (0, settings.local_gpus):
        raise SettingsError(
            f"{PREFIX}LOCAL_RANKS {settings.local_rank_count} must equal {PREFIX}LOCAL_GPUS "
            f"{settings.local_gpus}: a pod runs one rank per GPU"
        )
    if settings.rank + settings.local_ranks > settings.world_size:
        raise SettingsError(
            f"{PREFIX}RANK {settings.rank} plus {settings.local_ranks} local rank(s) ({PREFIX}LOCAL_RANKS or "
            f"{PREFIX}LOCAL_GPUS) exceeds "
            f"{PREFIX}WORLD_SIZE {settings.world_size}"
        )
    if settings.local_ranks > 1:
        if settings.agent_port == 0:
            raise SettingsError(
                f"{PREFIX}AGENT_PORT must be set on a pod of several ranks: each rank's agent listens next to it"
            )
        siblings = range(settings.agent_port, settings.agent_port + settings.local_ranks)
        clash = [port for port in (settings.frontend_port, settings.metrics_port) if port in siblings]
        if clash or siblings[-1] > 65535:
            raise SettingsError(
                f"the agents of this pod's {settings.local_ranks} ranks listen on {PREFIX}AGENT_PORT to "
                f"{PREFIX}AGENT_PORT + {settings.local_ranks - 1} ({siblings[0]} to {siblings[-1]}); "
                f"{PREFIX}FRONTEND_PORT and {PREFIX}METRICS_PORT must lie outside"
            )
    if settings.api_key is not None and settings.api_key_file is not None:
        raise SettingsError(f"set {PREFIX}API_KEY or {PREFIX}API_KEY_FILE, not both")
    try:
        ipaddress.ip_address(settings.host)
    except ValueError:
        raise SettingsError(f"{PREFIX}HOST must be an IP address (the pod IP), got {settings.host!r}") from None
