"""The RL job's side of megafleet: find a fleet, generate with it, refit it. Never imports kopf or ray.

* :mod:`megafleet.sdk.fleet`: :class:`~megafleet.sdk.fleet.Fleet`, the client of one MegatronGeneration
  (wait until Ready, frontends, Refit objects, generation spread over the frontends); the API server
  through :class:`megafleet.kube.Api` (the operator's own client, over lightkube), the frontends
  through httpx.
* :mod:`megafleet.sdk.generation` and :mod:`megafleet.sdk.routing`: the OpenAI-compatible client and
  least-outstanding-requests routing over Ready, non-stale frontends (usable without the API server).
* :class:`~megafleet_protocol.refit.sender.WeightSender`, the trainer's end of the refit protocol
  (:mod:`megafleet_protocol.refit`, next to the engine's receiver, so both ends always speak the
  same version); :mod:`megafleet.sdk.weights` plugs it into ``Fleet.refit``. Both need torch (the
  ``engine`` extra).
* :mod:`megafleet.sdk.nemo`: :class:`~megafleet.sdk.nemo.MegafleetGeneration`, NeMo RL's
  ``GenerationInterface`` over a fleet (needs torch).
* The words a refit's overrides take (``Fleet.refit(..., in_flight=, kv_cache_mode=, staging=, commit=)``):
  ``InFlightMode``, ``KvCacheMode``, ``StagingMode`` and ``CommitMode``, from
  :mod:`megafleet_protocol.vocabulary`.

Names are imported on first use, so ``import megafleet.sdk`` (or :mod:`megafleet.sdk.fleet`) does not
import torch. ``__all__`` is fixed by ``tests/sdk/test_sdk_exports.py``. The SDK imports only the
layers the operator's controllers share (``kube``, ``objects``, ``api``, ``names``, the protocol):
an import-linter contract in ``pyproject.toml`` keeps it so.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megafleet.sdk.errors import (
        FleetError,
        FleetNotFound,
        FleetNotReady,
        GenerationFailed,
        NoFrontend,
        RefitFailed,
    )
    from megafleet.sdk.fleet import Attempt, Fleet, FleetState, RefitResult
    from megafleet.sdk.generation import Answer, Generator, Sampling, VersionSpan
    from megafleet.sdk.nemo import MegafleetGeneration
    from megafleet.sdk.routing import Frontend, Router
    from megafleet_protocol.ports import attempt_port
    from megafleet_protocol.refit.errors import ReceiverFailed, RefitError, RefitRejected, RefitTimeout
    from megafleet_protocol.refit.sender import SendReport, WeightSender
    from megafleet_protocol.vocabulary import CommitMode, InFlightMode, KvCacheMode, StagingMode

_HOMES = {
    "FleetError": "megafleet.sdk.errors",
    "FleetNotFound": "megafleet.sdk.errors",
    "FleetNotReady": "megafleet.sdk.errors",
    "GenerationFailed": "megafleet.sdk.errors",
    "NoFrontend": "megafleet.sdk.errors",
    "RefitFailed": "megafleet.sdk.errors",
    "Attempt": "megafleet.sdk.fleet",
    "Fleet": "megafleet.sdk.fleet",
    "FleetState": "megafleet.sdk.fleet",
    "RefitResult": "megafleet.sdk.fleet",
    "Answer": "megafleet.sdk.generation",
    "Generator": "megafleet.sdk.generation",
    "Sampling": "megafleet.sdk.generation",
    "VersionSpan": "megafleet.sdk.generation",
    "MegafleetGeneration": "megafleet.sdk.nemo",
    "Frontend": "megafleet.sdk.routing",
    "Router": "megafleet.sdk.routing",
    "SendReport": "megafleet_protocol.refit.sender",
    "WeightSender": "megafleet_protocol.refit.sender",
    "attempt_port": "megafleet_protocol.ports",
    "ReceiverFailed": "megafleet_protocol.refit.errors",
    "RefitError": "megafleet_protocol.refit.errors",
    "RefitRejected": "megafleet_protocol.refit.errors",
    "RefitTimeout": "megafleet_protocol.refit.errors",
    "CommitMode": "megafleet_protocol.vocabulary",
    "InFlightMode": "megafleet_protocol.vocabulary",
    "KvCacheMode": "megafleet_protocol.vocabulary",
    "StagingMode": "megafleet_protocol.vocabulary",
}

__all__ = [
    "Answer",
    "Attempt",
    "CommitMode",
    "Fleet",
    "FleetError",
    "FleetNotFound",
    "FleetNotReady",
    "FleetState",
    "Frontend",
    "GenerationFailed",
    "Generator",
    "InFlightMode",
    "KvCacheMode",
    "MegafleetGeneration",
    "NoFrontend",
    "ReceiverFailed",
    "RefitError",
    "RefitFailed",
    "RefitRejected",
    "RefitResult",
    "RefitTimeout",
    "Router",
    "Sampling",
    "SendReport",
    "StagingMode",
    "VersionSpan",
    "WeightSender",
    "attempt_port",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
