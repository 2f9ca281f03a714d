"""The words operator, SDK and engine share, each defined once as a ``Literal``.

The CRD models (:mod:`megafleet.api.v1alpha1`), the engine's settings and agent, and the refit
protocol all type their fields with these, so a value one side writes is one the other accepts.
The order of each literal is the order the API's schema lists.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "AttemptPhase",
    "BackendName",
    "CollectiveBackend",
    "CommitMode",
    "Dtype",
    "EngineState",
    "InFlightMode",
    "Integrity",
    "KvCacheMode",
    "NemoGeneration",
    "RefitSource",
    "StagingEffective",
    "StagingMode",
    "SuspendMode",
    "Transport",
    "VerificationMethod",
    "WeightsInitial",
]

BackendName = Literal["megatron", "transformers"]
"""The engine backend a fleet runs (``spec.engine.backend``, ``MEGAFLEET_BACKEND``)."""
Dtype = Literal["bfloat16", "float16", "float32"]
"""Parameter data type (``spec.model.dtype``, ``MEGAFLEET_DTYPE``)."""
Transport = Literal["broadcast", "reshard"]
"""How a refit moves weights: every tensor to every rank, or each rank only its slices."""
KvCacheMode = Literal["persist", "offload", "recompute"]
"""What happens to KV caches across a refit (``spec.engine.kvCacheMode``)."""
WeightsInitial = Literal["checkpoint", "refit"]
"""Where an engine's first weights come from (``spec.weights.initial``, ``MEGAFLEET_WEIGHTS_INITIAL``)."""
EngineState = Literal["loading", "ready", "suspended", "stale", "failed"]
"""An engine's state as its agent reports it (``GET /v1/state``)."""
SuspendMode = Literal["drain", "abort"]
"""How an engine suspends: ``drain`` waits for requests in flight, ``abort`` ends them."""
InFlightMode = Literal["drain", "abort", "keep"]
"""What a refit does with the sequences in flight (``spec.refit.inFlight``, a Refit's ``inFlight``, the
agent's ``suspendMode``): ``drain`` lets them finish on the old weights first, ``abort`` ends them,
``keep`` pauses the engine between two steps, switches the weights and lets every sequence go on
(what happens to its KV cache is the ``kvCacheMode``)."""
StagingMode = Literal["off", "auto", "required"]
"""Whether a refit receives into a staging copy while the engine serves (``spec.refit.staging``):
``off`` writes in place, ``auto`` stages when the memory allows, ``required`` fails the refit otherwise."""
StagingEffective = Literal["staged", "inPlace"]
"""How a refit's weights were received: into the staging copy (the pause covers the switch only) or in place."""
Integrity = Literal["none", "checksum"]
"""Whether refit buckets carry a digest the receivers verify before the switch (``spec.refit.integrity``)."""
VerificationMethod = Literal["trainerDigest", "agreement", "none"]
"""What verified a refit's bytes: the sender's per-bucket digest, the receivers agreeing with each
other (NeMo's wire carries no digest), or nothing."""
AttemptPhase = Literal[
    "idle",
    "suspending",
    "pausing",
    "joining",
    "receiving",
    "staging",
    "applying",
    "staged",
    "switching",
    "resuming",
    "succeeded",
    "failed",
]
"""Where an engine's refit attempt is (``GET /v1/refit/status``; a Refit object's own phase is the API
models'): ``suspending`` the engine (drain or abort), ``pausing`` it at a step boundary (keep, in
place), ``joining`` the trainer's world (rendezvous, handshake, manifest check), ``receiving`` buckets
(and writing each in place) or ``staging`` them (into the staging copy while serving), ``applying`` a
checkpoint, ``staged`` (verified, waiting to switch), ``switching`` (the staged copy goes live at a
step boundary), ``resuming``; then ``succeeded`` or ``failed``. ``idle``: no attempt yet."""
RefitSource = Literal["rendezvous", "checkpoint", "nemo", "peer"]
"""Where a refit's weights come from: the trainer's rendezvous, a checkpoint path, an unmodified
NeMo RL trainer's own collective, or a live shard of the same fleet (a catch-up from a peer)."""
NemoGeneration = Literal["nemo", "vllm"]
"""How a NeMo RL trainer built its refit communicator: ``nemo`` (NeMo >= 0.6) or ``vllm`` (NeMo <= 0.5)."""
CollectiveBackend = Literal["gloo", "nccl"]
"""The torch.distributed backend of a refit's transfer group: gloo on CPU, NCCL on GPU."""
CommitMode = Literal["local", "trainer", "operator"]
"""Who lets a staged refit's new version go live (``spec.refit.commit``, a Refit's ``commit``, the agent's
``commit``): ``local``, each shard as soon as its own receive completed (in place this is the only
mode); ``trainer``, the sender on the megafleet wire once every receiver reported ``staged/<r>``;
``operator``, the operator once every member reported ``staged`` (it records ``status.commit.decidedTime``
first). Under ``trainer`` and ``operator`` no shard switches before every member has staged and verified."""
