"""Cross-field validation of a fleet spec, in the spirit of NeMo RL's ``validate_settings``.

The reconcile flow calls :func:`validate` first. The CRD schema already
rejects what it can express at admission; this module checks the combinations it cannot and
returns every problem at once, each tied to the user-facing spec path and saying what to change.
A non-empty result means the operator sets ``InvalidSpec`` and creates nothing.
No rule guesses at engine limits beyond what NeMo RL's settings checks and megafleet's shard-to-pod
mapping require.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import get_args

from megafleet.planner import layout
from megafleet_protocol import vocabulary

__all__ = ["BACKENDS", "KV_CACHE_MODES", "REFIT_TRANSPORTS", "WEIGHT_SOURCES", "FleetSettings", "Problem", "validate"]

BACKENDS: tuple[vocabulary.BackendName, ...] = get_args(vocabulary.BackendName)
KV_CACHE_MODES: tuple[vocabulary.KvCacheMode, ...] = get_args(vocabulary.KvCacheMode)
WEIGHT_SOURCES: tuple[vocabulary.WeightsInitial, ...] = get_args(vocabulary.WeightsInitial)
REFIT_TRANSPORTS: tuple[vocabulary.Transport, ...] = get_args(vocabulary.Transport)

# Spec paths of the parallelism sizes, in the order problems are reported.
_SIZE_FIELDS: tuple[tuple[str, str], ...] = (
    ("tensor", "spec.parallelism.tensor"),
    ("pipeline", "spec.parallelism.pipeline"),
    ("context", "spec.parallelism.context"),
    ("expert", "spec.parallelism.expert"),
    ("expert_tensor", "spec.parallelism.expertTensor"),
)


@dataclasses.dataclass(frozen=True)
class FleetSettings:
    """The parts of a ``MegatronGeneration`` spec that validation looks at.

    Attributes:
        parallelism: ``spec.parallelism`` sizes of one shard.
        replicas: ``spec.replicas``, the number of shards; 0 means scaled to zero.
        gpus_per_node: ``spec.resources.gpusPerNode``; 0 means a CPU fleet.
        backend: ``spec.engine.backend``.
        kv_cache_mode: ``spec.engine.kvCacheMode``.
        cuda_graphs: ``spec.engine.cudaGraphs``.
        weights_initial: ``spec.weights.initial``; ``refit`` defers engine start to the first refit.
        refit_transport: ``spec.refit.transport``.
        checkpoint: ``spec.model.source``, a checkpoint path or URI, if any.
    """

    parallelism: layout.Parallelism
    replicas: int
    gpus_per_node: int
    backend: vocabulary.BackendName
    kv_cache_mode: vocabulary.KvCacheMode
    cuda_graphs: bool
    weights_initial: vocabulary.WeightsInitial
    refit_transport: vocabulary.Transport
    checkpoint: str | None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One inconsistency: the spec path to change and a message saying how."""

    field: str
    message: str


_Rule = Callable[[FleetSettings], Iterator[Problem]]


def _sizes_valid(settings: FleetSettings) -> bool:
    sizes = [getattr(settings.parallelism, name) for name, _ in _SIZE_FIELDS]
    return all(size >= 1 for size in sizes) and settings.gpus_per_node >= 0


def _check_sizes(settings: FleetSettings) -> Iterator[Problem]:
    for name, path in _SIZE_FIELDS:
        value = getattr(settings.parallelism, name)
        if value < 1:
            yield Problem(path, f"{path.rsplit('.', 1)[1]} = {value}; every parallel size must be at least 1")
    if settings.replicas < 0:
        yield Problem(
            "spec.replicas", f"replicas = {settings.replicas}; use 0 or more shards (0 scales the fleet to zero)"
        )
    if settings.gpus_per_node < 0:
        yield Problem(
            "spec.resources.gpusPerNode",
            f"gpusPerNode = {settings.gpus_per_node}; use the GPUs of one node, or 0 for a CPU fleet",
        )


def _check_choices(settings: FleetSettings) -> Iterator[Problem]:
    choices: tuple[tuple[str, str, tuple[str, ...]], ...] = (
        ("spec.engine.backend", settings.backend, BACKENDS),
        ("spec.engine.kvCacheMode", settings.kv_cache_mode, KV_CACHE_MODES),
        ("spec.weights.initial", settings.weights_initial, WEIGHT_SOURCES),
        ("spec.refit.transport", settings.refit_transport, REFIT_TRANSPORTS),
    )
    for path, value, allowed in choices:
        if value not in allowed:
            yield Problem(path, f"{value!r} is not one of {', '.join(allowed)}")


def _check_node_packing(settings: FleetSettings) -> Iterator[Problem]:
    size, per_node = settings.parallelism.shard_size, settings.gpus_per_node
    if per_node == 0 or not _sizes_valid(settings):
        return
    if (size <= per_node and per_node % size == 0) or size % per_node == 0:
        return
    shape = "does not fill whole nodes" if size > per_node else "does not pack evenly into nodes"
    yield Problem(
        "spec.parallelism.tensor",
        f"tensor x pipeline x context = {size} GPUs per shard {shape} of {per_node} GPUs; "
        f"choose a shard size that divides {per_node} or is a multiple of {per_node}",
    )


def _check_experts(settings: FleetSettings) -> Iterator[Problem]:
    par = settings.parallelism
    if not _sizes_valid(settings):
        return
    experts, dense = par.expert * par.expert_tensor, par.tensor * par.context
    if dense % experts == 0:
        return
    yield Problem(
        "spec.parallelism.expert",
        f"expert x expertTensor = {experts} does not divide tensor x context = {dense}; a shard is one "
        "data-parallel replica, and Megatron needs expertTensor x expert x expertData = tensor x context; "
        f"choose expert and expertTensor whose product divides {dense}",
    )


def _check_backend(settings: FleetSettings) -> Iterator[Problem]:
    par = settings.parallelism
    if settings.backend == "megatron":
        if settings.gpus_per_node == 0:
            yield Problem(
                "spec.engine.backend",
                "backend megatron needs GPUs but spec.resources.gpusPerNode is 0 (a CPU fleet); "
                "use backend transformers on CPU, or set gpusPerNode to the GPUs of one node",
            )
        if par.context > 1:
            yield Problem(
                "spec.parallelism.context",
                f"context = {par.context} is not supported by backend megatron: megatron-core's inference "
                "engine has no context parallelism (NeMo RL forces context = 1 for generation); set context to 1",
            )
    elif settings.backend == "transformers":
        for name, path in _SIZE_FIELDS:
            value = getattr(par, name)
            if value > 1:
                short = path.rsplit(".", 1)[1]
                yield Problem(
                    path,
                    f"{short} = {value}, but backend transformers runs each shard as one unsharded rank; "
                    f"set {short} to 1, or use backend megatron for model parallelism",
                )


def _check_cpu(settings: FleetSettings) -> Iterator[Problem]:
    if settings.gpus_per_node == 0 and settings.cuda_graphs:
        yield Problem(
            "spec.engine.cudaGraphs",
            "CUDA graphs need GPUs but spec.resources.gpusPerNode is 0 (a CPU fleet); set cudaGraphs to false",
        )


def _check_weights(settings: FleetSettings) -> Iterator[Problem]:
    if settings.weights_initial == "checkpoint" and not (settings.checkpoint or "").strip():
        yield Problem(
            "spec.model.source",
            "spec.weights.initial is checkpoint but no checkpoint source is set; set spec.model.source to a "
            "checkpoint path or URI, or set spec.weights.initial to refit to wait for the trainer's first refit",
        )


# Order of the rules is the order of the problems in the result.
_RULES: tuple[_Rule, ...] = (
    _check_sizes,
    _check_choices,
    _check_node_packing,
    _check_experts,
    _check_backend,
    _check_cpu,
    _check_weights,
)


def validate(settings: FleetSettings) -> list[Problem]:
    """Every inconsistency of ``settings``, one :class:`Problem` each, in a stable order.

    Problems come rule by rule: sizes, enumerated choices, node packing, expert sizes, backend,
    CPU fleet, refit transport, initial weights. Rules that compute with the parallel sizes are
    skipped while a size is below 1, so one bad size yields one problem.

    Returns:
        An empty list when the settings are valid.
    """
    return [problem for rule in _RULES for problem in rule(settings)]
