"""Engine settings from ``MEGAFLEET_*`` variables: defaults, every variable read, and clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megafleet_engine import backends, cli
from megafleet_protocol import engine_settings as settings
from megafleet_protocol import http_limits


def test_defaults_need_only_the_model_source() -> None:
    read = settings.from_env({"MEGAFLEET_MODEL_SOURCE": "tiny://llama"})
    assert read == settings.Settings(model_source="tiny://llama")
    assert (read.frontend_port, read.agent_port, read.metrics_port) == (8000, 8471, 9400)
    assert (read.host, read.weights_initial, read.backend, read.world_size) == (
        "127.0.0.1",
        "checkpoint",
        "transformers",
        1,
    )
    assert read.model_name == "tiny://llama"
    assert read.is_frontend_rank(0)


def test_every_variable_is_read() -> None:
    env = {
        "MEGAFLEET_MODEL_SOURCE": "/models/llama",
        "MEGAFLEET_SERVED_MODEL_NAME": "policy",
        "MEGAFLEET_BACKEND": "megatron",
        "MEGAFLEET_DTYPE": "float16",
        "MEGAFLEET_MAX_SEQUENCE_LENGTH": "8192",
        "MEGAFLEET_MAX_BATCH_SIZE": "32",
        "MEGAFLEET_WEIGHTS_INITIAL": "refit",
        "MEGAFLEET_HOST": "127.0.0.9",
        "MEGAFLEET_FRONTEND_PORT": "8100",
        "MEGAFLEET_AGENT_PORT": "8472",
        "MEGAFLEET_METRICS_PORT": "9401",
        "MEGAFLEET_AGENT_TOKEN_FILE": "/var/run/agent/token",
        "MEGAFLEET_API_KEY_FILE": "/var/run/api/key",
        "MEGAFLEET_RANK": "4",
        "MEGAFLEET_WORLD_SIZE": "8",
        "MEGAFLEET_TENSOR_PARALLEL": "4",
        "MEGAFLEET_PIPELINE_PARALLEL": "2",
        "MEGAFLEET_MASTER_ADDR": "10.0.0.1",
        "MEGAFLEET_MASTER_PORT": "29501",
        "MEGAFLEET_LOCAL_GPUS": "4",
        "MEGAFLEET_LOCAL_RANKS": "4",
        "MEGAFLEET_KV_CACHE_MODE": "offload",
        "MEGAFLEET_CUDA_GRAPHS": "false",
        "MEGAFLEET_FUSED_KERNELS": "off",
        "MEGAFLEET_PREFILL_GRAPHS": "true",
        "MEGAFLEET_KV_CACHE_GIB": "40",
        "MEGAFLEET_API_SERVERS": "3",
        "MEGAFLEET_FRONTEND_MAX_CONNECTIONS": "1000",
        "MEGAFLEET_AGENT_MAX_CONNECTIONS": "16",
        "MEGAFLEET_HTTP_HEADER_TIMEOUT_SECONDS": "5",
        "MEGAFLEET_HTTP_STALL_TIMEOUT_SECONDS": "30",
        "MEGAFLEET_HTTP_KEEP_ALIVE_SECONDS": "20",
        "MEGAFLEET_HTTP_MAX_BODY_MIB": "8",
        "MEGAFLEET_REFIT_STAGING": "auto",
        "MEGAFLEET_REFIT_STAGING_HEADROOM_MIB": "2048",
    }
    read = settings.from_env(env)
    assert read == settings.Settings(
        model_source="/models/llama",
        served_model_name="policy",
        backend="megatron",
        dtype="float16",
        max_sequence_length=8192,
        max_batch_size=32,
        weights_initial="refit",
        host="127.0.0.9",
        frontend_port=8100,
        agent_port=8472,
        metrics_port=9401,
        agent_token_file=Path("/var/run/agent/token"),
        api_key_file=Path("/var/run/api/key"),
        rank=4,
        world_size=8,
        tensor_parallel=4,
        pipeline_parallel=2,
        master_addr="10.0.0.1",
        master_port=29501,
        local_gpus=4,
        local_rank_count=4,
        kv_cache_mode="offload",
        cuda_graphs=False,
        fused_kernels="off",
        prefill_graphs=True,
        kv_cache_gib=40,
        api_servers=3,
        frontend_max_connections=1000,
        agent_max_connections=16,
        http_header_timeout_seconds=5,
        http_stall_timeout_seconds=30,
        http_keep_alive_seconds=20,
        http_max_body_mib=8,
        refit_staging="auto",
        refit_staging_headroom_mib=2048,
    )
    assert read.model_name == "policy"
    assert read.api_server_count == 3
    # TP 4, PP 2, world 8: frontend ranks are tp_rank 0 of the first pipeline stage only
    assert [rank for rank in range(8) if read.is_frontend_rank(rank)] == [0]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, {"cuda_graphs": True, "fused_kernels": "rope-swiglu", "prefill_graphs": False}),
        (
            {"MEGAFLEET_FUSED_KERNELS": "gemv", "MEGAFLEET_PREFILL_GRAPHS": "true"},
            {"cuda_graphs": True, "fused_kernels": "gemv", "prefill_graphs": True},
        ),
        (
            {"MEGAFLEET_CUDA_GRAPHS": "false", "MEGAFLEET_FUSED_KERNELS": "all", "MEGAFLEET_PREFILL_GRAPHS": "false"},
            {"cuda_graphs": False, "fused_kernels": "all", "prefill_graphs": False},
        ),
    ],
    ids=["defaults", "gemv-prefill", "no-graphs"],
)
def test_the_megatron_settings_reach_its_engine_options(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, str], expected: dict[str, object]
) -> None:
    """What ``spec.engine.env`` sets is what megatron's engine is built with (no GPU: the load is
    recorded, not run)."""
    loads: list[dict[str, object]] = []
    monkeypatch.setattr(backends, "load_backend", lambda *args, **kwargs: loads.append(kwargs))
    read = settings.from_env({"MEGAFLEET_MODEL_SOURCE": "tiny://llama", "MEGAFLEET_BACKEND": "megatron"} | extra)
    cli._load_backend(read, 0, 0, device="cpu", deferred=False)
    options = loads[0]["options"]
    assert {name: getattr(options, name) for name in expected} == expected


def test_frontend_ranks_follow_megatron_order() -> None:
    read = settings.Settings(model_source="x", world_size=8, tensor_parallel=2, pipeline_parallel=2)
    assert [rank for rank in range(8) if read.is_frontend_rank(rank)] == [0, 2]


INVALID = [
    ("MEGAFLEET_MAX_SEQUENCE_LENGTH", "lots", "must be an integer"),
    ("MEGAFLEET_MAX_BATCH_SIZE", "0", "at least 1"),
    ("MEGAFLEET_BACKEND", "vllm", "one of transformers, megatron"),
    ("MEGAFLEET_DTYPE", "int8", "one of"),
    ("MEGAFLEET_WEIGHTS_INITIAL", "lazy", "checkpoint, refit"),
    ("MEGAFLEET_KV_CACHE_MODE", "drop", "persist, offload, recompute"),
    ("MEGAFLEET_FRONTEND_PORT", "70000", "TCP port"),
    ("MEGAFLEET_AGENT_PORT", "8000", "must differ"),
    ("MEGAFLEET_WORLD_SIZE", "3", "not a multiple"),
    ("MEGAFLEET_RANK", "2", "exceeds"),
    ("MEGAFLEET_HOST", "engine.local", "IP address"),
    ("MEGAFLEET_LOCAL_GPUS", "-1", "at least 0"),
    ("MEGAFLEET_CUDA_GRAPHS", "yes", "one of true, false"),
    ("MEGAFLEET_FUSED_KERNELS", "triton", "one of rope-swiglu, off, gemv, all"),
    ("MEGAFLEET_PREFILL_GRAPHS", "on", "one of true, false"),
    ("MEGAFLEET_KV_CACHE_GIB", "0", "at least 1"),
    ("MEGAFLEET_REFIT_STAGING", "on", "one of off, auto, required"),
    ("MEGAFLEET_REFIT_STAGING_HEADROOM_MIB", "-1", "at least 0"),
    ("MEGAFLEET_LOCAL_RANKS", "3", "exceeds"),
    ("MEGAFLEET_REFIT_WAIT_SECONDS", "-5", "at least 0, got -5"),
    ("MEGAFLEET_REFIT_WAIT_SECONDS", "86401", "at most 86400"),
    ("MEGAFLEET_KV_CACHE_GIB", "1" + "0" * 400, "at most 65536"),
    ("MEGAFLEET_API_SERVERS", "257", "at most 256"),
    ("MEGAFLEET_FUSED_KERNELS", "rm -rf /", "one of rope-swiglu, off, gemv, all, got 'rm -rf /'"),
    ("MEGAFLEET_KV_CACHE_GIB", "x" * 5000, "must be an integer, got 'xxx"),
    ("MEGAFLEET_FRONTEND_MAX_CONNECTIONS", "0", "at least 1"),
    ("MEGAFLEET_AGENT_MAX_CONNECTIONS", "-5", "at least 1"),
    ("MEGAFLEET_HTTP_HEADER_TIMEOUT_SECONDS", "0", "at least 1"),
    ("MEGAFLEET_HTTP_STALL_TIMEOUT_SECONDS", "1.5", "must be an integer"),
    ("MEGAFLEET_HTTP_KEEP_ALIVE_SECONDS", "0", "at least 1"),
    ("MEGAFLEET_HTTP_MAX_BODY_MIB", "0", "at least 1"),
]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"MEGAFLEET_LOCAL_GPUS": "2", "MEGAFLEET_LOCAL_RANKS": "1"}, "must equal MEGAFLEET_LOCAL_GPUS"),
        ({"MEGAFLEET_LOCAL_RANKS": "2", "MEGAFLEET_AGENT_PORT": "0"}, "AGENT_PORT must be set"),
        ({"MEGAFLEET_LOCAL_GPUS": "2", "MEGAFLEET_FRONTEND_PORT": "8472"}, "8471 to 8472"),
    ],
)
def test_a_pod_of_several_ranks_needs_room_for_each_ranks_agent(extra: dict[str, str], message: str) -> None:
    env = {"MEGAFLEET_MODEL_SOURCE": "tiny://llama", "MEGAFLEET_TENSOR_PARALLEL": "2", "MEGAFLEET_WORLD_SIZE": "2"}
    with pytest.raises(settings.SettingsError, match=message):
        settings.from_env(env | extra)
    assert settings.from_env(env | {"MEGAFLEET_LOCAL_RANKS": "2"}).local_ranks == 2


@pytest.mark.parametrize(("name", "value", "message"), INVALID, ids=[f"{name}={value}" for name, value, _ in INVALID])
def test_invalid_values_name_the_variable(name: str, value: str, message: str) -> None:
    env = {"MEGAFLEET_MODEL_SOURCE": "tiny://llama", "MEGAFLEET_TENSOR_PARALLEL": "2", "MEGAFLEET_WORLD_SIZE": "2"}
    env[name] = value
    with pytest.raises(settings.SettingsError, match=message) as raised:
        settings.from_env(env)
    assert name.removeprefix("MEGAFLEET_") in str(raised.value)


def test_api_key_from_the_environment_is_read_and_never_shown() -> None:
    read = settings.from_env({"MEGAFLEET_MODEL_SOURCE": "tiny://llama", "MEGAFLEET_API_KEY": "sk-secret"})
    assert read.api_key == "sk-secret"
    assert "sk-secret" not in repr(read)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"MEGAFLEET_API_KEY": "  "}, "MEGAFLEET_API_KEY is set but empty"),
        ({"MEGAFLEET_API_KEY": "k", "MEGAFLEET_API_KEY_FILE": "/k"}, "not both"),
    ],
    ids=["empty-key", "key-and-file"],
)
def test_api_key_mistakes_never_mean_no_key(extra: dict[str, str], message: str) -> None:
    with pytest.raises(settings.SettingsError, match=message):
        settings.from_env({"MEGAFLEET_MODEL_SOURCE": "tiny://llama", **extra})


def test_model_source_is_required() -> None:
    with pytest.raises(settings.SettingsError, match="MEGAFLEET_MODEL_SOURCE is required"):
        settings.from_env({})


def test_settings_are_frozen() -> None:
    read = settings.from_env({"MEGAFLEET_MODEL_SOURCE": "tiny://llama"})
    with pytest.raises(AttributeError):
        read.host = "0.0.0.0"  # type: ignore[misc]


@pytest.mark.parametrize(("cpus", "servers"), [(0.5, 1), (2, 1), (7.9, 1), (8, 2), (16, 4), (64, 8), (200, 8)])
def test_the_default_api_servers_follow_the_pods_cpus(cpus: float, servers: int) -> None:
    assert settings.default_api_servers(cpus) == servers


def test_usable_cpus_read_the_cgroup_quota(tmp_path: Path) -> None:
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert settings.usable_cpus(quota) == min(1.5, len(os.sched_getaffinity(0)))
    quota.write_text("max 100000\n")
    assert settings.usable_cpus(quota) == len(os.sched_getaffinity(0))
    assert settings.usable_cpus(tmp_path / "absent") == len(os.sched_getaffinity(0))


def test_api_servers_zero_serves_in_process_and_negative_is_refused() -> None:
    assert settings.from_env({"MEGAFLEET_MODEL_SOURCE": "x", "MEGAFLEET_API_SERVERS": "0"}).api_server_count == 0
    with pytest.raises(settings.SettingsError, match="MEGAFLEET_API_SERVERS must be at least 0"):
        settings.from_env({"MEGAFLEET_MODEL_SOURCE": "x", "MEGAFLEET_API_SERVERS": "-1"})


def test_a_refused_value_is_shown_cut_so_every_message_stays_short() -> None:
    with pytest.raises(settings.SettingsError) as raised:
        settings.from_env({"MEGAFLEET_MODEL_SOURCE": "x", "MEGAFLEET_FUSED_KERNELS": "y" * 32768})
    assert len(str(raised.value)) < 200 and str(raised.value).endswith("...")


def test_the_http_limits_default_as_documented_and_follow_their_variables() -> None:
    """The frontend's limits bound each API-server process; the agent's bound the agent and the
    metrics server; the timeouts and the body limit are shared."""
    defaults = settings.from_env({"MEGAFLEET_MODEL_SOURCE": "x"}).http_bounds
    assert defaults == http_limits.DEFAULTS
    assert defaults.frontend == http_limits.HttpLimits(4096, 10, 60, 75, 64 * 2**20)
    assert defaults.agent == http_limits.HttpLimits(64, 10, 60, 75, 64 * 2**20)
    env = {
        "MEGAFLEET_MODEL_SOURCE": "x",
        "MEGAFLEET_FRONTEND_MAX_CONNECTIONS": "100",
        "MEGAFLEET_AGENT_MAX_CONNECTIONS": "8",
        "MEGAFLEET_HTTP_HEADER_TIMEOUT_SECONDS": "2",
        "MEGAFLEET_HTTP_MAX_BODY_MIB": "1",
    }
    bounds = settings.from_env(env).http_bounds
    assert bounds.frontend == http_limits.HttpLimits(100, 2, 60, 75, 2**20)
    assert bounds.agent == http_limits.HttpLimits(8, 2, 60, 75, 2**20)
