"""The ``megatron`` backend: megatron-core's dynamic inference engine on one or more GPUs.

Called through :func:`megafleet_engine.backends.load_backend` by the engine process (and by
``bench/``, and the GPU tests). megatron-core (>= 0.19, Python >= 3.12) and a flash-attention kernel
are needed at run time only: every module imports megatron lazily, inside functions, so the package
imports (and type-checks) anywhere.

Modules, along the backend's seams:

* :mod:`.model_sources`: what a model source string names (``tiny://``, ``random://``, a checkpoint
  folder) and its tokenizer;
* :mod:`.build`: the process and model-parallel groups, the ``GPTModel``, megatron's engine;
* :mod:`.live_weights`: HF-named views over the live parameters and every write into them;
* :mod:`.batch_runner`: the sampling mapping, the first rank's batch loop, token steps;
* :mod:`.nemo_sampler`: NeMo RL's filter as megatron's sampler (processed and per-request raw logprobs);
* :mod:`.lockstep`: what the first rank of a model-parallel shard tells the others;
* :mod:`.backend`: :class:`MegatronBackend`, wiring them, and :func:`load`.

Invariants: weights are written in place, never rebound (captured CUDA graphs read the same
storage); no KV block computed with old weights serves a request after a refit; a model-parallel
shard resumes only when every rank holds the new version, so it never computes with two.
"""

from megafleet_engine.backends.megatron.backend import MegatronBackend, load
from megafleet_engine.backends.megatron.batch_runner import to_megatron_sampling
from megafleet_engine.backends.megatron.build import EngineOptions, megatron_core
from megafleet_engine.backends.megatron.model_sources import PRESETS, ModelSource, parse_source

__all__ = [
    "PRESETS",
    "EngineOptions",
    "MegatronBackend",
    "ModelSource",
    "load",
    "megatron_core",
    "parse_source",
    "to_megatron_sampling",
]
