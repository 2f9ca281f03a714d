"""What the three kinds share: the API group and version, the string patterns the API server applies,
the CEL and default helpers, the base model, conditions, refit membership and phase timings, the
reference to a fleet, and the record a kind is registered by.

Imported by every other module of :mod:`megafleet.api.v1alpha1`; it names no kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

GROUP = "megafleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

ConditionStatus = Literal["True", "False", "Unknown"]

# The rules the API server applies to the objects derived from a spec, so that a spec admitted here
# never yields an object the API server refuses.
QUANTITY = r"^\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
"""A non-negative Kubernetes resource quantity (``8``, ``500m``, ``64Gi``, ``1e3``)."""
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
"""No NUL or other control character: strings that reach a pod's env or command line."""
HOST = r"^([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$"
"""A host name or an IPv4 or IPv6 address, nothing else (no spaces, no shell)."""
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""An object name most kinds accept (Secret, ConfigMap, PVC, ServiceAccount, PriorityClass)."""


def cel(rule: str, message: str, *, field_path: str | None = None, reason: str | None = None) -> JsonDict:
    """One ``x-kubernetes-validations`` entry: a CEL rule the API server enforces at admission."""
    validation: JsonDict = {"rule": rule, "message": message}
    if field_path is not None:
        validation["fieldPath"] = field_path
    if reason is not None:
        validation["reason"] = reason
    return validation


def defaulted(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Schema extra for an optional object field: its complete default, so the API server fills it
    in (CEL rules see every field of it) when the user leaves the object out."""
    return {"default": model().model_dump(mode="json", by_alias=True, exclude_none=True)}


class ApiModel(pydantic.BaseModel):
    """Base of every API object: camelCase JSON names, unknown fields rejected, frozen values."""

    model_config = pydantic.ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True, validate_default=True
    )


class Condition(ApiModel):
    """A Kubernetes condition (metav1.Condition)."""

    type: str = Field(max_length=316, description="type of the condition, in CamelCase.")
    status: ConditionStatus = Field(description="status is True, False or Unknown.")
    reason: str = Field(default="", max_length=1024, description="reason is a CamelCase word for the last transition.")
    message: str = Field(default="", max_length=32768, description="message is a human-readable explanation.")
    last_transition_time: str | None = Field(
        default=None,
        json_schema_extra={"format": "date-time"},
        description="lastTransitionTime is when status last changed.",
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="observedGeneration is the spec generation this was computed from."
    )


class RankOffset(ApiModel):
    """Where a shard's ranks start in the trainer+fleet communicator."""

    shard: int = Field(ge=0, description="shard index.")
    offset: int = Field(ge=0, description="offset is the global rank of the shard's rank 0.")


class Membership(ApiModel):
    """The live shards taking part in refits and their ranks."""

    world_size: int = Field(ge=1, description="worldSize of the trainer+fleet communicator.")
    trainer_world_size: int = Field(ge=1, description="trainerWorldSize is the number of trainer ranks (first).")
    rank_offsets: list[RankOffset] = Field(default_factory=list, description="rankOffsets of the live shards.")


class PhaseTiming(ApiModel):
    """Duration of one refit phase."""

    name: str = Field(description="name of the phase (suspend, join, receive, apply, resume).")
    milliseconds: int = Field(ge=0, description="milliseconds the phase took.")


class FleetRef(ApiModel):
    """The fleet a Refit targets, in the Refit's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_LABEL, description="name of the MegatronGeneration.")


@dataclasses.dataclass(frozen=True)
class KindInfo:
    """How a kind is registered: names, printer columns and subresources (all namespaced)."""

    kind: str
    plural: str
    singular: str
    short_names: list[str]
    categories: list[str]
    spec: type[ApiModel]
    status: type[ApiModel]
    printer_columns: list[dict[str, Any]]
    scale: bool
    description: str
    validations: tuple[JsonDict, ...] = ()
    """CEL rules on the whole object (its name), beside the spec's own."""
    status_default: JsonDict | None = None
    """The status the API server shows before the operator wrote one (a schema default, applied on
    every read): kstatus readers such as Flux's health check then see a generation not yet observed,
    not an object without status that they would take for Current."""
