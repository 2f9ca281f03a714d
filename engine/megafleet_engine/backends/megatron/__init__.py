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
* :mod:`.kv_cache`: megatron's KV cache and CUDA graphs around refits, running sequences kept or not;
* :mod:`.staging`: the staging copy a refit writes while the engine serves, and its memory rule;
* :mod:`.backend`: :class:`MegatronBackend`, wiring them;
* :mod:`.loader`: :func:`load`, which builds it.

Invariants: live weights are written in place, never rebound (captured CUDA graphs read the same
storage); no KV block computed with old weights serves a request after a drained or aborted refit
(a refit that keeps sequences says what happens to theirs: its KV-cache mode); a model-parallel
shard resumes or switches only when every rank holds the new version, and every rank switches
between the same two steps, so it never computes with two.
"""

from megafleet_engine.backends.megatron.backend import MegatronBackend
from megafleet_engine.backends.megatron.batch_runner import to_megatron_sampling
from megafleet_engine.backends.megatron.build import EngineOptions, megatron_core
from megafleet_engine.backends.megatron.loader import load
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
