"""The megatron backend's class: megatron-core's dynamic engine behind the
:class:`~megafleet_engine.backends.base.Backend` protocol, wired from the package's parts, and
:func:`load`, which builds it.

Called through :func:`megafleet_engine.backends.load_backend` by the engine process (and by
``bench/engine_megatron.py`` and the GPU tests).

Refits and the KV cache, through megatron's ``KVCacheManagementMode`` (the engine passes its
``kv_cache_mode``, by default ``EngineOptions.kv_cache_mode``):
:meth:`~MegatronBackend.begin_weight_update` suspends megatron's engine and
:meth:`~MegatronBackend.finish_weight_update` resumes it. ``persist`` keeps the KV buffer and CUDA
graphs; ``offload`` frees the KV buffer (into a pinned host copy when built with
``kv_cache_mode="offload"``, else by deleting it) and the graphs, then rebuilds both; ``recompute``
deletes the KV buffer and the graphs and allocates a fresh buffer and block allocator after. The
scheduler drains or aborts every request before a refit and megatron's prefix caching is off, so in
every mode no KV block computed with old weights serves a request after the refit.

On a model-parallel shard (:mod:`.lockstep`) every rank writes its own weights in a refit; the
other ranks' ``begin/finish_weight_update`` do nothing (the first rank's suspend and resume drive
them), and before the first rank resumes, :meth:`~MegatronBackend.settle_weight_update` asks every
rank whether it holds the whole new version (an all-reduce): the shard resumes only if all do, so
it never computes with two versions.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import torch

from megafleet_engine.backends import base
from megafleet_engine.backends.megatron import (
    batch_runner,
    build,
    fused,
    live_weights,
    lockstep,
    model_sources,
    native_refit,
)
from megafleet_engine.backends.weight_maps import Layout
from megafleet_protocol import vocabulary

__all__ = ["MegatronBackend", "load"]


class MegatronBackend(base.InPlaceOnly):
    """A :class:`~megafleet_engine.backends.base.Backend` over megatron-core's ``DynamicInferenceEngine``.

    Attributes besides the protocol's: ``engine`` (megatron's engine, usable directly), ``model``
    (the ``GPTModel``), ``shape`` and ``layout`` (this rank's part).

    It neither keeps sequences across a refit nor stages yet (:class:`~megafleet_engine.backends.base.InPlaceOnly`:
    no ``keep_modes``, no staging copy), so its refits drain or abort and write in place.
    """

    supports_admission = True

    def __init__(
        self,
        *,
        engine: Any,
        model: Any,
        source: model_sources.ModelSource,
        layout: Layout,
        name: str,
        max_sequence_length: int,
        tokenizer: Any,
        group: Any = None,
        max_requests: int = 64,
        kv_cache_mode: vocabulary.KvCacheMode = "persist",
    ) -> None:
        self.engine = engine
        self.model = model
        self.shape = source.shape
        self.layout = layout
        self.tokenizer = tokenizer  # None for a checkpoint without tokenizer files
        self.kv_cache_mode: vocabulary.KvCacheMode = kv_cache_mode
        self._suspended = False
        eos = source.eos_token_ids[0] if source.eos_token_ids else None
        self.info = base.ModelInfo(
            name=name,
            max_sequence_length=max_sequence_length,
            vocab_size=source.shape.vocab,
            eos_token_id=eos,
        )
        leader = group is None or (layout.tp_rank == 0 and layout.pp_rank == 0)
        self._lockstep = lockstep.Lockstep(group, leader=leader, device=torch.cuda.current_device())
        self._settlement = live_weights.Settlement()  # following ranks: their own writes, for settle
        self._batch = batch_runner.Runner(
            engine,
            self.info,
            self._lockstep,
            max_requests=max_requests,
            other_eos=frozenset(source.eos_token_ids[1:]),
        )
        self._weights = live_weights.Weights(model, self.shape, layout)

    # -- weights -------------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's part of every HF parameter, as views of the live megatron tensors.

        A view has the shape of the HF slice it holds, except where one strided view covers
        several query groups of a fused QKV (``(groups, rows per group, hidden)``): write with
        ``view.copy_(hf_slice.view(view.shape))``. :meth:`shard_map` says which slice each is.
        """
        return self._weights.views()

    def shard_map(self) -> base.ShardMap:
        """Megatron parameters of this rank and the HF slices they are made of."""
        return self._weights.shard_map()

    def write_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, sliced: bool = False
    ) -> None:
        """Copy HF tensors into the live parameters in place (dtype and device converted).

        ``sliced=False``: each tensor is the whole HF tensor. ``sliced=True``: each tensor is only
        the range this rank needs (``piece.hf_range`` of the name's piece in :meth:`shard_map`).
        Names this rank does not hold are ignored (the refit sender may broadcast everything).
        """
        self._weights.write(weights, sliced=sliced)

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        """Load weights from a ``tiny://``, ``random://`` or checkpoint-folder source, in place (this
        backend holds no staging copy: ``staged`` raises)."""
        if staged:
            self.staged_parameters()  # raises: no staging copy
        self._weights.load(source)

    def zero_weights(self) -> None:
        """Deferred init: the parameters exist but hold zeros until the first refit writes them."""
        self._weights.zero()

    def native_receiver(self) -> native_refit.NativeRefit:
        """This rank's model as a destination of megatron-core's own refit (``swap_model_weights``
        from a megatron-core trainer; :mod:`.native_refit`)."""
        return native_refit.NativeRefit(self.model, self._lockstep.device)

    # -- refits: KV cache and CUDA graphs ------------------------------------------------------

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Suspend megatron's engine for a refit (nothing may be in flight), through megatron's
        ``KVCacheManagementMode``: ``persist`` keeps the KV buffer and CUDA graphs; ``offload``
        frees both (the KV buffer goes to its pinned host copy when the backend was built with
        ``EngineOptions.kv_cache_mode="offload"``, else it is deleted as in ``recompute``: nothing is
        in flight, so its contents are not needed); ``recompute`` deletes the KV buffer (every
        context tensor) and the CUDA graphs. Freed memory goes back to the device. Idempotent; on a
        model-parallel group the first rank leads and the others follow."""
        _check_mode(kv_cache_mode)
        if not self._lockstep.leader:  # the first rank's suspend reaches serve_followers(); forget old outcomes
            self._settlement.forget()
            return
        if self._lockstep.spans_ranks:
            self._lockstep.broadcast(lockstep.Tick(control="suspend", mode=kv_cache_mode))
        self._suspend(kv_cache_mode)

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Resume megatron's engine after a refit, mirroring :meth:`begin_weight_update`: the KV
        buffer comes back (copied back from the host, or freshly allocated with a fresh block
        allocator, so no block computed with the old weights survives) and the CUDA graphs are
        recaptured; ``persist`` changes nothing (weights were copied into the same storage, which
        the graphs read at replay). Without a :meth:`begin_weight_update` before, ``recompute``
        still drops and rebuilds the KV cache; the other modes have nothing to do. Idempotent."""
        _check_mode(kv_cache_mode)
        if not self._lockstep.leader:  # the first rank's resume reaches serve_followers()
            return
        if self._lockstep.spans_ranks:
            self._lockstep.broadcast(lockstep.Tick(control="resume", mode=kv_cache_mode))
        self._resume(kv_cache_mode)

    @property
    def follows(self) -> bool:
        """Whether this rank follows the first rank of its model-parallel group."""
        return not self._lockstep.leader

    @property
    def spans_ranks(self) -> bool:
        """Whether this shard has rank processes other than this one (``settle_weight_update`` has
        others to ask; with one rank it would only return its argument)."""
        return self._lockstep.spans_ranks

    def settle_weight_update(self, version: int, *, ok: bool, timeout_seconds: float) -> bool:
        """Agree, across the model-parallel group, that every rank holds weight ``version``.

        First rank (on the backend thread, after its own writes, before its resume): tell the others
        to answer, then all-reduce their answers; ``True`` only if every rank wrote the whole
        version. A following rank (any thread) records ``ok`` for that question and returns it; it
        answers when asked, waiting up to ``timeout_seconds`` (the first rank's remaining refit
        time) for its own writes to end, and answers ``False`` if they do not."""
        if not self._lockstep.spans_ranks:
            return ok
        if not self._lockstep.leader:
            self._settlement.record(version, ok)
            return ok
        if not ok:
            return False
        torch.cuda.set_device(self._lockstep.device)
        self._lockstep.broadcast(lockstep.Tick(control="settle", version=version, timeout_seconds=timeout_seconds))
        return self._lockstep.agree(True)

    @property
    def suspended(self) -> bool:
        """Between :meth:`begin_weight_update` and :meth:`finish_weight_update`."""
        return self._suspended

    def _suspend(self, kv_cache_mode: str) -> None:
        torch.cuda.set_device(self._lockstep.device)
        if self._suspended:
            return
        if self.engine.has_unfinished_requests():
            raise RuntimeError("a weight update cannot begin while megatron's engine has requests in flight")
        # megatron's offload needs the pinned host copy it allocates with the KV buffer
        effective = "recompute" if kv_cache_mode == "offload" and self.kv_cache_mode != "offload" else kv_cache_mode
        modes = build.megatron_core("inference.config").KVCacheManagementMode
        self.engine.context.kv_cache_management_mode = modes(effective)  # read by suspend() and resume()
        self.engine.suspend()
        if effective != "persist":
            torch.cuda.empty_cache()
        self._suspended = True

    def _resume(self, kv_cache_mode: str) -> None:
        torch.cuda.set_device(self._lockstep.device)
        if not self._suspended:
            if kv_cache_mode != "recompute":
                return
            self._suspend(kv_cache_mode)
        self.engine.resume()  # mirrors the suspend's mode, still set on the context
        modes = build.megatron_core("inference.config").KVCacheManagementMode
        self.engine.context.kv_cache_management_mode = modes(self.kv_cache_mode)
        self._suspended = False

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, batch: Sequence[base.SequenceRequest], admit: base.Admit | None = None
    ) -> Generator[list[base.TokenStep], None, None]:
        """Run ``batch`` on megatron's engine, one yielded list per engine step; with ``admit``,
        take new sequences into the running batch between steps (continuous batching)."""
        if not self._lockstep.leader:
            raise RuntimeError("on a model-parallel rank other than the first, run serve_followers()")
        if self._suspended:
            raise RuntimeError("the backend is suspended for a weight update (finish_weight_update first)")
        return self._batch.lead(list(batch), admit)

    def set_step_options(
        self,
        *,
        async_schedule: bool | None = None,
        sync_free_sampling: bool | None = None,
        array_collect: bool | None = None,
    ) -> None:
        """Switch the per-step options that need no rebuild, between batches (nothing in flight;
        ``None`` leaves one as it is): megatron's asynchronous scheduling
        (:attr:`.build.EngineOptions.async_schedule`), the sampler's host-sync-free path
        (:attr:`.nemo_sampler.NemoSampling.sync_free`) and the step arrays of
        :attr:`.batch_runner.Runner.array_collect`. Called by the benchmark to compare them on one
        engine; the first rank of a model-parallel shard only (the others keep their build's
        scheduling mode, so keep ``async_schedule`` as built there)."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("step options change between batches only")
        if async_schedule is not None:
            if self._lockstep.spans_ranks:
                raise RuntimeError("the scheduling mode of a model-parallel shard is fixed when it is built")
            self.engine.context.config.async_sched_mode = build.schedule_mode(async_schedule)
        if sync_free_sampling is not None:
            self._batch.sampler.sync_free = sync_free_sampling
        if array_collect is not None:
            self._batch.array_collect = array_collect

    def step_options(self) -> dict[str, Any]:
        """The per-step options in force (what :meth:`set_step_options` sets), the graph scope and
        the fused kernels installed (:mod:`.fused`: how many modules each replaced)."""
        config = self.engine.context.config
        return {
            "async_schedule": str(getattr(config.async_sched_mode, "value", config.async_sched_mode)) == "async",
            "sync_free_sampling": self._batch.sampler.sync_free,
            "array_collect": self._batch.array_collect,
            "graph_scope": str(getattr(self.model.config, "inference_cuda_graph_scope", None)),
            "fused_kernels": dict(getattr(self.model, fused.INSTALLED, {})),
        }

    def serve_followers(self) -> None:
        """On model-parallel ranks other than the first: apply every message the first rank
        broadcasts (sequences joining and leaving, suspend, resume) and step in lockstep with it,
        until it broadcasts ``None`` (:meth:`close`)."""
        if self._lockstep.leader:
            raise RuntimeError("serve_followers() runs on model-parallel ranks other than the first")
        lockstep.follow(self._lockstep, self._follow)

    def _follow(self, tick: lockstep.Tick) -> None:
        if tick.control == "suspend":
            self._suspend(tick.mode)
        elif tick.control == "resume":
            self._resume(tick.mode)
        elif tick.control == "reset":
            self._batch.reset()
        elif tick.control == "settle":
            self._lockstep.agree(self._settlement.wait(tick.version, tick.timeout_seconds))
        else:
            self._batch.apply(tick)
            if self.engine.has_unfinished_requests():
                self._batch.step()

    def close(self) -> None:
        """Release the followers (first rank only) and this backend's event loop."""
        if self._lockstep.spans_ranks and self._lockstep.leader:
            self._lockstep.broadcast(None)
        self._batch.close()


def _check_mode(kv_cache_mode: str) -> None:
    if kv_cache_mode not in ("persist", "offload", "recompute"):
        raise ValueError(f"unknown KV-cache mode {kv_cache_mode!r}: persist, offload or recompute")


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
) -> MegatronBackend:
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
    backend = MegatronBackend(
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
    torch.cuda.synchronize()
    return backend
