"""The pod agent's HTTP API: its paths and its request and response bodies.

The engine's agent (:mod:`megafleet_engine.agent_server`) validates requests and writes responses
with these models; the operator's client (:mod:`megafleet.agent_client`) builds its requests and
parses the answers with the same ones. Bodies use camelCase, like the Kubernetes API the operator
speaks; unknown request fields are refused.
"""

from __future__ import annotations

import collections
from typing import Literal

import pydantic
from pydantic import Field

from megafleet_protocol import vocabulary
from megafleet_protocol.agent_bodies import Body as _Body
from megafleet_protocol.agent_bodies import RefitBody as _RefitBody
from megafleet_protocol.agent_bodies import Response as _Response
from megafleet_protocol.agent_reshard import (
    REFIT_NEMO_RESHARD,
    REFIT_NEMO_RESHARD_JOIN,
    NemoReshardJoinRequest,
    NemoReshardRefitRequest,
    NemoReshardStage,
    NemoReshardStatus,
)

__all__ = [
    "HEALTHZ",
    "PEER_SEND",
    "PEER_STATUS",
    "READYZ",
    "REFIT",
    "REFIT_ABORT",
    "REFIT_CHECKPOINT",
    "REFIT_COMMIT",
    "REFIT_MEGATRON",
    "REFIT_MEGATRON_JOIN",
    "REFIT_MEGATRON_LEAVE",
    "REFIT_NEMO",
    "REFIT_NEMO_JOIN",
    "REFIT_NEMO_LEAVE",
    "REFIT_NEMO_RESHARD",
    "REFIT_NEMO_RESHARD_JOIN",
    "REFIT_PEER",
    "REFIT_PREPARE",
    "REFIT_STATUS",
    "RESUME",
    "STATE",
    "SUSPEND",
    "BucketMismatch",
    "Capabilities",
    "CheckpointRefitRequest",
    "CommitReport",
    "InFlightReport",
    "MegatronJoinRequest",
    "MegatronRefitRequest",
    "NemoJoinRequest",
    "NemoLeaveRequest",
    "NemoRefitRequest",
    "NemoReshardJoinRequest",
    "NemoReshardRefitRequest",
    "NemoReshardStage",
    "NemoReshardStatus",
    "NemoTensor",
    "NemoWorldStatus",
    "PauseReport",
    "PeerBody",
    "PeerRefitRequest",
    "PeerSendRequest",
    "PeerSendStatus",
    "PhaseTiming",
    "PrepareRequest",
    "RefitAbortRequest",
    "RefitCommitRequest",
    "RefitRequest",
    "RefitStatusResponse",
    "RendezvousBody",
    "ResumeRequest",
    "StagingReport",
    "StateResponse",
    "SuspendRequest",
    "VerificationReport",
]

HEALTHZ = "/healthz"
READYZ = "/readyz"
STATE = "/v1/state"
SUSPEND = "/v1/suspend"
RESUME = "/v1/resume"
REFIT = "/v1/refit"
REFIT_PREPARE = f"{REFIT}/prepare"
REFIT_CHECKPOINT = f"{REFIT}/checkpoint"
REFIT_NEMO = f"{REFIT}/nemo"
REFIT_NEMO_JOIN = f"{REFIT}/nemo/join"
REFIT_NEMO_LEAVE = f"{REFIT}/nemo/leave"
REFIT_MEGATRON = f"{REFIT}/megatron"
REFIT_MEGATRON_JOIN = f"{REFIT}/megatron/join"
REFIT_MEGATRON_LEAVE = f"{REFIT}/megatron/leave"
REFIT_STATUS = f"{REFIT}/status"
REFIT_ABORT = f"{REFIT}/abort"
REFIT_COMMIT = f"{REFIT}/commit"


class SuspendRequest(_Body):
    mode: vocabulary.SuspendMode = Field(
        default="drain", description="drain waits for requests in flight; abort ends them."
    )
    timeout_seconds: int = Field(default=60, ge=1, le=86400, description="how long a drain may take, in seconds.")


class ResumeRequest(_Body):
    weight_version: int | None = Field(
        default=None, ge=0, le=2**53, description="the version now served; unchanged if unset."
    )


class RendezvousBody(_Body):
    address: str = Field(min_length=1, max_length=253, description="the trainer rank 0's address (its store).")
    port: int = Field(ge=1, le=65535, description="the store's port; a fresh one per attempt.")
    world_size: int = Field(ge=2, le=1 << 20, description="trainer ranks plus every live shard's ranks.")
    rank_offset: int = Field(ge=1, le=1 << 20, description="global rank of this shard's rank 0.")
    trainer_world_size: int = Field(default=1, ge=1, le=1 << 16, description="trainer ranks (they come first).")


class PrepareRequest(_RefitBody):
    """``POST /v1/refit/prepare``: receive a version from the trainer's rendezvous."""

    rendezvous: RendezvousBody
    transport: vocabulary.Transport = Field(default="broadcast", description="spec.refit.transport.")
    bucket_size_mib: int = Field(
        default=1024,
        ge=1,
        le=65536,
        alias="bucketSizeMiB",
        description="the largest bucket this rank accepts, in MiB (spec.refit.bucketSizeMiB).",
    )
    collective: vocabulary.CollectiveBackend | None = Field(
        default=None,
        description="the trainer's transfer group: unset is NCCL on a GPU engine and gloo on a CPU one; gloo "
        "on a GPU engine receives through host buffers (a trainer on the engine's own GPU, where NCCL "
        "cannot connect two ranks).",
    )


class CheckpointRefitRequest(_RefitBody):
    """``POST /v1/refit/checkpoint``: load a version from a checkpoint every shard reads itself."""

    path: str = Field(min_length=1, max_length=2048, description="the checkpoint every shard loads itself.")


class NemoTensor(_Body):
    """One entry of NeMo's refit info (``prepare_refit_info``): a Hugging Face tensor the trainer sends."""

    name: str = Field(min_length=1, max_length=1024)
    shape: list[int] = Field(max_length=64, description="the full tensor's shape; [] for a scalar.")
    dtype: str = Field(
        pattern=r"^(torch\.)?[a-z][a-z0-9_]*$", max_length=64, description="a torch dtype name, e.g. bfloat16."
    )

    @pydantic.field_validator("shape")
    @classmethod
    def _sizes(cls, shape: list[int]) -> list[int]:
        if any(size < 0 for size in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        return shape


class NemoJoinRequest(_Body):
    """``POST /v1/refit/nemo/join``: join an unmodified NeMo RL trainer's collective at its
    ``init_collective`` time, with no version and no refit info, without suspending the engine. The
    membership is kept for the refits of ``session`` (``POST /v1/refit/nemo`` without a rendezvous)."""

    session: str = Field(
        min_length=1, max_length=253, description="the RefitSession this membership serves (its name or UID)."
    )
    rendezvous: RendezvousBody = Field(
        description="init_collective's ip, port, world_size and train_world_size; rankOffset is the "
        "shard's first rank in NeMo's world (at least trainerWorldSize)."
    )
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="the trainer's communicator (NeMo >= 0.6, or vLLM's); unset: from its store."
    )
    timeout_seconds: int = Field(
        default=240, ge=1, le=86400, description="how long the join may take (below NeMo's 300 s store timeout)."
    )

    @pydantic.model_validator(mode="after")
    def _inference_rank(self) -> NemoJoinRequest:
        _check_inference_rank(self.rendezvous)
        return self


class NemoRefitRequest(_RefitBody):
    """``POST /v1/refit/nemo``: receive a version from an unmodified NeMo RL trainer's own collective
    (``policy.init_collective`` once, ``broadcast_weights_for_collective`` per step).

    Two forms: with ``rendezvous`` the first such refit joins NeMo's world and later ones with the
    same rendezvous reuse that membership; without it the refit receives over the world joined by
    ``POST /v1/refit/nemo/join`` (of ``session`` when given) and never joins (409 ``nemo_not_joined``
    on a rank that holds no such membership)."""

    rendezvous: RendezvousBody | None = Field(
        default=None,
        description="init_collective's ip, port, world_size and train_world_size; rankOffset is the "
        "shard's first rank in NeMo's world (at least trainerWorldSize). Unset: the joined world.",
    )
    session: str | None = Field(
        default=None, min_length=1, max_length=253, description="without rendezvous: the joined session it must be."
    )
    refit_info: list[NemoTensor] = Field(
        min_length=1,
        max_length=1 << 20,
        description="the trainer's prepare_refit_info in its order, which is the wire's order.",
    )
    bucket_bytes: int = Field(
        ge=1,
        le=1 << 40,
        description="the trainer's exact packed-bucket target in bytes (NeMo: min(GPU memory x "
        "NRL_REFIT_BUFFER_MEMORY_RATIO, 5 GiB), or buffer_size_bytes); a wrong one is not detected cleanly.",
    )
    generation: vocabulary.NemoGeneration | None = Field(
        default=None, description="the trainer's communicator (NeMo >= 0.6, or vLLM's); unset: from its store."
    )

    @pydantic.model_validator(mode="after")
    def _one_name_once(self) -> NemoRefitRequest:
        counts = collections.Counter(tensor.name for tensor in self.refit_info)
        twice = sorted(name for name, count in counts.items() if count > 1)
        if twice:
            raise ValueError(f"refitInfo names {len(twice)} tensors twice, e.g. {twice[:3]}")
        if self.rendezvous is not None:
            _check_inference_rank(self.rendezvous)
        return self


class NemoLeaveRequest(_Body):
    """``POST /v1/refit/nemo/leave`` (and ``/v1/refit/megatron/leave``'s twin): drop this pod's membership
    of ``session``'s world and abort its communicator. Idempotent: a session it does not hold answers 200."""

    session: str = Field(min_length=1, max_length=253, description="the RefitSession whose membership ends.")


class MegatronJoinRequest(_Body):
    """``POST /v1/refit/megatron/join``: join a megatron-core trainer's refit group (its store at
    ``port + 1``) at ``init_collective`` time and run ``prepare_swap_model_weights`` with it, without
    suspending the engine. Only the megatron backend can (409 ``backend_cannot_swap`` otherwise)."""

    session: str = Field(min_length=1, max_length=253, description="the RefitSession this membership serves.")
    rendezvous: RendezvousBody = Field(
        description="init_collective's ip, port (the group's store listens at port + 1), world_size and "
        "train_world_size; rankOffset is the shard's first rank (at least trainerWorldSize)."
    )
    copy_backend: Literal["gloo", "nccl"] = Field(default="nccl", description="megatron-core's copy service.")
    timeout_seconds: int = Field(default=240, ge=1, le=86400, description="how long the join may take.")

    @pydantic.model_validator(mode="after")
    def _inference_rank(self) -> MegatronJoinRequest:
        _check_inference_rank(self.rendezvous)
        return self


class MegatronRefitRequest(_RefitBody):
    """``POST /v1/refit/megatron``: one ``swap_model_weights`` over the group joined for ``session``
    (suspend, swap, resume); never joins (409 ``megatron_not_joined`` on a rank that holds no such group)."""

    session: str = Field(min_length=1, max_length=253, description="the joined session it must be.")


def _check_inference_rank(rendezvous: RendezvousBody) -> None:
    if rendezvous.rank_offset < rendezvous.trainer_world_size:
        raise ValueError(
            f"rendezvous.rankOffset {rendezvous.rank_offset} is a trainer rank "
            f"(NeMo's inference ranks start at trainerWorldSize {rendezvous.trainer_world_size})"
        )


# -- catch-up from a peer: a live shard sends its weights to shards behind the fleet's version ------

PEER_SEND = "/v1/peer/send"
PEER_STATUS = "/v1/peer/status"
REFIT_PEER = f"{REFIT}/peer"


class PeerSendRequest(_Body):
    """``POST /v1/peer/send`` (202), on a Ready shard at the fleet's current version: send its live
    weights as ``version`` to ``receivers`` shards catching up (each receiving rank calls
    ``POST /v1/refit/peer``). Each rank ``r`` of the pod serves its own world at ``port + r``
    (rank 0 of ``1 + receivers`` ranks); the engine serves on while its tensors are read."""

    version: int = Field(ge=0, le=2**53, description="the version this engine must be serving; sent under it.")
    port: int = Field(ge=1, le=65535 - 1024, description="the base port: shard rank r listens at port + r.")
    receivers: int = Field(default=1, ge=1, le=1024, description="the shards that receive this copy at once.")
    timeout_seconds: int = Field(default=300, ge=1, le=86400, description="bound of the whole copy, in seconds.")
    bucket_size_mib: int = Field(default=1024, ge=1, le=65536, alias="bucketSizeMiB")
    integrity: vocabulary.Integrity = Field(
        default="checksum", description="checksum: seal every bucket with its mf64 digest when the receivers ask."
    )
    collective: vocabulary.CollectiveBackend | None = Field(
        default=None, description="unset: NCCL from a GPU engine, gloo from a CPU one (the receivers must match)."
    )


class PeerBody(_Body):
    """Where a catching-up rank finds its peer: the sending pod's address and base port, how many
    shards receive the copy and this shard's place among them (1 to ``receivers``)."""

    address: str = Field(min_length=1, max_length=253, description="the sending pod's address.")
    port: int = Field(ge=1, le=65535 - 1024, description="the sender's base port (rank r's world is at port + r).")
    receivers: int = Field(default=1, ge=1, le=1024)
    index: int = Field(default=1, ge=1, le=1024, description="this shard's rank in each world (1 to receivers).")
    shard: int | None = Field(default=None, ge=0, description="the sending shard's index, for the status and logs.")


class PeerRefitRequest(_RefitBody):
    """``POST /v1/refit/peer`` (202): catch up to ``version`` from a live shard of the same fleet, which
    was asked to send it (``POST /v1/peer/send``); shard rank r receives from the peer's rank r."""

    peer: PeerBody
    bucket_size_mib: int = Field(default=1024, ge=1, le=65536, alias="bucketSizeMiB")
    collective: vocabulary.CollectiveBackend | None = Field(
        default=None, description="unset: NCCL on a GPU engine, gloo on a CPU one (as the sender's)."
    )


class PeerSendStatus(_Response):
    """``GET /v1/peer/status`` (and the answer of ``POST /v1/peer/send``): this rank's last copy."""

    phase: Literal["idle", "sending", "sent", "failed"]
    version: int | None = None
    port: int | None = None
    receivers: int = 0
    bytes_sent: int = 0
    buckets: int = 0
    verified: bool = Field(default=False, description="every bucket carried its mf64 digest, checked by each receiver.")
    seconds: float | None = None
    error: str | None = None


RefitRequest = (
    PrepareRequest
    | CheckpointRefitRequest
    | NemoRefitRequest
    | MegatronRefitRequest
    | PeerRefitRequest
    | NemoReshardRefitRequest
)
"""A request that starts a refit attempt."""


class RefitAbortRequest(_Body):
    reason: str = Field(default="requested by the operator", max_length=1024)


class RefitCommitRequest(_Body):
    """``POST /v1/refit/commit``: let the staged ``version`` go live (``commit: operator``). Answers the
    status; idempotent once the version serves; 409 ``not_staged`` unless an attempt to ``version`` is
    staged (or switching, or succeeded)."""

    version: int = Field(ge=0, le=2**53, description="the version the operator decided to commit.")


class PhaseTiming(_Response):
    name: str
    milliseconds: int


class InFlightReport(_Response):
    """What an attempt did with the sequences in flight."""

    requested: vocabulary.InFlightMode
    effective: vocabulary.InFlightMode
    kv_cache_mode: vocabulary.KvCacheMode
    reason: str | None = Field(default=None, description="why effective differs from requested.")
    kept: int = Field(default=0, ge=0, description="sequences that went on across the switch.")
    drained: int = Field(default=0, ge=0, description="sequences the refit waited for.")
    aborted: int = Field(default=0, ge=0, description="sequences the refit ended.")
    aborted_tokens: int = Field(default=0, ge=0, description="tokens those sequences had produced, thrown away.")
    recomputed_tokens: int = Field(default=0, ge=0, description="tokens whose KV was recomputed with the new weights.")


class StagingReport(_Response):
    """Where an attempt received its weights."""

    requested: vocabulary.StagingMode
    effective: vocabulary.StagingEffective
    reason: str | None = Field(default=None, description="why it did not stage, when it was asked to.")
    bytes: int = Field(default=0, ge=0, description="the staging copy's size on this rank.")


class PauseReport(_Response):
    """How long an attempt kept this rank from generating, in milliseconds."""

    stall_milliseconds: float = Field(
        ge=0, description="from the engine's last step before the refit to its first after."
    )
    gate_closed_milliseconds: float = Field(ge=0, description="how long new requests waited at the gate.")
    switch_milliseconds: float = Field(default=0, ge=0, description="the switch itself (the staged copy going live).")
    recompute_milliseconds: float = Field(default=0, ge=0, description="recomputing the kept sequences' KV.")


class BucketMismatch(_Response):
    """A bucket whose bytes did not match the sender's digest."""

    bucket: int = Field(description="its index in the plan, counted from 0.")
    first_tensor: str


class VerificationReport(_Response):
    """What verified the bytes of an attempt before the switch."""

    integrity: vocabulary.Integrity
    method: vocabulary.VerificationMethod
    buckets: int = Field(default=0, ge=0, description="buckets verified.")
    mismatch: BucketMismatch | None = None
    bucket_digests: list[str] = Field(
        default_factory=list,
        description="agreement (NeMo's wire): each bucket's mf64 digest as 16 hex digits, in wire order; "
        "every member of a Refit receives the same bytes, so their lists must be equal.",
    )
    non_finite: str | None = Field(
        default=None, description="agreement: the first tensor that arrived holding NaN or Inf (the attempt failed)."
    )


class CommitReport(_Response):
    """Who lets an attempt's version go live, and whether it was let."""

    requested: vocabulary.CommitMode
    effective: vocabulary.CommitMode = Field(description="local when the attempt received in place.")
    reason: str | None = Field(default=None, description="why effective differs from requested.")
    committed: bool = Field(default=False, description="the commit came (or, local, the switch began).")
    expired: bool = Field(
        default=False, description="no commit came within the deadline plus the grace: the staged copy was discarded."
    )


class RefitStatusResponse(_Response):
    """``GET /v1/refit/status`` (and the answer of every refit call): the current or last attempt."""

    phase: vocabulary.AttemptPhase
    version: int | None
    source: vocabulary.RefitSource | None
    transport: str | None
    rank: int | None
    world_size: int | None
    phases: list[PhaseTiming]
    duration_milliseconds: int | None
    bytes_received: int
    buckets: int
    tensors_written: int
    error: str | None
    timed_out: bool
    reused: bool = Field(
        default=False, description="the join kept the transfer group of the previous refit (no group was built)."
    )
    dirty: bool
    state: vocabulary.EngineState
    weight_version: int | None
    world: NemoWorldStatus | None = Field(
        default=None, description="the membership of NeMo's world joined by POST /v1/refit/nemo/join, if any."
    )
    in_flight: InFlightReport | None = None
    staging: StagingReport | None = None
    pause: PauseReport | None = None
    verification: VerificationReport | None = None
    commit: CommitReport | None = None


class NemoWorldStatus(_Response):
    """This rank's (or, combined, the pod's) membership of a trainer's world joined by
    ``POST /v1/refit/nemo/join`` or ``/v1/refit/megatron/join``: ``joining`` until the trainer's store
    counted every rank and the warm-up passed, then ``joined``; ``failed`` (``error`` says why) or ``left``
    (a failed refit, an abort, a leave, another world, shutdown)."""

    session: str
    phase: Literal["joining", "joined", "failed", "left"]
    protocol: Literal["nemo", "megatron"] = "nemo"
    rank: int | None = None
    generation: vocabulary.NemoGeneration | None = None
    error: str | None = None
    store_reachable: bool | None = Field(
        default=None,
        description="the last probe of the trainer's store (every 10 s while joined): False means the "
        "trainer's process is gone; None: not probed yet.",
    )
    reshard: NemoReshardStatus | None = Field(
        default=None, description="the stage communicators of NeMo's M-to-N reshard joined for the session, if any."
    )


class Capabilities(_Response):
    """What this engine can do across a refit (read by the operator before it asks for a mode)."""

    keep_modes: list[vocabulary.KvCacheMode] = Field(
        default_factory=list, description="the KV-cache modes it keeps sequences under; empty: it cannot keep."
    )
    staging_bytes: int | None = Field(default=None, ge=0, description="its staging copy's size; None: it cannot stage.")
    staging_reason: str | None = Field(default=None, description="why it cannot stage, e.g. the memory rule's numbers.")


class StateResponse(_Response):
    """``GET /v1/state`` (and the answer of suspend and resume)."""

    state: vocabulary.EngineState
    weight_version: int | None
    served_address: str | None
    rank: int
    world_size: int
    last_error: str | None
    queue_depth: int
    capabilities: Capabilities = Field(default_factory=Capabilities)
