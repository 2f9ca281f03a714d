"""The base classes of the pod agent's request and response bodies (:mod:`megafleet_protocol.agent_api`
and the modules it gathers): camelCase fields, unknown request fields refused, unknown response
fields ignored, and the fields every refit request carries."""

from __future__ import annotations

import pydantic
from pydantic import Field
from pydantic.alias_generators import to_camel

from megafleet_protocol import vocabulary


class Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Response(pydantic.BaseModel):
    """A response body: a client ignores fields a newer agent adds."""

    model_config = pydantic.ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class RefitBody(Body):
    version: int = Field(ge=0, le=2**53, description="the weight version served once the refit completes.")
    timeout_seconds: int = Field(default=300, ge=1, le=86400, description="the watchdog's deadline, in seconds.")
    suspend_mode: vocabulary.InFlightMode = Field(
        default="drain",
        description="the sequences in flight: drain waits for them, abort ends them, keep pauses the engine "
        "between two steps and continues them on the new weights (their KV as kvCacheMode says).",
    )
    kv_cache_mode: vocabulary.KvCacheMode | None = Field(default=None, description="unset: the engine's own mode.")
    staging: vocabulary.StagingMode = Field(
        default="off",
        description="receive into a staging copy while serving (auto: when the memory allows; required: "
        "fail otherwise) so that the pause covers the switch only; off: write in place.",
    )
    integrity: vocabulary.Integrity = Field(
        default="none", description="checksum: verify every bucket's digest before the switch."
    )
    commit: vocabulary.CommitMode = Field(
        default="local",
        description="who lets a staged version go live: local (this shard once its receive completed), trainer "
        "(the sender's commit key, megafleet wire only) or operator (POST /v1/refit/commit); an attempt that "
        "receives in place cannot wait and switches as local does.",
    )
    commit_grace_seconds: int = Field(
        default=30,
        ge=5,
        le=600,
        description="how long past timeoutSeconds a staged attempt waits for its commit; then it discards the "
        "staged copy and fails (the old version serves on).",
    )
