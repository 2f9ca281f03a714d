"""Inference backends behind one interface (:mod:`megafleet_engine.backends.base`).

``transformers`` runs here (CPU or one GPU); ``megatron`` (megatron-core's inference engine) needs
GPUs and megatron-core, and is imported only when asked for.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from megafleet_engine.backends import base

if TYPE_CHECKING:
    from megafleet_engine.backends import megatron

DTYPES = ("bfloat16", "float16", "float32")


def load_backend(
    backend: str,
    source: str,
    *,
    name: str,
    max_sequence_length: int,
    dtype: str = "float32",
    device: str = "cpu",
    load_weights: bool = True,
    parallel: base.Parallel | None = None,
    options: megatron.EngineOptions | None = None,
    prefix_caching: bool | None = None,
) -> base.Backend:
    """Build a backend for ``source``; with ``load_weights=False`` (deferred init) the parameters
    exist but hold no trained values until the first refit writes them.

    ``parallel`` places this process in its shard's model-parallel world and ``options`` tunes
    megatron's engine (megatron only: every ``transformers`` rank holds the whole model, TP = 1).
    ``prefix_caching`` (``None``: the backend's default, on for transformers, ``options.prefix_caching``
    for megatron) shares prompt-prefix KV among sequences (:class:`.base.CachesPrefixes`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if backend == "transformers":
        from megafleet_engine.backends import transformers_backend

        return transformers_backend.load(
            source,
            name=name,
            max_sequence_length=max_sequence_length,
            dtype=dtype,
            device=device,
            load_weights=load_weights,
            prefix_caching=True if prefix_caching is None else prefix_caching,
        )
    if backend == "megatron":
        from megafleet_engine.backends import megatron

        if prefix_caching is not None:
            options = dataclasses.replace(options or megatron.EngineOptions(), prefix_caching=prefix_caching)
        result: base.Backend = megatron.load(
            source,
            name=name,
            max_sequence_length=max_sequence_length,
            dtype=dtype,
            device=device,
            load_weights=load_weights,
            parallel=parallel,
            options=options,
        )
        return result
    raise ValueError(f"unknown backend {backend!r}: use transformers or megatron")
