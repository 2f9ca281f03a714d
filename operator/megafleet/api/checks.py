"""Everything wrong with a raw MegatronGeneration spec, as the operator reports it in ``InvalidSpec``.

Called by the reconcile handlers before anything is created. Admission already rejects what the
CRD schema and its CEL rules express; this re-checks it (an object may predate a CRD upgrade) and
adds the planner's cross-field rules, so one call returns every problem with its field path.
"""

from __future__ import annotations

import decimal
import re
from typing import Any

import pydantic

from megafleet import names, planner
from megafleet.api import v1alpha1


def parse_spec(
    raw: dict[str, Any], *, name: str | None = None
) -> tuple[v1alpha1.MegatronGenerationSpec | None, list[planner.Problem]]:
    """The typed spec and every problem found; the spec is ``None`` when it does not even parse.
    With the fleet's ``name``, the names derived from it are checked too (:func:`name_problems`)."""
    try:
        spec = v1alpha1.MegatronGenerationSpec.model_validate(raw)
    except pydantic.ValidationError as error:
        return None, [_problem(item) for item in error.errors()]
    problems = planner.validate(fleet_settings(spec)) + pod_problems(spec)
    if name is not None:
        problems += name_problems(name, spec)
    return spec, problems


def name_problems(name: str, spec: v1alpha1.MegatronGenerationSpec) -> list[planner.Problem]:
    """The fleet's name against the rules the API server applies to the objects named after it:
    Service names are DNS-1035 labels, pod host names and label values at most 63 characters."""
    if not re.fullmatch(v1alpha1.DNS_1035_LABEL, name):
        return [planner.Problem("metadata.name", f"{name!r}: {v1alpha1.NAME_NOT_DNS_1035}")]
    last_shard = max(spec.replicas - 1, 0)
    derived = [names.shard_ranks_service(name, last_shard)]  # Secret and ConfigMap names may be longer (253)
    if not planner.validate(fleet_settings(spec)):  # the layout is known
        layout = planner.pod_layout(parallelism(spec.parallelism), spec.resources.gpus_per_node)
        derived.append(names.pod(name, last_shard, layout.pods_per_shard - 1))
    longest = max(derived, key=len)
    if len(longest) > v1alpha1.NAME_MAX:
        return [planner.Problem("metadata.name", f"{v1alpha1.NAME_TOO_LONG} ({longest!r} has {len(longest)})")]
    return []


def pod_problems(spec: v1alpha1.MegatronGenerationSpec) -> list[planner.Problem]:
    """The pod template's cross-field rule (also a CEL rule): /dev/shm is memory the pod's limit counts."""
    shm = spec.pod.shm_size
    if shm is not None and quantity(shm) > quantity(spec.resources.memory):
        message = f"{v1alpha1.SHM_OVER_MEMORY} ({shm} > {spec.resources.memory})"
        return [planner.Problem("spec.pod.shmSize", message)]
    return []


_SUFFIXES = {
    **{suffix: decimal.Decimal(1024) ** power for power, suffix in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: decimal.Decimal(1000) ** power for power, suffix in enumerate(("", "k", "M", "G", "T", "P", "E"))},
    "n": decimal.Decimal("1e-9"),
    "u": decimal.Decimal("1e-6"),
    "m": decimal.Decimal("1e-3"),
}


def quantity(text: str) -> decimal.Decimal:
    """The value of a Kubernetes quantity that matched the API's pattern (``64Gi``, ``500m``, ``1e3``)."""
    match = re.fullmatch(r"\+?([0-9.]+)([eE][-+]?[0-9]+|[A-Za-z]*)", text)
    if match is None:
        raise ValueError(f"not a quantity: {text!r}")
    number, suffix = match.groups()
    if suffix[:1] in ("e", "E"):
        return decimal.Decimal(number + suffix)
    return decimal.Decimal(number) * _SUFFIXES[suffix]


def fleet_settings(spec: v1alpha1.MegatronGenerationSpec) -> planner.FleetSettings:
    """The planner's view of a spec."""
    gpus = spec.resources.gpus_per_node
    return planner.FleetSettings(
        parallelism=parallelism(spec.parallelism),
        replicas=spec.replicas,
        gpus_per_node=gpus,
        backend=spec.engine.backend,
        kv_cache_mode=spec.engine.kv_cache_mode,
        cuda_graphs=cuda_graphs_enabled(spec),
        weights_initial=spec.weights.initial,
        refit_transport=spec.refit.transport,
        checkpoint=spec.model.source,
    )


def parallelism(spec: v1alpha1.ParallelismSpec) -> planner.Parallelism:
    return planner.Parallelism(
        tensor=spec.tensor,
        pipeline=spec.pipeline,
        context=spec.context,
        expert=spec.expert,
        expert_tensor=spec.expert_tensor,
    )


def cuda_graphs_enabled(spec: v1alpha1.MegatronGenerationSpec) -> bool:
    """``engine.cudaGraphs`` resolved: unset means on for megatron on GPUs, off otherwise."""
    if spec.engine.cuda_graphs is not None:
        return spec.engine.cuda_graphs
    return spec.engine.backend == "megatron" and spec.resources.gpus_per_node > 0


def _problem(error: Any) -> planner.Problem:
    path = ".".join(str(part) for part in ("spec", *error["loc"]))
    return planner.Problem(field=path, message=str(error["msg"]))
