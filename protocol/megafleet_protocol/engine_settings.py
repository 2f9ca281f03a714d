"""The engine pod's one settings object, read from ``MEGAFLEET_*`` environment variables.

The operator sets these variables on every engine pod (ranks, world size, master address, agent
token; their names are :mod:`megafleet_protocol.env`); a person running ``megafleet-engine`` by hand
sets them too, and a fleet's ``spec.engine.env`` may set the ones the operator leaves to the user
(``env.SET_BY_OPERATOR`` says which are not).
:func:`from_env` is the one parser of these variables: the engine calls it once at start
(:mod:`megafleet_engine.cli`), and the operator runs it over the env it would give each pod of a
fleet before it creates any (:mod:`megafleet.reconcile.pod_checks`), so a value the engine refuses
makes the fleet ``InvalidSpec`` instead of a crash-looping pod. Everything else receives the
resulting :class:`Settings` (or the parts it needs) as an argument and never reads the
environment itself. Invalid values raise :class:`SettingsError` naming the variable.
Standard library only: the operator imports it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

from megafleet_protocol import env, http_limits, ports, vocabulary

FusedKernels = Literal["off", "rope-swiglu", "gemv", "all"]
PrefixCaching = Literal["auto", "true", "false"]
"""Whether the backend shares prompt-prefix KV among sequences (``auto``: the backend's default)."""
"""The megatron backend's fused-kernel choices (``EngineOptions.fused_kernels``)."""

__all__ = ["Settings", "SettingsError", "default_api_servers", "from_env", "termination_log", "usable_cpus"]


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

    backend: vocabulary.BackendName = "transformers"
    """``MEGAFLEET_BACKEND``: ``transformers`` or ``megatron``. Default ``transformers`` because it
    runs anywhere (CPU included) with no extra install; the operator always sets it."""

    dtype: vocabulary.Dtype = "bfloat16"
    """``MEGAFLEET_DTYPE``: parameter data type. Default ``bfloat16``, the API's default."""

    max_sequence_length: int = 4096
    """``MEGAFLEET_MAX_SEQUENCE_LENGTH``: longest prompt plus completion, in tokens. Default 4096,
    the API's default; requests beyond it are rejected with 400."""

    max_batch_size: int = 64
    """``MEGAFLEET_MAX_BATCH_SIZE``: most sequences decoded together, in sequences. Default 64, the
    API's default."""

    weights_initial: vocabulary.WeightsInitial = "checkpoint"
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

    agent_port: int = ports.AGENT_PORT
    """``MEGAFLEET_AGENT_PORT``: TCP port of the agent API the operator calls. Default 8471, the
    operator's fixed agent port. 0 binds any free port (tests)."""

    metrics_port: int = ports.METRICS_PORT
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

    master_port: int = ports.MASTER_PORT
    """``MEGAFLEET_MASTER_PORT``: TCP port of rank 0's rendezvous. Default 29500, torch's default."""

    local_gpus: int = 0
    """``MEGAFLEET_LOCAL_GPUS``: GPUs of this pod, one rank process each; 0 runs one process on
    CPU. Default 0."""

    local_rank_count: int = 0
    """``MEGAFLEET_LOCAL_RANKS``: rank processes this pod runs. Default 0: one per local GPU, or one
    on CPU. On CPU it may be set above 1 to run a multi-rank pod (tests of the pod's rank
    processes on machines without GPUs); with GPUs it must equal ``MEGAFLEET_LOCAL_GPUS``."""

    kv_cache_mode: vocabulary.KvCacheMode = "persist"
    """``MEGAFLEET_KV_CACHE_MODE``: ``persist``, ``offload`` or ``recompute``: what happens to KV
    caches across a refit (spec.engine.kvCacheMode). Default ``persist``, the API's default."""

    cuda_graphs: bool = True
    """``MEGAFLEET_CUDA_GRAPHS``: ``true`` or ``false``: capture decode CUDA graphs at start (megatron
    backend; the operator sets it from spec.engine.cudaGraphs). Default ``true``."""

    fused_kernels: FusedKernels = "rope-swiglu"
    """``MEGAFLEET_FUSED_KERNELS``: ``off``, ``rope-swiglu``, ``gemv`` or ``all``: the fused Triton kernels the
    megatron backend swaps into its layers on one rank (see ``EngineOptions.fused_kernels``; set it
    through ``spec.engine.env``). Default ``rope-swiglu``: every fusion that is bitwise megatron's
    own results (RoPE, SwiGLU, the RMSNorms with their residual adds, the qkv copy/RoPE/KV append);
    ``off`` falls back to megatron's ops; ``gemv`` also runs one-token steps' linear layers through a
    Triton GEMV (fc1 with the SwiGLU in its kernel) with programmatic dependent launches instead of
    cuBLAS (faster at batch 1, not bitwise); ``all`` also small decode steps' attention through a
    Triton kernel instead of FlashAttention (not bitwise)."""

    prefill_graphs: bool = False
    """``MEGAFLEET_PREFILL_GRAPHS``: ``true`` or ``false``: the megatron backend also captures
    megatron's CUDA graphs for prefill and mixed steps of up to 512 tokens (see
    ``EngineOptions.prefill_graphs``; set it through ``spec.engine.env``), so a short prompt's
    prefill is one graph replay instead of the layers' eager forward. Default ``false``: more graphs
    to capture at start, and it pays only where the time outside decode steps counts (batch 1:
    with ``gemv``, 222 tok/s on an H200: ``bench/README.md``). Does nothing without decode CUDA graphs
    (``MEGAFLEET_CUDA_GRAPHS``)."""

    prefix_caching: PrefixCaching = "auto"
    """``MEGAFLEET_PREFIX_CACHING``: ``auto``, ``true`` or ``false``: whether the backend prefills a
    prompt prefix once for every sequence that shares it (the samples of one prompt, a shared system
    prompt). The transformers backend shares one prefill among the identical prompts of a batch;
    the megatron backend turns on megatron-core's own prefix caching (``enable_prefix_caching``, KV
    blocks shared by hash). Either way a refit invalidates every cached block computed with the old
    weights. ``auto`` (the default): on for both (megatron: since its GPU tests passed with it and
    the rollout benchmark measured 1.23x output tokens/s, ``bench/README.md``); ``false`` turns it off."""

    kv_cache_gib: int = 20
    """``MEGAFLEET_KV_CACHE_GIB``: GPU memory for the paged KV cache of the megatron backend, in GiB.
    Default 20 (an 8B model in bf16 leaves far more on an H200; raise it for long sequences)."""

    refit_wait_seconds: int = 60
    """``MEGAFLEET_REFIT_WAIT_SECONDS``: how long a request that arrives while the engine is
    suspended for a refit waits at the gate for the new version before answering 503, in seconds.
    Default 60: a refit takes seconds, and a request held that long still beats a failed one the
    client must retry; bounded so a refit that hangs (until its own watchdog) cannot hold clients
    forever. 0 answers 503 at once (the behaviour before holding existed). Set it through
    ``spec.engine.env``."""

    refit_staging: vocabulary.StagingMode = "off"
    """``MEGAFLEET_REFIT_STAGING``: ``off``, ``auto`` or ``required``: whether the engine allocates, once
    at start, a staging copy of its weights that refits receive into while it serves (the pause then
    covers only the switch; spec.refit.staging). ``off`` allocates nothing; ``auto`` and ``required``
    allocate it when the memory rule allows (free memory after the model and its KV cache covers the
    copy, two bucket buffers and the headroom: :mod:`megafleet_engine.refit_staging`); without room the
    pod still serves and ``GET /v1/state`` says why, and the refits that require staging fail with
    ``StagingUnavailable``. Default ``off``: the copy doubles the weights' memory, and an engine
    started without the setting (by hand, or by an operator that never sends staging) would hold a
    copy nothing uses. The operator always sets it, from spec.refit.staging, whose default is
    ``auto``."""

    refit_staging_headroom_mib: int = 1024
    """``MEGAFLEET_REFIT_STAGING_HEADROOM_MIB``: memory the staging rule leaves free beside the copy and
    the receive buffers, in MiB (spec.refit.stagingHeadroomMiB). Default 1024."""

    api_servers: int | None = None
    """``MEGAFLEET_API_SERVERS``: API-server processes that serve the OpenAI frontend of a frontend
    rank, apart from the engine core (the rank process, which keeps the model, the scheduler, the
    agent and the metrics); they share the frontend port. 0 serves the frontend in the rank
    process itself. Default (unset): :func:`default_api_servers` of the CPUs the pod may use, one
    on small pods."""

    termination_log: Path | None = None
    """``MEGAFLEET_TERMINATION_LOG``: the file the engine writes why it exited to, when it exits on an
    error. Default (unset): the container's termination message file, ``/dev/termination-log``,
    when it exists (the kubelet makes it; the operator's pods keep the default
    ``terminationMessagePath``), so the reason shows in the pod's status and the operator puts it
    into the shard's ``lastError``, an Event and ``Degraded``; nothing on a machine without one
    (:mod:`megafleet_engine.termination`). The local pod runner points it at a file of its own."""
    frontend_max_connections: int = http_limits.FRONTEND_MAX_CONNECTIONS
    """``MEGAFLEET_FRONTEND_MAX_CONNECTIONS``: open connections one frontend server process holds at
    most (each API-server process; with ``MEGAFLEET_API_SERVERS=0`` the rank process). One more is
    answered ``503`` (OpenAI error body, ``Retry-After: 1``) and closed at once. Default 4096: far
    above what RL clients keep open (the ``openai`` client pools up to 1,000 per process), low
    enough that connections nobody uses cannot exhaust the process's file descriptors or memory."""

    agent_max_connections: int = http_limits.AGENT_MAX_CONNECTIONS
    """``MEGAFLEET_AGENT_MAX_CONNECTIONS``: the same bound for the agent server and for the metrics
    server, each. Default 64: only the operator, the pod's other ranks and the kubelet's probes call
    the agent, and a scraper or two the metrics."""

    http_header_timeout_seconds: int = http_limits.HttpLimits.header_timeout_seconds
    """``MEGAFLEET_HTTP_HEADER_TIMEOUT_SECONDS``: every server closes a connection whose request head
    (request line and headers) has not arrived whole this many seconds after the connection opened,
    or after the first byte of a kept-alive connection's next request (nginx's
    ``client_header_timeout``); a client that sent part of one gets ``408``. Default 10: a head is a
    few hundred bytes, so only a client that trickles it (slowloris) or opens a connection and
    sends nothing takes that long. uvicorn has no such timeout of its own."""

    http_stall_timeout_seconds: int = http_limits.HttpLimits.stall_timeout_seconds
    """``MEGAFLEET_HTTP_STALL_TIMEOUT_SECONDS``: every server closes a connection whose request body
    stops arriving for this many seconds (then ``408``), or whose client reads nothing of a response
    for as long while the server has more to send (nginx's ``client_body_timeout`` and
    ``send_timeout``); the request is cancelled as if the client had gone. Default 60 (nginx's)."""

    http_keep_alive_seconds: int = http_limits.HttpLimits.keep_alive_seconds
    """``MEGAFLEET_HTTP_KEEP_ALIVE_SECONDS``: how long every server keeps an idle connection open
    between two requests (uvicorn's ``timeout_keep_alive``). Default 75 (nginx's): longer than the
    usual client pool's own expiry (``httpx`` and the ``openai`` client 5 s, aiohttp 15 s), so the
    client closes an idle connection first and never sends a request on one the server is closing
    at that moment."""

    http_max_body_mib: int = http_limits.HttpLimits.max_body_bytes // http_limits.MIB
    """``MEGAFLEET_HTTP_MAX_BODY_MIB``: largest request body every server reads, in MiB; a larger one
    is answered ``413`` and its connection closed. Default 64: the largest request the frontend
    takes (128 sequences of token ids at a 32k context) is about 25 MiB of JSON."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def http_bounds(self) -> http_limits.HttpBounds:
        """The limits of the pod's HTTP servers."""
        timeouts = {
            "header_timeout_seconds": self.http_header_timeout_seconds,
            "stall_timeout_seconds": self.http_stall_timeout_seconds,
            "keep_alive_seconds": self.http_keep_alive_seconds,
            "max_body_bytes": self.http_max_body_mib * http_limits.MIB,
        }
        return http_limits.HttpBounds(
            frontend=http_limits.HttpLimits(self.frontend_max_connections, **timeouts),
            agent=http_limits.HttpLimits(self.agent_max_connections, **timeouts),
        )

    @property
    def api_server_count(self) -> int:
        """API-server processes to run: ``MEGAFLEET_API_SERVERS``, or the default for this pod."""
        return default_api_servers(usable_cpus()) if self.api_servers is None else self.api_servers

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
    reader = _Reader(os.environ if environ is None else environ)
    source = reader.text(env.MODEL_SOURCE)
    if not source:
        raise SettingsError(f"{env.MODEL_SOURCE} is required: the checkpoint location (or tiny://llama)")
    defaults = Settings(model_source=source)
    return Settings(
        model_source=source,
        served_model_name=reader.text(env.SERVED_MODEL_NAME),
        backend=reader.choice(env.BACKEND, _choices(vocabulary.BackendName, defaults.backend), defaults.backend),  # type: ignore[arg-type]
        dtype=reader.choice(env.DTYPE, _choices(vocabulary.Dtype, defaults.dtype), defaults.dtype),  # type: ignore[arg-type]
        max_sequence_length=reader.integer(env.MAX_SEQUENCE_LENGTH, defaults.max_sequence_length),
        max_batch_size=reader.integer(env.MAX_BATCH_SIZE, defaults.max_batch_size),
        weights_initial=reader.choice(
            env.WEIGHTS_INITIAL, _choices(vocabulary.WeightsInitial, defaults.weights_initial), defaults.weights_initial
        ),  # type: ignore[arg-type]
        host=reader.text(env.HOST) or defaults.host,
        frontend_port=reader.integer(env.FRONTEND_PORT, defaults.frontend_port),
        agent_port=reader.integer(env.AGENT_PORT, defaults.agent_port),
        metrics_port=reader.integer(env.METRICS_PORT, defaults.metrics_port),
        agent_token_file=reader.path(env.AGENT_TOKEN_FILE),
        api_key_file=reader.path(env.API_KEY_FILE),
        api_key=reader.secret(env.API_KEY),
        rank=reader.integer(env.RANK, defaults.rank),
        world_size=reader.integer(env.WORLD_SIZE, defaults.world_size),
        tensor_parallel=reader.integer(env.TENSOR_PARALLEL, defaults.tensor_parallel),
        pipeline_parallel=reader.integer(env.PIPELINE_PARALLEL, defaults.pipeline_parallel),
        master_addr=reader.text(env.MASTER_ADDR) or defaults.master_addr,
        master_port=reader.integer(env.MASTER_PORT, defaults.master_port),
        local_gpus=reader.integer(env.LOCAL_GPUS, defaults.local_gpus),
        local_rank_count=reader.integer(env.LOCAL_RANKS, defaults.local_rank_count),
        kv_cache_mode=reader.choice(
            env.KV_CACHE_MODE, _choices(vocabulary.KvCacheMode, defaults.kv_cache_mode), defaults.kv_cache_mode
        ),  # type: ignore[arg-type]
        cuda_graphs=reader.flag(env.CUDA_GRAPHS, defaults.cuda_graphs),
        fused_kernels=reader.choice(
            env.FUSED_KERNELS, _choices(FusedKernels, defaults.fused_kernels), defaults.fused_kernels
        ),  # type: ignore[arg-type]
        prefill_graphs=reader.flag(env.PREFILL_GRAPHS, defaults.prefill_graphs),
        prefix_caching=reader.choice(
            env.PREFIX_CACHING, _choices(PrefixCaching, defaults.prefix_caching), defaults.prefix_caching
        ),  # type: ignore[arg-type]
        kv_cache_gib=reader.integer(env.KV_CACHE_GIB, defaults.kv_cache_gib),
        refit_wait_seconds=reader.integer(env.REFIT_WAIT_SECONDS, defaults.refit_wait_seconds),
        refit_staging=reader.choice(
            env.REFIT_STAGING, _choices(vocabulary.StagingMode, defaults.refit_staging), defaults.refit_staging
        ),  # type: ignore[arg-type]
        refit_staging_headroom_mib=reader.integer(env.REFIT_STAGING_HEADROOM_MIB, defaults.refit_staging_headroom_mib),
        api_servers=reader.integer(env.API_SERVERS, -1) if reader.text(env.API_SERVERS) else None,
        termination_log=termination_log(reader.env),
        frontend_max_connections=reader.integer(env.FRONTEND_MAX_CONNECTIONS, defaults.frontend_max_connections),
        agent_max_connections=reader.integer(env.AGENT_MAX_CONNECTIONS, defaults.agent_max_connections),
        http_header_timeout_seconds=reader.integer(
            env.HTTP_HEADER_TIMEOUT_SECONDS, defaults.http_header_timeout_seconds
        ),
        http_stall_timeout_seconds=reader.integer(env.HTTP_STALL_TIMEOUT_SECONDS, defaults.http_stall_timeout_seconds),
        http_keep_alive_seconds=reader.integer(env.HTTP_KEEP_ALIVE_SECONDS, defaults.http_keep_alive_seconds),
        http_max_body_mib=reader.integer(env.HTTP_MAX_BODY_MIB, defaults.http_max_body_mib),
    )


def termination_log(environ: Mapping[str, str] | None = None) -> Path | None:
    """``MEGAFLEET_TERMINATION_LOG`` of ``environ`` (default: the process environment), or None when
    unset. Read by :func:`from_env` and, before the settings are read (they may be what fails), by
    :mod:`megafleet_engine.cli`."""
    raw = (os.environ if environ is None else environ).get(env.TERMINATION_LOG, "").strip()
    return Path(raw) if raw else None


CPUS_PER_API_SERVER = 4
"""CPUs the default gives each API-server process: one for its event loop and JSON, the rest left
to the engine core's busy loop and to the other processes of the pod."""
MAX_DEFAULT_API_SERVERS = 8


def default_api_servers(cpus: float) -> int:
    """The default number of API-server processes for a pod that may use ``cpus`` CPUs: one per
    :data:`CPUS_PER_API_SERVER`, at least 1 and at most :data:`MAX_DEFAULT_API_SERVERS`."""
    return max(1, min(MAX_DEFAULT_API_SERVERS, int(cpus // CPUS_PER_API_SERVER)))


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> float:
    """CPUs this process may use: the cgroup v2 quota (a pod's CPU limit) when set, else the CPUs
    it is allowed to run on."""
    available = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return available
    if quota == "max":
        return available
    return min(available, int(quota) / int(period))


def _choices(literal: object, default: str) -> tuple[str, ...]:
    """The values of ``literal``, the default first (the order error messages list them in)."""
    return (default, *(value for value in get_args(literal) if value != default))


@dataclasses.dataclass(frozen=True)
class _Reader:
    """Typed access to ``MEGAFLEET_*`` variables; empty counts as unset."""

    env: Mapping[str, str]

    def text(self, name: str) -> str:
        return self.env.get(name, "").strip()

    def integer(self, name: str, default: int) -> int:
        raw = self.text(name)
        if not raw:
            return default
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{name} must be an integer, got {_shown(raw)}") from None

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        raw = self.text(name) or default
        if raw not in allowed:
            raise SettingsError(f"{name} must be one of {', '.join(allowed)}, got {_shown(raw)}")
        return raw

    def flag(self, name: str, default: bool) -> bool:
        """``true`` or ``false``, nothing else (a typo must not silently mean either)."""
        return self.choice(name, ("true", "false"), "true" if default else "false") == "true"

    def secret(self, name: str) -> str | None:
        """A secret value: unset is ``None``; set but blank is an error (an empty Secret key must not
        turn authentication off)."""
        if name not in self.env:
            return None
        value = self.text(name)
        if not value:
            raise SettingsError(f"{name} is set but empty")
        return value

    def path(self, name: str) -> Path | None:
        raw = self.text(name)
        return Path(raw) if raw else None


MOST_KV_CACHE_GIB = 1 << 16
"""``MEGAFLEET_KV_CACHE_GIB``'s bound: 64 TiB, far beyond any GPU's memory (a larger number is a
typo, and one past a float's range breaks the engine far from its cause)."""
MOST_REFIT_WAIT_SECONDS = 24 * 3600
"""``MEGAFLEET_REFIT_WAIT_SECONDS``' bound: a day (a refit's own watchdog ends it long before)."""
MOST_API_SERVERS = 256
"""``MEGAFLEET_API_SERVERS``' bound: one process per CPU of the largest pods."""
SHOWN_CHARACTERS = 64
"""The most of a refused value an error message repeats: it reaches a fleet's status, its Events
and a container's termination message, each bounded."""


def _shown(value: object) -> str:
    """``value`` as an error message shows it (a text quoted), cut to :data:`SHOWN_CHARACTERS`."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= SHOWN_CHARACTERS else f"{text[: SHOWN_CHARACTERS - 3]}..."


def _check(settings: Settings) -> None:
    """Reject values no engine can run with; each message names the variable and the rule."""
    _check_ranges(settings)
    _check_ports(settings)
    _check_ranks(settings)
    if settings.api_key is not None and settings.api_key_file is not None:
        raise SettingsError(f"set {env.API_KEY} or {env.API_KEY_FILE}, not both")
    try:
        ipaddress.ip_address(settings.host)
    except ValueError:
        raise SettingsError(f"{env.HOST} must be an IP address (the pod IP), got {_shown(settings.host)}") from None


def _check_ranges(settings: Settings) -> None:
    """Every number within its bounds."""
    for name, value, low in (
        (env.MAX_SEQUENCE_LENGTH, settings.max_sequence_length, 2),
        (env.MAX_BATCH_SIZE, settings.max_batch_size, 1),
        (env.WORLD_SIZE, settings.world_size, 1),
        (env.TENSOR_PARALLEL, settings.tensor_parallel, 1),
        (env.PIPELINE_PARALLEL, settings.pipeline_parallel, 1),
        (env.RANK, settings.rank, 0),
        (env.LOCAL_GPUS, settings.local_gpus, 0),
        (env.LOCAL_RANKS, settings.local_rank_count, 0),
        (env.KV_CACHE_GIB, settings.kv_cache_gib, 1),
        (env.REFIT_WAIT_SECONDS, settings.refit_wait_seconds, 0),
        (env.REFIT_STAGING_HEADROOM_MIB, settings.refit_staging_headroom_mib, 0),
        (env.API_SERVERS, 0 if settings.api_servers is None else settings.api_servers, 0),  # the default is >= 1
        (env.FRONTEND_MAX_CONNECTIONS, settings.frontend_max_connections, 1),
        (env.AGENT_MAX_CONNECTIONS, settings.agent_max_connections, 1),
        (env.HTTP_HEADER_TIMEOUT_SECONDS, settings.http_header_timeout_seconds, 1),
        (env.HTTP_STALL_TIMEOUT_SECONDS, settings.http_stall_timeout_seconds, 1),
        (env.HTTP_KEEP_ALIVE_SECONDS, settings.http_keep_alive_seconds, 1),
        (env.HTTP_MAX_BODY_MIB, settings.http_max_body_mib, 1),
    ):
        if value < low:
            raise SettingsError(f"{name} must be at least {low}, got {_shown(value)}")
    for name, value, high in (
        (env.KV_CACHE_GIB, settings.kv_cache_gib, MOST_KV_CACHE_GIB),
        (env.REFIT_WAIT_SECONDS, settings.refit_wait_seconds, MOST_REFIT_WAIT_SECONDS),
        (env.API_SERVERS, settings.api_servers or 0, MOST_API_SERVERS),
        (env.REFIT_STAGING_HEADROOM_MIB, settings.refit_staging_headroom_mib, 65536),
    ):
        if value > high:
            raise SettingsError(f"{name} must be at most {high}, got {_shown(value)}")


def _check_ports(settings: Settings) -> None:
    """Every port a TCP port, the pod's own ones apart."""
    for name, port in (
        (env.FRONTEND_PORT, settings.frontend_port),
        (env.AGENT_PORT, settings.agent_port),
        (env.METRICS_PORT, settings.metrics_port),
        (env.MASTER_PORT, settings.master_port),
    ):
        if not 0 <= port <= 65535:
            raise SettingsError(f"{name} must be a TCP port (0 to 65535), got {_shown(port)}")
    bound = [p for p in (settings.frontend_port, settings.agent_port, settings.metrics_port) if p != 0]
    if len(set(bound)) != len(bound):
        raise SettingsError(
            f"{env.FRONTEND_PORT}, {env.AGENT_PORT} and {env.METRICS_PORT} must differ, got "
            f"{settings.frontend_port}, {settings.agent_port} and {settings.metrics_port}"
        )


def _check_ranks(settings: Settings) -> None:
    """The pod's ranks fit its shard's world, and each rank's agent has its port."""
    if settings.world_size % (settings.tensor_parallel * settings.pipeline_parallel):
        raise SettingsError(
            f"{env.WORLD_SIZE} {settings.world_size} is not a multiple of {env.TENSOR_PARALLEL} x "
            f"{env.PIPELINE_PARALLEL} = {settings.tensor_parallel * settings.pipeline_parallel}"
        )
    if settings.local_gpus and settings.local_rank_count not in (0, settings.local_gpus):
        raise SettingsError(
            f"{env.LOCAL_RANKS} {settings.local_rank_count} must equal {env.LOCAL_GPUS} "
            f"{settings.local_gpus}: a pod runs one rank per GPU"
        )
    if settings.rank + settings.local_ranks > settings.world_size:
        raise SettingsError(
            f"{env.RANK} {settings.rank} plus {settings.local_ranks} local rank(s) ({env.LOCAL_RANKS} or "
            f"{env.LOCAL_GPUS}) exceeds "
            f"{env.WORLD_SIZE} {settings.world_size}"
        )
    if settings.local_ranks > 1:
        if settings.agent_port == 0:
            raise SettingsError(
                f"{env.AGENT_PORT} must be set on a pod of several ranks: each rank's agent listens next to it"
            )
        siblings = range(settings.agent_port, settings.agent_port + settings.local_ranks)
        clash = [port for port in (settings.frontend_port, settings.metrics_port) if port in siblings]
        if clash or siblings[-1] > 65535:
            raise SettingsError(
                f"the agents of this pod's {settings.local_ranks} ranks listen on {env.AGENT_PORT} to "
                f"{env.AGENT_PORT} + {settings.local_ranks - 1} ({siblings[0]} to {siblings[-1]}); "
                f"{env.FRONTEND_PORT} and {env.METRICS_PORT} must lie outside"
            )
