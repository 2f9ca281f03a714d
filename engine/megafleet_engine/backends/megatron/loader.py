"""Building the megatron backend: :func:`load`, the model and megatron's engine on this process's
GPU in its model-parallel place, the weights, and the staging decision.

Called through :func:`megafleet_engine.backends.load_backend` by the engine process (and by
``bench/`` and the GPU tests), on every rank of a shard alike (the process groups, the model's
collectives and the staging decision are collective).
"""

from __future__ import annotations

import warnings

import torch

from megafleet_engine.backends import base
from megafleet_engine.backends.megatron import backend as backend_module
from megafleet_engine.backends.megatron import build, model_sources, staging

__all__ = ["load"]


def load(
    source: str,
    *,
    name: str,
    max_sequence_length: int,
    dtype: str,
    device: str,
    load_weights: bool,
    parallel: base.Parallel | None = None,
    options: build.EngineOptions | None = None,
) -> backend_module.MegatronBackend:
    """Build the model and megatron's engine for ``source`` on this process's GPU.

    ``dtype`` must be ``bfloat16`` or ``float16`` (megatron's flash-attention kernels need them);
    ``device`` is ``cuda`` or ``cuda:N`` (with several ranks, ``Parallel.local_rank`` picks the GPU).
    Deferred init (``load_weights=False``) leaves zeros in every parameter.
    """
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"the megatron backend runs in bfloat16 or float16, not {dtype}")
    if not device.startswith("cuda"):
        raise ValueError(f"the megatron backend needs a CUDA device, not {device!r}")
    parallel = parallel or base.Parallel()
    options = build.effective_options(options or build.EngineOptions(), parallel.world_size)
    parsed = model_sources.parse_source(source)
    torch_dtype: torch.dtype = getattr(torch, dtype)
    index = torch.device(device).index
    torch.cuda.set_device(parallel.local_rank if parallel.world_size > 1 or index is None else index)
    with warnings.catch_warnings():
        # megatron-core warns at import and construction about optional packages (Apex, Transformer
        # Engine) and its own deprecations; none of it concerns this configuration.
        warnings.simplefilter("ignore")
        layout, group = build.init_parallel(parallel, options.seed)
        model = build.build_model(parsed.shape, layout, torch_dtype, max_sequence_length, options)
        tokenizer = model_sources.load_tokenizer(parsed)
        eod = parsed.eos_token_ids[0] if parsed.eos_token_ids else 0
        engine = build.build_engine(model, build.IdTokenizer(eod, parsed.bos_token_id), max_sequence_length, options)
    backend = backend_module.MegatronBackend(
        engine=engine,
        model=model,
        source=parsed,
        layout=layout,
        name=name,
        max_sequence_length=max_sequence_length,
        tokenizer=tokenizer,
        group=group,
        max_requests=options.max_batch_size,
        kv_cache_mode=options.kv_cache_mode,
    )
    if not load_weights:
        backend.zero_weights()
    elif parsed.kind == "random":
        backend._weights.fill_random(parsed.seed)
    else:
        backend.load_checkpoint(source)
    if options.staging != "off":  # after the KV buffer and the graphs: the copy never shrinks the KV cache
        backend._staging.decide(
            buffer_bytes=options.staging_buffer_mib * staging.MIB,
            headroom_bytes=options.staging_headroom_mib * staging.MIB,
        )
    torch.cuda.synchronize()
    return backend
