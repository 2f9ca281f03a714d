"""The NeMo RL adapter against NeMo RL's contract, without NeMo RL, engines or a control plane.

A stand-in fleet (:class:`FakeFleet`, a :class:`megafleet.sdk.fleet.Fleet` whose API calls are
answered in memory) and an OpenAI frontend on ``httpx.MockTransport`` (it records every request
body) are injected where the adapter makes its clients. Covered: the method surface of NeMo RL's
``GenerationInterface`` and ``MegatronGeneration`` (transcribed below from their signatures),
refit versions in NeMo RL's three call orders, right-padding errors naming the sample, length limits
as vLLM's, ``bad_words``/``ignore_eos``, ``invalidate_kv_cache`` per KV cache mode, and pickling to a
light handle that reconnects lazily and serves many event loops on many threads.
"""

# ruff: noqa: E501  (NeMo RL's signatures are transcribed one per line, as they read)
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import pickle
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from helpers import kube_fakes
from megafleet.api import v1alpha1
from megafleet.sdk import errors, fleet, generation, nemo, routing
from megafleet.sdk.nemo import clients as nemo_clients
from megafleet_protocol import vocabulary

MODEL = "tiny"
LIMIT = 64
URL = "http://fake-frontend/v1"

# -- NeMo RL's surfaces, transcribed from their signatures (research notes A.1-A.4) ---------------

GENERATION_INTERFACE_MAIN = """
def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[ray.ObjectRef]: ...
def generate(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool) -> BatchedDataDict[GenerationOutputSpec]: ...
def prepare_for_generation(self, *args, **kwargs) -> bool: ...
def finish_generation(self, *args, **kwargs) -> bool: ...
def shutdown(self) -> bool: ...
@property
def requires_kv_scale_sync(self) -> bool: ...
def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None: ...
def update_weights_via_ipc_zmq(self) -> list[ray.ObjectRef]: ...
def update_weights_from_collective(self) -> list[ray.ObjectRef]: ...
def get_collective_sender_spec(self) -> CollectiveSenderSpec: ...
def get_inference_world_size(self) -> int | None: ...
def prepare_nccl_reshard_refit_info(self, refit_info: dict) -> None: ...
def nccl_reshard_refit(self) -> list[ray.ObjectRef]: ...
def attach_fleet_health(self, monitor: Any, selector: Any) -> None: ...
def invalidate_kv_cache(self) -> bool: ...
def blocks_training(self) -> bool: ...
def wake_carries_weight_updates(self) -> bool: ...
def clear_logger_metrics(self) -> None: ...
def get_logger_metrics(self) -> dict[str, Any]: ...
def snapshot_step_metrics(self) -> None: ...
def get_step_metrics(self) -> dict[str, float]: ...
"""

GENERATION_INTERFACE_DEV = """
@classmethod
def validate_settings(cls, master_config: MasterConfig) -> None: ...
def pause_generation(self, mode: str) -> None: ...
def continue_generation(self) -> None: ...
def update_weights_from_collective(self, refit_timeout_s: Optional[float] = None) -> list[ray.ObjectRef]: ...
def get_refit_payload_mode(self) -> RefitPayloadMode: ...
def nccl_reshard_refit(self, refit_timeout_s: Optional[float] = None) -> list[ray.ObjectRef]: ...
def pause_generation_for_refit(self, *, clear_cache: bool) -> bool: ...
def resume_generation_after_refit(self) -> bool: ...
def pause_generation_for_checkpoint(self, *, timeout_s: Optional[float] = None) -> bool: ...
def resume_generation_after_checkpoint(self, *, timeout_s: Optional[float] = None) -> bool: ...
def resume_generation_after_cut(self, *, timeout_s: Optional[float] = None) -> bool: ...
def finish_generation_checkpoint(self, *, timeout_s: Optional[float] = None) -> bool: ...
def snapshot_step_metrics(self) -> None: ...
def get_step_metrics(self) -> dict[str, float]: ...
def drain_latest_logger_metrics(self) -> dict[str, Any]: ...
"""

MEGATRON_GENERATION_MAIN = """
@staticmethod
def effective_megatron_cfg(config: PolicyConfig) -> dict[str, Any]: ...
@classmethod
def nvlink_domain_span(cls, config: PolicyConfig) -> int: ...
@classmethod
def init_cluster_placement_groups(cls, cluster: RayVirtualCluster, config: PolicyConfig) -> None: ...
def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int, refit_backend: str = "gloo") -> list[ray.ObjectRef]: ...
def update_weights_from_collective(self) -> list[ray.ObjectRef]: ...
def generate(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False) -> BatchedDataDict[GenerationOutputSpec]: ...
async def generate_async(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False) -> AsyncGenerator[tuple[int, BatchedDataDict[GenerationOutputSpec]], None]: ...
def prepare_for_generation(self, *args, **kwargs) -> bool: ...
def finish_generation(self, *, release_gpu: bool = True) -> bool: ...
def blocks_training(self) -> bool: ...
def wake_carries_weight_updates(self) -> bool: ...
def invalidate_kv_cache(self) -> bool: ...
def preinit_nvshmem_collective(self) -> list[ray.ObjectRef]: ...
def suspend_for_refit(self) -> None: ...
def resume_after_refit(self) -> None: ...
def prepare_refit_info(self, state_dict_info: Optional[dict[str, Any]]) -> None: ...
def start_gpu_profiling(self) -> None: ...
def stop_gpu_profiling(self) -> None: ...
def shutdown(self) -> bool: ...
"""

MEGATRON_GENERATION_SEED = """
@staticmethod
def frontend_ranks(cluster: RayVirtualCluster, config: PolicyConfig) -> list[int]: ...
@classmethod
def reserve_http_server_addresses(cls, cluster: RayVirtualCluster, config: PolicyConfig) -> tuple[list[str], dict[int, int], list[ray.actor.ActorHandle]]: ...
@classmethod
def validate_settings(cls, master_config: MasterConfig) -> None: ...
@classmethod
def verify_served_addresses(cls, served_urls: list[Optional[str]], reserved_urls: list[str]) -> None: ...
@property
def uses_native_refit(self) -> bool: ...
def get_refit_payload_mode(self) -> RefitPayloadMode: ...
@property
def worker_group(self) -> RayWorkerGroup: ...
def shard_liveness_ref(self, shard_idx: int) -> ray.ObjectRef: ...
def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[ray.ObjectRef]: ...
def update_weights_from_collective(self, refit_timeout_s: Optional[float] = None) -> list[ray.ObjectRef]: ...
def init_nccl_reshard_comm_group(self, *, pp_ips: list[str], pp_ports: list[int], pp_size: int, train_ranks_per_stage: int, sub_world_size: int) -> list[ray.ObjectRef]: ...
def set_refit_membership(self, membership: RefitMembership) -> None: ...
def rebuild_collective(self, membership: RefitMembership, ip: str, port: int) -> list[ray.ObjectRef]: ...
def rebuild_nccl_reshard_comm_group(self, membership: RefitMembership, *, pp_ips: list[str], pp_ports: list[int], pp_size: int, train_ranks_per_stage: int, sub_world_size: int) -> list[ray.ObjectRef]: ...
def prepare_nccl_reshard_refit_info(self, refit_info: dict[str, Any]) -> None: ...
def nccl_reshard_refit(self, refit_timeout_s: Optional[float] = None) -> list[ray.ObjectRef]: ...
def generate(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False) -> BatchedDataDict[GenerationOutputSpec]: ...
async def generate_async(self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False) -> AsyncGenerator[tuple[int, BatchedDataDict[GenerationOutputSpec]], None]: ...
def prepare_for_generation(self, *args, **kwargs) -> bool: ...
def finish_generation(self, *, release_gpu: bool = True) -> bool: ...
def setup_token_capture(self, dp_cfg: DataPlaneConfig, staging_partition: str, *, capture_media: bool = False) -> None: ...
def set_rollout_weight_version(self, version: int) -> None: ...
def blocks_training(self) -> bool: ...
def wake_carries_weight_updates(self) -> bool: ...
def invalidate_kv_cache(self) -> bool: ...
def preinit_nvshmem_collective(self) -> list[ray.ObjectRef]: ...
def suspend_for_refit(self) -> None: ...
def resume_after_refit(self) -> None: ...
def prepare_refit_info(self, state_dict_info: Optional[dict[str, Any]]) -> None: ...
def start_gpu_profiling(self) -> None: ...
def stop_gpu_profiling(self) -> None: ...
def shutdown(self) -> bool: ...
"""

SURFACES = {
    "GenerationInterface (main)": GENERATION_INTERFACE_MAIN,
    "GenerationInterface (development line)": GENERATION_INTERFACE_DEV,
    "MegatronGeneration (main)": MEGATRON_GENERATION_MAIN,
    "MegatronGeneration (seed)": MEGATRON_GENERATION_SEED,
}

RETURNS = {
    # NeMo RL's return types -> the adapter's names for them (it imports neither ray nor NeMo RL)
    "list[ray.ObjectRef]": "ObjectRefs",
    "ray.ObjectRef": "ObjectRef",
    "BatchedDataDict[GenerationOutputSpec]": "Any",
    "AsyncGenerator[tuple[int, BatchedDataDict[GenerationOutputSpec]], None]": "AsyncIterator[tuple[int, Any]]",
    "RayWorkerGroup": "Any",
    "tuple[list[str], dict[int, int], list[ray.actor.ActorHandle]]": "tuple[list[str], dict[int, int], list[Any]]",
}

DEFAULT_DEVIATIONS = {
    # (method, parameter): why the adapter's default differs from NeMo RL's
    ("init_collective", "refit_backend"): "None keeps the adapter's own backend (MegatronGeneration's is 'gloo')",
}


def expected_methods() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for surface, source in SURFACES.items():
        for node in ast.parse(source).body:
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            yield surface, node


def kind_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    names = {decorator.id for decorator in node.decorator_list if isinstance(decorator, ast.Name)}
    return next((name for name in ("property", "classmethod", "staticmethod") if name in names), "method")


def expected_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, inspect._ParameterKind, Any]]:
    """(name, kind, default or inspect.Parameter.empty) of every parameter but self/cls."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults: list[Any] = [inspect.Parameter.empty] * (len(positional) - len(args.defaults))
    defaults += [ast.literal_eval(default) for default in args.defaults]
    found: list[tuple[str, inspect._ParameterKind, Any]] = [
        (arg.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default)
        for arg, default in zip(positional, defaults, strict=True)
    ]
    if args.vararg is not None:
        found.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        value = inspect.Parameter.empty if kw_default is None else ast.literal_eval(kw_default)
        found.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, value))
    if args.kwarg is not None:
        found.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return [entry for entry in found if entry[0] not in ("self", "cls")]


def normalised(annotation: str) -> str:
    text = ast.unparse(ast.parse(annotation, mode="eval"))
    text = re.sub(r"\b(?:refs|refit_wires|config_)\.", "", text)  # the adapter's modules qualify its type names
    text = RETURNS.get(text, text)
    if text.startswith("Optional[") and text.endswith("]"):
        text = f"{text[len('Optional[') : -1]} | None"
    return text


def surface_gaps(cls: type) -> list[str]:
    gaps = []
    for surface, node in expected_methods():
        name = node.name
        where = f"{surface}.{name}"
        try:
            static = inspect.getattr_static(cls, name)
        except AttributeError:
            gaps.append(f"{where}: missing")
            continue
        ours = (
            "property"
            if isinstance(static, property)
            else "classmethod"
            if isinstance(static, classmethod)
            else "staticmethod"
            if isinstance(static, staticmethod)
            else "method"
        )
        if ours != kind_of(node):
            gaps.append(f"{where}: a {ours}, NeMo RL's is a {kind_of(node)}")
            continue
        function: Any = static.fget if isinstance(static, property) else getattr(cls, name)
        if isinstance(node, ast.AsyncFunctionDef) != (
            inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
        ):
            gaps.append(f"{where}: async differs")
        signature = inspect.signature(function)
        theirs_return = normalised(ast.unparse(node.returns)) if node.returns is not None else "None"
        if signature.return_annotation is inspect.Signature.empty:
            gaps.append(f"{where}: no return annotation (NeMo RL: {theirs_return})")
        elif normalised(str(signature.return_annotation)) != theirs_return:
            gaps.append(f"{where}: returns {signature.return_annotation}, NeMo RL's {theirs_return}")
        parameters = {p.name: p for p in signature.parameters.values() if p.name not in ("self", "cls")}
        expected = expected_parameters(node)
        for param_name, kind, default in expected:
            mine = parameters.get(param_name)
            if mine is None:
                gaps.append(f"{where}: parameter {param_name} missing")
                continue
            if mine.kind != kind:
                gaps.append(f"{where}: {param_name} is {mine.kind.description}, NeMo RL's {kind.description}")
            widened = default is inspect.Parameter.empty  # a default where NeMo RL has none binds every call too
            if mine.default != default and not widened and (name, param_name) not in DEFAULT_DEVIATIONS:
                gaps.append(f"{where}: {param_name} defaults to {mine.default!r}, NeMo RL's to {default!r}")
        names = {entry[0] for entry in expected}
        for extra in parameters.values():
            optional = extra.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            if extra.name not in names and not optional and extra.default is inspect.Parameter.empty:
                gaps.append(f"{where}: extra required parameter {extra.name}")
    return gaps


def test_every_method_of_nemo_rls_generation_interface_and_megatron_generation_exists_with_its_signature() -> None:
    assert surface_gaps(nemo.MegafleetGeneration) == []


def test_the_surface_walk_finds_gaps() -> None:
    class Partial:
        def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int) -> list[Any]:
            return []

    gaps = surface_gaps(Partial)
    assert "GenerationInterface (main).generate: missing" in gaps
    assert any("init_collective: train_world_size is positional or keyword" in gap for gap in gaps)
    assert any("init_collective: parameter refit_backend missing" in gap for gap in gaps)
    assert any("init_collective: returns list[Any]" in gap for gap in gaps)


# -- stand-ins: a fleet answered in memory, a frontend on MockTransport ------------------------------


class Frontend:
    """An OpenAI completions endpoint: generates token 7 up to ``max_tokens`` or the limit."""

    def __init__(self, weight_version: list[int | None]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.models_requests = 0
        self.weight_version = weight_version
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.endswith("/models"):
            self.models_requests += 1
            return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": LIMIT}]})
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
        batched = bool(body["prompt"]) and isinstance(body["prompt"][0], list)
        prompts = body["prompt"] if batched else [body["prompt"]]
        too_long = any(len(prompt) + body["max_tokens"] > LIMIT for prompt in prompts)
        if too_long:  # the engine's 400 for plain OpenAI clients
            return httpx.Response(400, json={"error": {"message": "too long", "code": "context_length_exceeded"}})
        tokens = [7] * body["max_tokens"]
        version = self.weight_version[0]
        choices = [
            {
                "index": index,
                "text": "",
                "token_ids": tokens,
                "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                "finish_reason": "length",
            }
            for index in range(len(prompts))
        ]
        return httpx.Response(200, json={"choices": choices, "weight_version": version})


class FakeFleet(fleet.Fleet):
    """The fleet client with the API server answered in memory; records the refits asked for."""

    def __init__(self, frontend: Frontend, *, current: int | None, kv_cache_mode: str = "persist") -> None:
        super().__init__(
            MODEL,
            "ns",
            client=kube_fakes.Api(),  # never asked: this fleet's state is made up below
            http=httpx.AsyncClient(transport=httpx.MockTransport(frontend)),
        )
        self.current = current
        self.kv_cache_mode = kv_cache_mode
        self.refits: list[int] = []
        self.frontend = frontend

    async def get(self) -> fleet.FleetState:
        obj = {
            "metadata": {"name": MODEL, "namespace": "ns", "generation": 1},
            "spec": {
                "model": {"source": "tiny://llama", "maxSequenceLength": LIMIT},
                "engine": {"backend": "transformers", "kvCacheMode": self.kv_cache_mode},
                "resources": {"gpusPerNode": 0},
            },
            "status": {
                "observedGeneration": 1,
                "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": ""}],
                "shards": [{"index": 0, "phase": "Ready", "weightVersion": self.current}],
                "refit": {"currentVersion": self.current},
            },
        }
        return self._state(obj)

    async def wait_ready(self, timeout: float = 0) -> fleet.FleetState:
        state = await self.get()
        await self._route(state)
        return state

    async def _route(self, state: fleet.FleetState) -> list[routing.Frontend]:
        frontends = [routing.Frontend(0, URL, self.current)]
        self.router.update(frontends)
        return frontends

    async def refit(self, version: int, **options: Any) -> fleet.RefitResult:
        self.refits.append(version)
        self.current = version
        self.frontend.weight_version[0] = version
        return fleet.RefitResult(f"{MODEL}-v{version}", version, v1alpha1.RefitObjectStatus(), (0,))


@pytest.fixture
def frontend() -> Frontend:
    return Frontend([0])


def install(monkeypatch: pytest.MonkeyPatch, frontend: Frontend, made: list[FakeFleet], **fleet_options: Any) -> None:
    """Every adapter (and unpickled copy) made from here connects to ``frontend`` (through a fake fleet
    unless it has fixed frontends)."""

    async def make_clients(handle: nemo.Handle) -> tuple[fleet.Fleet | None, generation.Generator, None]:
        if handle.frontends is not None:
            router = routing.Router([routing.Frontend(i, url, None) for i, url in enumerate(handle.frontends)])
            http = httpx.AsyncClient(transport=httpx.MockTransport(frontend))
            found_generator = generation.Generator(
                router, model=handle.model or MODEL, http=http, max_sequence_length=handle.max_sequence_length
            )
            return None, found_generator, None
        found = FakeFleet(frontend, **fleet_options)
        made.append(found)
        return found, found.generator, None  # refit_wire="nemo" is covered by tests/unit/test_nemo_wire.py

    monkeypatch.setattr(nemo_clients, "make_clients", make_clients)


def one_row(prompt: list[int]) -> dict[str, Any]:
    return {"input_ids": torch.tensor([prompt]), "input_lengths": torch.tensor([len(prompt)]), "stop_strings": [None]}


def adapter(**options: Any) -> nemo.MegafleetGeneration:
    config = {"max_new_tokens": LIMIT, "temperature": 1.0, "_pad_token_id": 0, **options.pop("config", {})}
    return nemo.MegafleetGeneration(MODEL, "ns", config=config, weights=lambda: iter(()), **options)


# -- point 1: return types, cfg and refusals --------------------------------------------------------


def test_object_ref_methods_return_plain_booleans_without_ray(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    made: list[FakeFleet] = []
    install(monkeypatch, frontend, made, current=0)
    generation_ = adapter()
    try:
        futures_train: list[Any] = [True]
        assert futures_train + generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=2) == [True, True]
        assert generation_.update_weights_from_collective() == [True]
        assert generation_.shard_liveness_ref(0) is True and generation_.shard_liveness_ref(5) is False
    finally:
        generation_.shutdown()


def test_cfg_reads_as_an_async_megatron_backend_and_unsupported_paths_refuse_loudly(frontend: Frontend) -> None:
    generation_ = nemo.MegafleetGeneration(
        MODEL,
        frontends=[URL],
        config={"backend": "vllm", "max_new_tokens": 4, "vllm_cfg": {"max_model_len": 4096, "async_engine": True}},
        kv_cache_mode="recompute",
    )
    assert generation_.cfg["backend"] == "megatron" and generation_.cfg["colocated"]["enabled"] is False
    assert generation_.cfg["mcore_generation_config"]["kv_cache_management_mode"] == "recompute"
    assert "vllm_cfg" not in generation_.cfg  # NeMo Gym's rollouts would read its max_model_len first
    assert generation_.weight_synchronizer is None and generation_.dp_openai_server_base_urls == [URL]
    assert generation_.blocks_training() is False and generation_.wake_carries_weight_updates() is False
    assert generation_.get_collective_sender_spec().nccl_peer == "nemo"
    generation_.prepare_refit_info(None)  # MegatronGeneration's call: accepted
    assert generation_.get_step_metrics() == {
        "megafleet/requests": 0.0,
        "megafleet/generated_tokens": 0.0,
        "megafleet/truncated": 0.0,
        "megafleet/samples_spanning_refit": 0.0,
        "megafleet/tokens_older_than_latest": 0.0,
    }
    with pytest.raises(NotImplementedError, match="CUDA IPC"):
        generation_.update_weights_via_ipc_zmq()
    with pytest.raises(NotImplementedError, match="nccl_reshard"):
        generation_.nccl_reshard_refit()
    with pytest.raises(NotImplementedError, match="nccl_reshard"):
        generation_.init_nccl_reshard_comm_group(
            pp_ips=["a"], pp_ports=[1], pp_size=1, train_ranks_per_stage=2, sub_world_size=4
        )
    with pytest.raises(NotImplementedError, match="nccl_m2n"):
        generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1, refit_backend="nccl_m2n")
    with pytest.raises(NotImplementedError, match="colocated"):
        nemo.nemo_factory(MODEL)(config={"generation": {}}, policy=object())
    with pytest.raises(NotImplementedError, match="colocated"):
        nemo.MegafleetGeneration.validate_settings({"policy": {"generation": {"colocated": {"enabled": True}}}})
    with pytest.raises(RuntimeError, match="different addresses"):
        nemo.MegafleetGeneration.verify_served_addresses([URL, None], ["http://other/v1"])
    assert not generation_.connected  # nothing above needed the clients


def test_grpos_deferred_vllm_start_for_nemo_gym_lists_the_frontends_before_load_and_start(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    """GRPO with NeMo Gym: ``VllmGeneration(cluster=..., config=..., defer_model_load=True)``, then its
    ``dp_openai_server_base_urls`` go to NeMo Gym, then ``load_and_start()``."""
    install(monkeypatch, frontend, [], current=0)
    build = nemo.nemo_factory(MODEL, "ns")
    deferred = build(cluster=object(), config={"max_new_tokens": 4, "_pad_token_id": 0}, defer_model_load=True)
    try:
        assert deferred.dp_openai_server_base_urls == [URL]
        deferred.load_and_start()
        assert deferred.finish_generation()
        out = deferred.generate(one_row([1, 2, 3]))
    finally:
        deferred.shutdown()
    assert out["generation_lengths"].tolist() == [4]


RESHARD_CALLS = {
    "init_nccl_reshard_comm_group": lambda g: g.init_nccl_reshard_comm_group(
        pp_ips=["a"], pp_ports=[1], pp_size=1, train_ranks_per_stage=2, sub_world_size=4
    ),
    "rebuild_nccl_reshard_comm_group": lambda g: g.rebuild_nccl_reshard_comm_group(
        object(), pp_ips=["a"], pp_ports=[1], pp_size=1, train_ranks_per_stage=2, sub_world_size=4
    ),
    "nccl_reshard_refit": lambda g: g.nccl_reshard_refit(refit_timeout_s=5.0),
}


@pytest.mark.parametrize("call", sorted(RESHARD_CALLS))
def test_the_seeds_nccl_reshard_calls_need_nemos_own_wire_and_refuse_before_connecting(call: str) -> None:
    """The reshard is the trainer's own wire: an adapter that sends itself (fixed frontends, the
    megafleet wire) refuses it, naming the wire to use (tests/sdk/test_nemo_reshard_sdk.py runs it)."""
    generation_ = nemo.MegafleetGeneration(MODEL, frontends=[URL])
    with pytest.raises(NotImplementedError) as refused:
        RESHARD_CALLS[call](generation_)
    message = str(refused.value)
    assert "nccl_reshard" in message and "refit_wire='nemo'" in message
    assert not generation_.connected


# -- point 4: versions never go backwards, whatever NeMo RL's call order -----------------------------


def refit_versions(monkeypatch: pytest.MonkeyPatch, frontend: Frontend, calls: str, current: int = 7) -> list[int]:
    made: list[FakeFleet] = []
    install(monkeypatch, frontend, made, current=current)
    generation_ = adapter()
    try:
        generation_.prepare_for_generation()
        for call in calls.split():
            name, _, argument = call.partition(":")
            if name == "init":
                generation_.init_collective("10.0.0.1", 29500, 3, train_world_size=1, refit_backend="gloo")
            elif name == "info":
                generation_.prepare_refit_info({})
            elif name == "update":
                generation_.update_weights_from_collective()
            elif name == "suspend":
                generation_.suspend_for_refit()
            elif name == "resume":
                generation_.resume_after_refit()
            elif name == "prepare":
                generation_.prepare_for_generation(tags=[argument])
            elif name == "trainer":
                generation_.set_rollout_weight_version(int(argument))
            elif name == "elsewhere":  # another client refits the fleet behind the adapter's back
                made[0].current = int(argument)
            else:
                raise AssertionError(name)
        return made[0].refits
    finally:
        generation_.shutdown()


MEGATRON_REFIT = "suspend prepare:weights update prepare:kv_cache resume"


@pytest.mark.parametrize(
    ("calls", "versions"),
    [
        ("init info update update update", [8, 9, 10]),  # vLLM's legacy order (B.2)
        (f"init update {MEGATRON_REFIT} {MEGATRON_REFIT}", [8, 9, 10]),  # MegatronWeightSynchronizer's (B.1)
        ("init resume prepare:kv_cache update", [8]),  # a resume without a refit bumps nothing
        (f"init update trainer:20 {MEGATRON_REFIT} update trainer:5 update", [8, 20, 21, 22]),  # async GRPO (B.3)
        ("init update elsewhere:30 update", [8, 31]),
    ],
    ids=["vllm-order", "megatron-order", "no-refit-no-bump", "async-trainer-versions", "fleet-moved-on"],
)
def test_a_refit_targets_the_fleets_current_version_plus_one_or_the_trainers_if_larger(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend, calls: str, versions: list[int]
) -> None:
    assert refit_versions(monkeypatch, frontend, calls) == versions


# -- point 3: length limits as vLLM's -------------------------------------------------------------


def test_prompt_plus_max_new_tokens_over_the_limit_stops_at_the_limit_as_truncated(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    made: list[FakeFleet] = []
    install(monkeypatch, frontend, made, current=0)
    generation_ = adapter()
    prompt = list(range(1, 61))
    try:
        out = generation_.generate(one_row(prompt))
    finally:
        generation_.shutdown()
    assert frontend.bodies[0]["max_tokens"] == LIMIT - 60
    assert out["generation_lengths"].tolist() == [4] and out["truncated"].tolist() == [True]
    assert out["unpadded_sequence_lengths"].tolist() == [LIMIT]
    assert (out["logprobs"][0, :60] == 0).all() and (out["logprobs"][0, 60:64] != 0).all()


@pytest.mark.parametrize("length", [LIMIT, LIMIT + 1])
def test_a_prompt_with_no_room_left_is_refused_naming_the_sample_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend, length: int
) -> None:
    made: list[FakeFleet] = []
    install(monkeypatch, frontend, made, current=0)
    generation_ = adapter()
    width = length
    data = {
        "input_ids": torch.tensor([[1, 2, 3] + [0] * (width - 3), list(range(1, width + 1))]),
        "input_lengths": torch.tensor([3, length]),
    }
    try:
        with pytest.raises(
            ValueError, match=f"the prompt at index 1 is {length} tokens.*maximum sequence length is 64"
        ):
            generation_.generate(data)
    finally:
        generation_.shutdown()
    assert frontend.bodies == []


def test_with_fixed_frontends_the_limit_comes_from_v1_models_once(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    install(monkeypatch, frontend, [])
    generation_ = adapter(frontends=[URL])
    try:
        generation_.generate(one_row(list(range(1, 61))))
        generation_.generate(one_row(list(range(1, 11))))
    finally:
        generation_.shutdown()
    assert [body["max_tokens"] for body in frontend.bodies] == [4, LIMIT - 10]
    assert frontend.models_requests == 1


def test_a_batch_is_one_token_ids_only_request_per_frontend_and_stop_strings_split_it(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    install(monkeypatch, frontend, [])
    generation_ = adapter(frontends=[URL], config={"max_new_tokens": 4})
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
    data = {
        "input_ids": torch.tensor([prompt + [0] * (3 - len(prompt)) for prompt in prompts]),
        "input_lengths": torch.tensor([len(prompt) for prompt in prompts]),
        "stop_strings": [None, ["</answer>"], None, None],
    }
    try:
        out = generation_.generate(data)
    finally:
        generation_.shutdown()
    assert [body["prompt"] for body in frontend.bodies] == [[[1, 2, 3], [6], [7, 8, 9]], [[4, 5]]]
    assert [body.get("detokenize") for body in frontend.bodies] == [False, None]  # text only for stop strings
    assert frontend.bodies[1]["stop"] == ["</answer>"]
    assert out["generation_lengths"].tolist() == [4, 4, 4, 4]
    assert out["output_ids"][1, :6].tolist() == [4, 5, 7, 7, 7, 7]  # right-padded, in sample order


# -- point 8: bad input, bad_words, ignore_eos, invalidate_kv_cache ---------------------------------


@pytest.mark.parametrize(
    ("input_ids", "input_lengths", "message"),
    [
        (
            [[0, 0, 5, 6], [7, 8, 9, 0]],
            [2, 3],
            r"Non-padding values found after specified length at index 0: positions \[2, 3\]",
        ),
        ([[5, 6, 0, 0], [7, 8, 9, 1]], [2, 5], "Length 5 at index 1 exceeds tensor sequence dimension 4"),
        (
            [[5, 6, 0, 0], [7, 8, 9, 1]],
            [2, 4, 1],
            r"Mismatch between tensor batch size \(2\) and lengths tensor size \(3\)",
        ),
        ([[5, 6, 0, 0], [7, 8, 9, 1]], [2, -1], "Length -1 at index 1"),
        ([5, 6, 0, 0], [2], r"Expected 2D tensor for padding check, got shape \(4,\)"),
    ],
    ids=["left-padded", "too-long", "wrong-count", "negative", "one-dimensional"],
)
def test_bad_padding_or_lengths_are_refused_naming_the_sample_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend, input_ids: Any, input_lengths: Any, message: str
) -> None:
    install(monkeypatch, frontend, [])
    generation_ = adapter(frontends=[URL])
    data = {"input_ids": torch.tensor(input_ids), "input_lengths": torch.tensor(input_lengths)}
    try:
        with pytest.raises(ValueError, match=message):
            generation_.generate(data)
    finally:
        generation_.shutdown()
    assert frontend.bodies == []


def test_ignore_eos_is_sent_and_bad_words_are_refused(monkeypatch: pytest.MonkeyPatch, frontend: Frontend) -> None:
    install(monkeypatch, frontend, [])
    generation_ = adapter(frontends=[URL], config={"ignore_eos": True})
    try:
        generation_.generate(one_row([1, 2, 3]))
    finally:
        generation_.shutdown()
    assert frontend.bodies[0]["ignore_eos"] is True
    with pytest.raises(NotImplementedError, match="bad_words"):
        adapter(frontends=[URL], config={"bad_words": ["forbidden"]})


@pytest.mark.parametrize(("mode", "invalidated"), [("persist", False), ("offload", False), ("recompute", True)])
def test_invalidate_kv_cache_is_true_only_when_the_fleet_recomputes_it(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend, mode: vocabulary.KvCacheMode, invalidated: bool
) -> None:
    install(monkeypatch, frontend, [], current=0, kv_cache_mode=mode)
    generation_ = adapter()
    try:
        assert generation_.invalidate_kv_cache() is invalidated
    finally:
        generation_.shutdown()
    fixed = adapter(frontends=[URL], kv_cache_mode=mode)
    assert fixed.invalidate_kv_cache() is invalidated
    assert adapter(frontends=[URL]).invalidate_kv_cache() is False  # unknown: no promise


# -- point 6: pickling to a light handle, many event loops on many threads --------------------------


def test_the_adapter_pickles_to_its_configuration_and_the_copy_reconnects_on_first_use(
    monkeypatch: pytest.MonkeyPatch, frontend: Frontend
) -> None:
    made: list[FakeFleet] = []
    install(monkeypatch, frontend, made, current=3)
    frontend.weight_version[0] = 3
    original = adapter(kubeconfig="/somewhere/kubeconfig")
    try:
        original.prepare_for_generation()
        original.generate(one_row([1, 2, 3]))
        data = pickle.dumps(original)
    finally:
        original.shutdown()
    assert len(data) < 4096, len(data)
    copy = pickle.loads(data)
    assert isinstance(copy, nemo.MegafleetGeneration) and not copy.connected and len(made) == 1
    assert copy.handle == original.handle and copy.handle.kubeconfig == "/somewhere/kubeconfig"
    results: dict[int, list[int]] = {}

    def collect(thread: int) -> None:
        async def run() -> list[int]:
            rows = [one_row([1, thread + 2, i + 2]) for i in range(4)]
            seen = []
            for row in rows:
                async for _, single in copy.generate_async(row):
                    seen.append(int(single["weight_versions"][0]))
            return seen

        results[thread] = asyncio.run(run())

    try:
        threads = [threading.Thread(target=collect, args=(index,)) for index in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        copy.shutdown()
    assert results == {index: [3, 3, 3, 3] for index in range(4)}
    assert len(made) == 2  # the copy made its own clients, once, for all four threads


def test_a_shut_down_adapter_refuses_to_reconnect(frontend: Frontend) -> None:
    generation_ = nemo.MegafleetGeneration(MODEL, frontends=[URL])
    assert generation_.shutdown() and generation_.shutdown()
    with pytest.raises(errors.FleetError, match="shut down"):
        generation_.generate(one_row([1, 2]))
