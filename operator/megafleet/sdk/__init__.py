"""The RL job's side of megafleet: find a fleet, generate with it, refit it. Never imports kopf or ray.

* :mod:`megafleet.sdk.fleet`: :class:`~megafleet.sdk.fleet.Fleet`, the client of one MegatronGeneration
  (wait until Ready, frontends, Refit objects, generation spread over the frontends); lightkube and
  httpx only.
* :mod:`megafleet.sdk.generation` and :mod:`megafleet.sdk.routing`: the OpenAI-compatible client and
  least-outstanding-requests routing over Ready, non-stale frontends (usable without the API server).
* :mod:`megafleet.sdk.trainer`: :class:`~megafleet.sdk.trainer.WeightSender`, the trainer's end of the
  refit protocol (DESIGN.md section 6); :mod:`megafleet.sdk.weights` plugs it into ``Fleet.refit``.
  Both need torch (the ``engine`` extra) and share the wire protocol with the engine's receiver
  (:mod:`megafleet_engine.refit`), so both ends always speak the same version.
* :mod:`megafleet.sdk.nemo`: :class:`~megafleet.sdk.nemo.MegafleetGeneration`, NeMo RL's
  ``GenerationInterface`` over a fleet (needs torch).

Names are imported on first use, so ``import megafleet.sdk`` (or :mod:`megafleet.sdk.fleet`) does not
import torch.
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
    from megafleet.sdk.generation import Answer, Generator, Sampling
    from megafleet.sdk.nemo import MegafleetGeneration
    from megafleet.sdk.routing import Frontend, Router
    from megafleet.sdk.trainer import SendReport, WeightSender, attempt_port
    from megafleet_engine.refit.errors import ReceiverFailed, RefitError, RefitRejected, RefitTimeout

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
    "MegafleetGeneration": "megafleet.sdk.nemo",
    "Frontend": "megafleet.sdk.routing",
    "Router": "megafleet.sdk.routing",
    "SendReport": "megafleet.sdk.trainer",
    "WeightSender": "megafleet.sdk.trainer",
    "attempt_port": "megafleet.sdk.trainer",
    "ReceiverFailed": "megafleet_engine.refit.errors",
    "RefitError": "megafleet_engine.refit.errors",
    "RefitRejected": "megafleet_engine.refit.errors",
    "RefitTimeout": "megafleet_engine.refit.errors",
}

__all__ = [
    "Answer",
    "Attempt",
    "Fleet",
    "FleetError",
    "FleetNotFound",
    "FleetNotReady",
    "FleetState",
    "Frontend",
    "GenerationFailed",
    "Generator",
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
    "WeightSender",
    "attempt_port",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
