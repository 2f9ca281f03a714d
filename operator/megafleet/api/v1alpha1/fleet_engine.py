"""A MegatronGeneration's engine container and frontends: ``spec.engine`` (backend, image, args,
environment) and ``spec.frontend`` (the OpenAI-compatible port and its API key).

Parts of :class:`~megafleet.api.v1alpha1.megatron_generation.MegatronGenerationSpec`, which the
operator's pod builder (:mod:`megafleet.desired`) turns into the engine container.
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import Field

from megafleet.api.v1alpha1 import common
from megafleet_protocol import env as pod_env
from megafleet_protocol import ports, vocabulary

PullPolicy = Literal["Always", "IfNotPresent", "Never"]

_NO_NUL = r"^[^\x00]*$"


class SecretKeyRef(common.ApiModel):
    """A key in a Secret of the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_LABEL, description="name is the Secret's name.")
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="key is the key in the Secret.",
    )


class FrontendSpec(common.ApiModel):
    """The OpenAI-compatible HTTP frontends (one per shard)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    f"self.port != {ports.AGENT_PORT} && self.port != {ports.METRICS_PORT}",
                    f"port must differ from the agent port {ports.AGENT_PORT} and the metrics port "
                    f"{ports.METRICS_PORT}",
                    field_path=".port",
                ),
            ]
        }
    )

    port: int = Field(default=8000, ge=1024, le=65535, description="port is the frontend's HTTP port.")
    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="apiKeySecret, when set, makes frontends require this key as a bearer token."
    )

    @pydantic.field_validator("port")
    @classmethod
    def _port_free(cls, port: int) -> int:
        if port in (ports.AGENT_PORT, ports.METRICS_PORT):
            raise ValueError(
                f"port must differ from the agent port {ports.AGENT_PORT} and the metrics port {ports.METRICS_PORT}"
            )
        return port


class KeySelector(common.ApiModel):
    """A key of a Secret or ConfigMap in the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="name of the object.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="key in the object.")
    optional: bool | None = Field(default=None, description="optional: a missing object or key is no error.")


class FieldSelector(common.ApiModel):
    """A field of the pod itself (the core API's fieldRef)."""

    field_path: str = Field(
        min_length=1,
        max_length=256,
        pattern=common.PRINTABLE,
        description="fieldPath, e.g. spec.nodeName, status.hostIP or metadata.labels['<key>'].",
    )


class EnvVarSource(common.ApiModel):
    """Where a variable's value comes from: exactly one of a Secret key, a ConfigMap key and a pod field."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)].filter(x, x).size() == 1",
                    "set exactly one of secretKeyRef, configMapKeyRef and fieldRef",
                ),
            ]
        }
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="secretKeyRef: a key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="configMapKeyRef: a key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="fieldRef: a field of the pod.")

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        if sum(item is not None for item in (self.secret_key_ref, self.config_map_key_ref, self.field_ref)) != 1:
            raise ValueError("set exactly one of secretKeyRef, configMapKeyRef and fieldRef")
        return self


_VALUE_OR_FROM = "set value or valueFrom, not both"


class EnvVar(common.ApiModel):
    """An environment variable for the engine container."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [common.cel("!has(self.valueFrom) || self.value == ''", _VALUE_OR_FROM)]
        }
    )

    name: str = Field(
        min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="name of the variable."
    )
    value: str = Field(default="", max_length=32768, pattern=_NO_NUL, description="value of the variable.")
    value_from: EnvVarSource | None = Field(
        default=None, description="valueFrom reads the value from a Secret, a ConfigMap or the pod (e.g. HF_TOKEN)."
    )

    @pydantic.model_validator(mode="after")
    def _one_value(self) -> EnvVar:
        if self.value_from is not None and self.value:
            raise ValueError(_VALUE_OR_FROM)
        return self


class ObjectRef(common.ApiModel):
    """An object of the fleet's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=common.DNS_SUBDOMAIN, description="name of the object.")
    optional: bool | None = Field(default=None, description="optional: a missing object is no error.")


class EnvFromSource(common.ApiModel):
    """Every key of one Secret or ConfigMap as variables (the core API's envFrom)."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    "has(self.secretRef) != has(self.configMapRef)", "set exactly one of secretRef and configMapRef"
                )
            ]
        }
    )

    prefix: str | None = Field(
        default=None, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="prefix of every name."
    )
    secret_ref: ObjectRef | None = Field(default=None, description="secretRef: the Secret whose keys become variables.")
    config_map_ref: ObjectRef | None = Field(
        default=None, description="configMapRef: the ConfigMap whose keys become variables."
    )

    @pydantic.model_validator(mode="after")
    def _exactly_one(self) -> EnvFromSource:
        if (self.secret_ref is None) == (self.config_map_ref is None):
            raise ValueError("set exactly one of secretRef and configMapRef")
        return self


_OPERATOR_ENV = "env may not set the MEGAFLEET_* variables the operator sets on every engine pod"


class EngineSpec(common.ApiModel):
    """The inference engine inside each pod."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                common.cel(
                    f"!has(self.env) || self.env.all(item, !(item.name in {list(pod_env.SET_BY_OPERATOR)}))",
                    _OPERATOR_ENV,
                    field_path=".env",
                ),
            ]
        }
    )

    backend: vocabulary.BackendName = Field(
        default="megatron",
        description="backend is megatron (megatron-core's inference engine, GPU, TP/PP across ranks) "
        "or transformers (Hugging Face transformers, CPU or one GPU).",
    )
    kv_cache_mode: vocabulary.KvCacheMode = Field(
        default="persist",
        description="kvCacheMode is persist (keep KV cache and CUDA graphs across refits), offload "
        "(free them during a refit, rebuild after) or recompute (drop the KV cache after each refit).",
    )
    cuda_graphs: bool | None = Field(
        default=None,
        description="cudaGraphs captures decode steps as CUDA graphs; unset means on for megatron on GPUs, "
        "off otherwise.",
    )
    max_batch_size: int = Field(
        default=64, ge=1, le=4096, description="maxBatchSize is the most requests decoded together."
    )
    image: str = Field(
        default="megafleet/engine:0.1.0",
        min_length=1,
        max_length=1024,
        pattern=r"^[^\s\x00-\x1f\x7f]+$",
        description="image is the engine image.",
    )
    image_pull_policy: PullPolicy = Field(default="IfNotPresent", description="imagePullPolicy of the engine image.")
    args: list[Annotated[str, Field(max_length=4096, pattern=_NO_NUL)]] = Field(
        default_factory=list, max_length=64, description="args are extra engine arguments."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="env is extra engine environment; the MEGAFLEET_* variables the operator sets are refused. "
        "A variable named here replaces the operator's cache variable of that name (see pod.cache).",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=16,
        description="envFrom adds every key of Secrets or ConfigMaps as variables; env and the operator's own "
        "variables win over them (Kubernetes' order).",
    )

    @pydantic.field_validator("env")
    @classmethod
    def _not_operator_env(cls, items: list[EnvVar]) -> list[EnvVar]:
        taken = sorted({item.name for item in items} & set(pod_env.SET_BY_OPERATOR))
        if taken:
            raise ValueError(f"{_OPERATOR_ENV}: {', '.join(taken)}")
        return items
