"""Building megatron's side of the backend on this process's GPU: the model-parallel groups, the
``GPTModel`` and megatron's dynamic inference engine.

Called by :func:`megafleet_engine.backends.megatron.loader.load` (once per process), and through
:func:`megatron_core` by every module of the package that needs megatron. megatron-core (>= 0.19,
Python >= 3.12) and a flash-attention kernel (FA2 >= 2.7.3, FA3 or FA4) are needed at run time
only: megatron is imported inside functions, so this module imports (and type-checks) anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import socket
from collections.abc import Sequence
from typing import Any, Literal

import torch

from megafleet_engine.backends import base, weight_maps
from megafleet_engine.backends.megatron import fused
from megafleet_engine.backends.weight_maps import Layout, LlamaShape
from megafleet_protocol import vocabulary

__all__ = [
    "EngineOptions",
    "IdTokenizer",
    "build_engine",
    "build_model",
    "effective_options",
    "init_parallel",
    "megatron_core",
    "schedule_mode",
    "static_kv_pointers",
]


FusedChoice = Literal[
    "off", "rope-swiglu", "gemv", "all", "rope-swiglu-only", "rope-swiglu-norm", "rope-swiglu-norm-qkv", "gemv-no-pdl"
]
"""The values of :attr:`EngineOptions.fused_kernels`."""

FUSED_CHOICES: dict[str, fused.FusedKernels | None] = {
    "off": None,
    "rope-swiglu": fused.FusedKernels(),
    "gemv": fused.FusedKernels(gemv=True, pdl=True),
    "all": fused.FusedKernels(gemv=True, pdl=True, attention=True),
    "gemv-no-pdl": fused.FusedKernels(gemv=True),
    "rope-swiglu-only": fused.FusedKernels(rms_norm=False, qkv=False, residual_add=False),
    "rope-swiglu-norm": fused.FusedKernels(qkv=False, residual_add=False),
    "rope-swiglu-norm-qkv": fused.FusedKernels(residual_add=False),
}
"""The kernels each :attr:`EngineOptions.fused_kernels` value installs (``None``: megatron's ops)."""


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Settings of megatron's dynamic engine."""

    max_batch_size: int = 64
    """Most requests decoded together (megatron's ``max_requests``); decode CUDA graphs are
    captured for batch sizes up to it."""
    kv_buffer_gb: float = 20.0
    """GPU memory reserved for the paged KV cache."""
    max_step_tokens: int = 16384
    """Most tokens in one forward pass (prefill chunks included; megatron's ``max_tokens``)."""
    block_size_tokens: int = 256
    cuda_graphs: bool = True
    """Capture decode CUDA graphs at start (one per batch size megatron pads to: 1, 8, 16, ... up to
    ``max_batch_size``); eager decode is host-bound."""
    graph_scope: Literal["layer", "block"] = "block"
    """What one decode CUDA graph covers (megatron's ``inference_cuda_graph_scope``): ``layer``,
    one graph per transformer layer (replayed one after another from Python: on an H200 launching
    the 32 layer graphs of an 8B model took 5.6-6.8 ms of host time per step, more than the GPU's
    6.3 ms), or ``block``, one graph for every layer of the model (the embedding, final norm, output
    layer and sampling stay eager). Fixed when the model is built. ``block`` on one rank only
    (:func:`effective_options`)."""
    async_schedule: bool = True
    """megatron's asynchronous scheduling (``AsyncScheduleMode.ASYNC``): in a decode-only step it
    launches step N+1's forward before it reads step N's tokens back and does their bookkeeping, so
    the host's per-step work overlaps the GPU's. megatron itself falls back to the ordinary order in
    steps with prefills or paused requests. Can be switched between batches
    (:meth:`.backend.MegatronBackend.set_step_options`). On one rank only (:func:`effective_options`)."""
    fused_kernels: FusedChoice = "rope-swiglu"
    """Fused Triton kernels swapped into megatron's ``local`` layers before the decode graphs are
    captured (:mod:`.fused`, measured in ``bench/README.md``; :data:`FUSED_CHOICES`): ``rope-swiglu``
    (the default, the name kept from when it held only those two), every fusion that is bitwise
    megatron's unfused result: RoPE and the gated SiLU (one kernel each instead of ~27 and 3 per layer),
    the RMSNorms (one kernel per row adding the squares in torch's CUDA order instead of torch's 6 us
    kernel), and per layer one kernel for the query's copy, RoPE on q and k and the KV-cache append
    (instead of four), and each residual add in the RMSNorm after it (across layers with block graphs);
    ``gemv`` also the linear layers of one-token steps (batch-1 decode) through a Triton GEMV instead of
    cuBLAS (fc1 with the SwiGLU in its kernel, no split-K reductions) with every fused kernel launched
    as a programmatic dependent launch (the next kernel's weights read while the one before finishes):
    within bf16 rounding, not bitwise, so greedy tokens may part from megatron's at near-ties; ``all``
    also a Triton decode attention for one-request decode steps (instead of FlashAttention; not bitwise
    either); ``off``, megatron's ops.
    ``rope-swiglu-only``, ``rope-swiglu-norm``, ``rope-swiglu-norm-qkv`` and ``gemv-no-pdl`` (the
    benchmark's steps) leave the later fusions out. Fixed when the model is built; one rank only
    (:func:`effective_options`); models the kernels do not fit keep megatron's ops (a log line says
    why)."""
    prefill_graphs: bool = False
    """Also capture megatron's CUDA graphs for prefill and mixed steps (up to megatron's
    ``cuda_graph_max_tokens``, 512 tokens: ``use_cuda_graphs_for_non_decode_steps``), so a short
    prompt's prefill is one graph replay instead of the layers' eager forward (it shortens the time
    of a batch-1 generation outside its decode steps: ``bench/README.md``). Needs ``cuda_graphs``;
    more graphs to capture at start."""
    seed: int = 0
    """Seed of megatron's RNG trackers (sampling)."""
    kv_cache_mode: vocabulary.KvCacheMode = "persist"
    """The default KV-cache mode of refits (the engine passes it unless told otherwise): see
    :meth:`.backend.MegatronBackend.begin_weight_update`. ``offload`` also pins a host copy of the
    KV buffer's size at start (megatron's ``KVCacheManagementMode.OFFLOAD``), which a refit that
    keeps its sequences under ``offload`` needs (with :attr:`static_kv_pointers`)."""
    static_kv_pointers: bool = False
    """Ask megatron to keep the KV buffer at the same addresses across a suspend (its
    ``static_kv_memory_pointers``; with ``kv_cache_mode`` other than ``persist`` megatron-core 0.19
    allows it only with ``torch_memory_saver`` installed, which then holds the KV buffer and releases
    its memory at a suspend). Its CUDA graphs then survive ``offload`` and ``recompute`` refits
    instead of being captured again (2.2 s for an 8B model), and a refit can keep running
    sequences under ``offload``: without it megatron captures the graphs again at the resume, which
    resets its context, so the requests it kept there would be lost (the backend does not offer
    ``offload`` as a keep mode then). Off by default: the graphs are captured again."""
    prefix_caching: bool = True
    """megatron-core's own prefix caching (``InferenceConfig.enable_prefix_caching``, with its
    ``PrefixCachingEvictionPolicy.LRU``): a request's whole KV blocks (:attr:`block_size_tokens`
    tokens each) are registered under a hash chained over the prompt's blocks, and a later request
    whose prompt starts with the same blocks reuses them instead of prefilling (the samples of one
    prompt, and shared system prompts of at least one block); released blocks stay cached until the
    pool needs them. A refit invalidates every registered block (:func:`.kv_cache.invalidate_prefixes`).
    On by default (``MEGAFLEET_PREFIX_CACHING=auto``): the GPU tests pass with it and the rollout
    benchmark measured 1.23x output tokens/s on GRPO-shaped batches; ``false`` turns it off."""
    staging: vocabulary.StagingMode = "off"
    """Whether :func:`.loader.load` allocates a staging copy of this rank's parameters, which staged
    refits write while the engine serves (``MEGAFLEET_REFIT_STAGING``): ``off`` never; ``auto`` and
    ``required`` when the memory rule allows on every rank of the shard (:mod:`.staging`; without
    room ``required`` does not fail the build either: the backend's ``staging_reason`` says why)."""
    staging_headroom_mib: int = 1024
    """``H`` of the memory rule: device memory the staging copy leaves free
    (``MEGAFLEET_REFIT_STAGING_HEADROOM_MIB``)."""
    staging_buffer_mib: int = 2048
    """``B`` of the memory rule: the refit's receive buffers (two buckets of the default 1 GiB)."""


class IdTokenizer:
    """What megatron's controller asks of a tokenizer. Text is never needed here: a token list
    "detokenizes" to its ids, which lets top-n log-probabilities (keyed by text) map back to ids."""

    def __init__(self, eod: int, bos: int | None) -> None:
        self.eod = eod
        self.bos = bos

    def tokenize(self, text: str) -> list[int]:
        return [int(part) for part in text.split()]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return " ".join(str(int(token)) for token in tokens)


log = logging.getLogger(__name__)


def megatron_core(module: str) -> Any:
    """``megatron.core.<module>``, imported on first use (megatron-core is installed on GPU
    machines only, and mypy here has no stubs for it)."""
    return importlib.import_module(f"megatron.core.{module}")


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def init_parallel(parallel: base.Parallel, seed: int) -> tuple[Layout, Any]:
    """Join the process group and megatron's model-parallel groups (once per process)."""
    parallel_state = megatron_core("parallel_state")
    tensor_parallel = megatron_core("tensor_parallel")

    if parallel.world_size != parallel.tensor_parallel * parallel.pipeline_parallel:
        raise ValueError(
            f"world size {parallel.world_size} is not TP {parallel.tensor_parallel} x PP {parallel.pipeline_parallel}"
        )
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != parallel.world_size:
        raise ValueError(
            f"the process group has {torch.distributed.get_world_size()} ranks but Parallel says "
            f"{parallel.world_size}: pass the engine's Parallel(...) to load()"
        )
    if not torch.distributed.is_initialized():
        port = parallel.master_port or (_free_port() if parallel.world_size == 1 else 29500)
        torch.distributed.init_process_group(
            "nccl",
            init_method=f"tcp://{parallel.master_addr}:{port}",
            world_size=parallel.world_size,
            rank=parallel.rank,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
        )
    tensor_parallel.random.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    layout = Layout(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel.tensor_parallel,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel.pipeline_parallel,
    )
    group = parallel_state.get_model_parallel_group() if parallel.world_size > 1 else None
    return layout, group


def build_model(
    shape: LlamaShape, layout: Layout, dtype: torch.dtype, max_sequence_length: int, options: EngineOptions
) -> Any:
    """This rank's part of a Llama-shaped megatron ``GPTModel`` on the current GPU, in ``dtype``,
    with uninitialised weights (the caller writes every parameter)."""
    gpt = megatron_core("models.gpt")
    specs = megatron_core("models.gpt.gpt_layer_specs")
    config = megatron_core("transformer").TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        ffn_hidden_size=shape.intermediate,
        kv_channels=shape.head_dim,
        layernorm_epsilon=shape.norm_eps,
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        perform_initialization=False,  # every parameter is written by load()
        cuda_graph_impl="local" if options.cuda_graphs else "none",
        inference_rng_tracker=True,
        **({"inference_cuda_graph_scope": options.graph_scope} if options.cuda_graphs else {}),
    )
    model = gpt.GPTModel(
        config=config,
        transformer_layer_spec=specs.get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=weight_maps.padded_vocab_size(shape.vocab, layout),
        max_sequence_length=max_sequence_length,
        pre_process=layout.first_stage,
        post_process=layout.last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        rope_scaling=shape.rope_scaling_factor > 0,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
    )
    model.cuda()
    for parameter in model.parameters():  # RMSNorm weights start in float32
        parameter.data = parameter.data.to(dtype)
    model.eval()
    _one_kv_split_on_hopper(model)
    return model


def _one_kv_split_on_hopper(model: Any) -> None:
    """FlashAttention-4 has no split-KV kernel for SM 9.x (Hopper: H100, H200), and megatron's
    automatic ``num_splits=0`` picks one for a small decode batch over a long KV cache
    (``docs/incidents.md#fa4-splitkv-hopper``). Megatron passes ``num_splits=1`` when an attention module's
    ``batch_invariant_mode`` is set, and reads nothing else from that attribute on the FA4 path, so
    it is set on each attention module (not the config, which would switch other kernels)."""
    attention = megatron_core("transformer.attention")
    if torch.cuda.get_device_capability()[0] != 9 or not getattr(attention, "HAVE_FA4", False):
        return
    for module in model.modules():
        if isinstance(module, attention.Attention):
            module.batch_invariant_mode = True


def effective_options(options: EngineOptions, world_size: int) -> EngineOptions:
    """``options`` as a shard of ``world_size`` rank processes runs them: with more than one rank,
    per-layer graphs, megatron's ordinary step order and megatron's own ops (block graphs,
    asynchronous scheduling and the fused kernels were measured on one GPU only: ``bench/README.md``),
    with a log line when that changes them."""
    single = options.graph_scope == "layer" and not options.async_schedule and options.fused_kernels == "off"
    if world_size == 1 or single:
        return options
    log.info(
        "model-parallel shard of %d ranks: per-layer decode graphs, megatron's ordinary step order and "
        "no fused kernels (block graphs, asynchronous scheduling and fused kernels are single-GPU only)",
        world_size,
    )
    return dataclasses.replace(options, graph_scope="layer", async_schedule=False, fused_kernels="off")


def static_kv_pointers(options: EngineOptions) -> bool:
    """megatron's ``static_kv_memory_pointers`` for ``options`` (:attr:`EngineOptions.static_kv_pointers`;
    nothing to keep static under ``persist``, which never frees the KV buffer). Raises when asked
    without ``torch_memory_saver``, which megatron-core 0.19 needs for it outside ``persist``."""
    if not options.static_kv_pointers or options.kv_cache_mode == "persist":
        return False
    if importlib.util.find_spec("torch_memory_saver") is None:
        raise ValueError("static KV pointers need torch_memory_saver (pip install torch-memory-saver)")
    return True


def schedule_mode(async_schedule: bool) -> Any:
    """megatron's ``AsyncScheduleMode`` for :attr:`EngineOptions.async_schedule`."""
    modes = megatron_core("inference.config").AsyncScheduleMode
    return modes.ASYNC if async_schedule else modes.LEGACY


def build_engine(model: Any, tokenizer: IdTokenizer, max_sequence_length: int, options: EngineOptions) -> Any:
    """Megatron's ``DynamicInferenceEngine`` over ``model``, with its paged KV cache (and, with
    ``options.cuda_graphs``, decode CUDA graphs) sized by ``options``. Its log-probabilities are
    megatron's ``processed_logprobs``: computed by the sampler, which the runner replaces with
    :class:`.nemo_sampler.NemoSampling` (:func:`.nemo_sampler.install`)."""
    config_module = megatron_core("inference.config")
    config = config_module.InferenceConfig(
        block_size_tokens=options.block_size_tokens,
        buffer_size_gb=options.kv_buffer_gb,
        max_sequence_length=max_sequence_length,
        max_requests=options.max_batch_size,
        max_tokens=max(options.max_step_tokens, max_sequence_length),
        num_cuda_graphs=-1 if options.cuda_graphs else None,
        use_cuda_graphs_for_non_decode_steps=options.cuda_graphs and options.prefill_graphs,
        materialize_only_last_token_logits=True,
        kv_cache_management_mode=config_module.KVCacheManagementMode(options.kv_cache_mode),
        sampling_backend="torch",  # replaced by NeMo's filter (.nemo_sampler.install), which also computes
        logprobs_mode="processed_logprobs",  # the log-probabilities megatron returns
        async_sched_mode=schedule_mode(options.async_schedule),
        static_kv_memory_pointers=static_kv_pointers(options),
        enable_prefix_caching=options.prefix_caching,
        prefix_caching_eviction_policy=config_module.PrefixCachingEvictionPolicy.LRU,
    )
    context = megatron_core("inference.contexts.dynamic_context").DynamicInferenceContext(model.config, config)
    kernels = FUSED_CHOICES[options.fused_kernels]
    if kernels is not None:  # before the engine captures its decode graphs
        # one graph (or none) around all the layers: an add may be left to the next layer's norm
        across_layers = options.graph_scope == "block" or not options.cuda_graphs
        fused.install(model, context, dataclasses.replace(kernels, across_layers=across_layers))
    wrapper = megatron_core("inference.model_inference_wrappers.gpt.gpt_inference_wrapper").GPTInferenceWrapper(
        model, context
    )
    controllers = megatron_core("inference.text_generation_controllers.text_generation_controller")
    controller = controllers.TextGenerationController(inference_wrapped_model=wrapper, tokenizer=tokenizer)
    return megatron_core("inference.engines.dynamic_engine").DynamicInferenceEngine(
        controller=controller, context=context
    )
