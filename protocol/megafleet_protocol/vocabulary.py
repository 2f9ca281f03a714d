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
    "Dtype",
    "EngineState",
    "KvCacheMode",
    "NemoGeneration",
    "RefitSource",
    "SuspendMode",
    "Transport",
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
AttemptPhase = Literal["idle", "suspending", "joining", "receiving", "applying", "resuming", "succeeded", "failed"]
"""Where an engine's refit attempt is (``GET /v1/refit/status``; a Refit object's own phase is the API
models'): ``suspending`` the engine, ``joining`` the trainer's world (rendezvous, handshake, manifest
check), ``receiving`` buckets (and writing each), ``applying`` a checkpoint, ``resuming``; then
``succeeded`` or ``failed``. ``idle``: no attempt yet."""
RefitSource = Literal["rendezvous", "checkpoint", "nemo"]
"""Where a refit's weights come from: the trainer's rendezvous, a checkpoint path, or an unmodified
NeMo RL trainer's own collective."""
NemoGeneration = Literal["nemo", "vllm"]
"""How a NeMo RL trainer built its refit communicator: ``nemo`` (NeMo >= 0.6) or ``vllm`` (NeMo <= 0.5)."""
CollectiveBackend = Literal["gloo", "nccl"]
"""The torch.distributed backend of a refit's transfer group: gloo on CPU, NCCL on GPU."""
