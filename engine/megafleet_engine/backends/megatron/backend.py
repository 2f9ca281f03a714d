"""The megatron backend's class: megatron-core's dynamic engine behind the
:class:`~megafleet_engine.backends.base.Backend` protocol, wired from the package's parts.

Built by :func:`.loader.load` (through :func:`megafleet_engine.backends.load_backend` in the engine
process, and by ``bench/engine_megatron.py`` and the GPU tests).

Refits and the KV cache, through megatron's ``KVCacheManagementMode`` (:mod:`.kv_cache`; the engine
passes its ``kv_cache_mode``, by default ``EngineOptions.kv_cache_mode``). A drained or aborted refit:
:meth:`~MegatronBackend.begin_weight_update` suspends megatron's engine and
:meth:`~MegatronBackend.finish_weight_update` resumes it; ``persist`` keeps the KV buffer and CUDA
graphs; ``offload`` frees the KV buffer (into a pinned host copy when built with
``kv_cache_mode="offload"``, else by deleting it) and the graphs, then rebuilds both; ``recompute``
deletes the KV buffer and the graphs and allocates a fresh buffer and block allocator after.
With megatron's prefix caching on (:attr:`.build.EngineOptions.prefix_caching`) every resume and
switch, on every rank, forgets the registered prefix blocks (:func:`.kv_cache.invalidate_prefixes`),
so no KV block computed with old weights serves a later request: the cache is tied to the weight
version in every refit mode (drained, aborted, kept in flight, staged).

A refit that keeps the running sequences (:attr:`~MegatronBackend.keep_modes`: ``persist`` and
``recompute``, and ``offload`` when built for it with static KV pointers) writes while the scheduler
holds the backend thread inside ``admit`` between two steps; the
:class:`~megafleet_engine.backends.base.Switch` that follows becomes one lockstep ``switch`` tick,
which every rank applies between the same two steps: the staged weights copied into the live ones
(a staged refit), then the KV mode (``recompute``: megatron checkpoints the running requests and
prefills their whole prefixes again with the new weights; ``offload``: the KV copied to the host by
``begin_weight_update(keep=True)`` comes back).

Staging (:mod:`.staging`): :func:`.loader.load` allocates a staging copy of this rank's parameters when
``EngineOptions.staging`` asks and the memory rule allows on every rank of the shard; a staged
refit writes it (:meth:`~MegatronBackend.staged_parameters`, :meth:`~MegatronBackend.staged_shard_map`)
while the engine generates, and :meth:`~MegatronBackend.commit_staged` has the next switch (or
resume) copy it into the live tensors on every rank.

On a model-parallel shard (:mod:`.lockstep`) every rank writes its own weights in a refit; the
other ranks' ``begin/finish_weight_update`` do nothing (the first rank's suspend and resume drive
them), and before the first rank resumes or switches,
:meth:`~MegatronBackend.settle_weight_update` asks every rank whether it holds the whole new version
(an all-reduce): the shard goes on only if all do, so it never computes with two versions.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import torch

from megafleet_engine.backends import base
from megafleet_engine.backends.megatron import (
    batch_runner,
    build,
    fused,
    kv_cache,
    live_weights,
    lockstep,
    model_sources,
    native_refit,
    staging,
)
from megafleet_engine.backends.weight_maps import Layout
from megafleet_protocol import vocabulary

__all__ = ["MegatronBackend"]


class MegatronBackend:
    """A :class:`~megafleet_engine.backends.base.Backend` over megatron-core's ``DynamicInferenceEngine``.

    Attributes besides the protocol's: ``engine`` (megatron's engine, usable directly), ``model``
    (the ``GPTModel``), ``shape`` and ``layout`` (this rank's part), :attr:`staging_reason`.
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
        keep: set[vocabulary.KvCacheMode] = {"persist", "recompute"}
        if kv_cache_mode == "offload" and getattr(engine.context, "static_kv_memory_pointers", False):
            keep.add("offload")
        self.keep_modes: frozenset[vocabulary.KvCacheMode] = frozenset(keep)
        """``persist`` and ``recompute``; ``offload`` too when built for it with static KV pointers
        (:attr:`.build.EngineOptions.static_kv_pointers`: else megatron would lose the requests it kept)."""
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
        self._kv = kv_cache.KvCache(engine, kv_cache_mode, self._lockstep.device)
        self._batch = batch_runner.Runner(
            engine,
            self.info,
            self._lockstep,
            max_requests=max_requests,
            other_eos=frozenset(source.eos_token_ids[1:]),
        )
        self._batch.boundary = self._boundary
        self._weights = live_weights.Weights(live_weights.parameter_tensors(model), self.shape, layout)
        self._staging = staging.Staging(self._weights, self._lockstep)

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
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        sliced: bool = False,
        staged: bool = False,
    ) -> None:
        """Copy HF tensors into the live parameters in place (dtype and device converted), or with
        ``staged`` into the staging copy.

        ``sliced=False``: each tensor is the whole HF tensor. ``sliced=True``: each tensor is only
        the range this rank needs (``piece.hf_range`` of the name's piece in :meth:`shard_map`).
        Names this rank does not hold are ignored (the refit sender may broadcast everything).
        """
        (self._staging.held().weights if staged else self._weights).write(weights, sliced=sliced)

    def load_checkpoint(self, source: str, *, staged: bool = False) -> None:
        """Load weights from a ``tiny://``, ``random://`` or checkpoint-folder source, in place, or
        with ``staged`` into the staging copy."""
        (self._staging.held().weights if staged else self._weights).load(source)

    def zero_weights(self) -> None:
        """Deferred init: the parameters exist but hold zeros until the first refit writes them."""
        self._weights.zero()

    def native_receiver(self) -> native_refit.NativeRefit:
        """This rank's model as a destination of megatron-core's own refit (``swap_model_weights``
        from a megatron-core trainer; :mod:`.native_refit`)."""
        return native_refit.NativeRefit(self.model, self._lockstep.device)

    # -- staging (:mod:`.staging`) -----------------------------------------------------------

    def staging_bytes(self) -> int:
        """``P`` of the memory rule: the bytes of this rank's megatron parameters."""
        return self._weights.bytes

    @property
    def staging_reason(self) -> str | None:
        """Why this rank holds no staging copy (the memory rule's numbers); ``None`` once it holds one."""
        return self._staging.reason

    def prepare_staging(self) -> None:
        """Allocate the staging copy (idempotent). A model-parallel shard decides at build
        (``EngineOptions.staging``); raises when the build found no room."""
        self._staging.prepare()

    def staged_parameters(self) -> dict[str, torch.Tensor]:
        """The staging copy as :meth:`parameters` shows the live weights (same names and views)."""
        return self._staging.held().views()

    def staged_shard_map(self) -> base.ShardMap:
        """The staging copy as :meth:`shard_map` shows the live weights."""
        return self._staging.held().shard_map()

    def commit_staged(self) -> None:
        """Have the next ``switch`` or ``resume`` (the scheduler hands it over right after, on this
        thread) copy the staging copy into the live tensors, on every rank in the same tick."""
        self._staging.held()
        self._staging.commit_pending = True

    def discard_staged(self) -> None:
        """A staged refit failed before its switch: nothing copies the staging copy, and every rank
        forgets its writes' outcomes (a retry of the version is settled on its own writes): here,
        and on the other ranks through a ``discard`` tick sent before the first rank's next tick."""
        self._staging.commit_pending = False
        if self._lockstep.leader:
            self._lockstep.post(lockstep.Tick(control="discard"))
        else:
            self._settlement.forget()

    # -- refits: KV cache, CUDA graphs, switches ----------------------------------------------

    def begin_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode, *, keep: bool = False) -> None:
        """Suspend megatron's engine for a refit (:meth:`.kv_cache.KvCache.suspend`). Without ``keep``
        nothing may be in flight: ``persist`` keeps the KV buffer and CUDA graphs; ``offload`` frees
        both (the KV buffer goes to its pinned host copy when the backend was built with
        ``EngineOptions.kv_cache_mode="offload"``, else it is deleted as in ``recompute``: nothing is
        in flight, so its contents are not needed); ``recompute`` deletes the KV buffer (every
        context tensor) and the CUDA graphs. Freed memory goes back to the device.

        ``keep`` (a mode of :attr:`keep_modes`; parked between steps with sequences running):
        ``offload`` copies the KV to the host until the switch, ``recompute`` checkpoints the running
        requests and frees the KV (the switch prefills them again), ``persist`` waits for the work
        already launched (it reads the weights about to be written). The switch, or the next step
        boundary without one, resumes. Idempotent; on a model-parallel group the first rank leads
        and the others follow."""
        kv_cache.check_mode(kv_cache_mode)
        if keep:
            self._check_keep(kv_cache_mode)
        if not self._lockstep.leader:  # the first rank's suspend reaches serve_followers(); forget old outcomes
            self._settlement.forget()
            return
        self._control(lockstep.Tick(control="suspend", mode=kv_cache_mode, keep=keep))

    def finish_weight_update(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        """Resume megatron's engine after a refit, mirroring :meth:`begin_weight_update` (first the
        staging copy into the live weights, after :meth:`commit_staged`): the KV buffer comes back
        (copied back from the host, or freshly allocated with a fresh block allocator, so no block
        computed with the old weights survives) and the CUDA graphs are recaptured; ``persist``
        changes nothing (weights were copied into the same storage, which the graphs read at
        replay). Without a :meth:`begin_weight_update` before, ``recompute`` still drops and rebuilds
        the KV cache; the other modes have nothing to do. Idempotent."""
        kv_cache.check_mode(kv_cache_mode)
        if not self._lockstep.leader:  # the first rank's resume reaches serve_followers()
            return
        self._control(lockstep.Tick(control="resume", mode=kv_cache_mode, staged=self._staging.take_commit()))

    def switch_weights(self, switch: base.Switch) -> None:
        """The weights changed while parked between batches: the ``switch`` tick (the staging copy
        committed, a keeping suspension resumed); nothing runs, so nothing is recomputed."""
        self._switch(switch)

    def _boundary(self, switch: base.Switch | None) -> None:
        """The runner's step boundary after a park: apply ``switch``, or (``None``) resume what a
        keeping :meth:`begin_weight_update` suspended, the refit having ended without a switch."""
        if switch is not None:
            self._switch(switch)
        else:
            self._control(lockstep.Tick(control="resume", keep=True))  # the suspension's own mode

    def _switch(self, switch: base.Switch) -> None:
        mode = switch.kv_cache_mode
        self._check_keep(mode)
        tick = lockstep.Tick(control="switch", mode=mode, version=switch.version, staged=self._staging.take_commit())
        recomputed, seconds = self._control(tick)
        switch.done(base.Switched(recomputed_tokens=recomputed, recompute_seconds=seconds if recomputed else 0.0))

    def _check_keep(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        if kv_cache_mode not in self.keep_modes:
            kept = ", ".join(sorted(self.keep_modes))
            raise ValueError(f"this megatron backend keeps sequences with {kept}, not {kv_cache_mode}")

    def _control(self, tick: lockstep.Tick) -> tuple[int, float]:
        """First rank: send a refit control to the other ranks and apply it here."""
        if self._lockstep.spans_ranks:
            self._lockstep.broadcast(tick)
        return self._apply(tick)

    def _apply(self, tick: lockstep.Tick) -> tuple[int, float]:
        """Apply a refit control on this rank; a switch returns its recomputed tokens and seconds."""
        outcome = (0, 0.0)
        if tick.staged:
            torch.cuda.set_device(self._lockstep.device)
            self._staging.held().commit()
        if tick.control == "suspend":
            self._kv.suspend(tick.mode, keep=tick.keep)
        elif tick.control == "resume":
            self._kv.resume(tick.mode)
        elif tick.control == "switch":
            outcome = self._kv.switch(tick.mode)
        elif tick.control == "discard":
            self._settlement.forget()
        if tick.control in ("resume", "switch") and self.prefix_caching:  # new weights: no old prefix may match
            kv_cache.invalidate_prefixes(self.engine.context.kv_block_allocator)
        self._batch.held = self._kv.kept
        return outcome

    @property
    def prefix_caching(self) -> bool:
        """Whether megatron's prefix caching is on (:attr:`.build.EngineOptions.prefix_caching`)."""
        return bool(getattr(self.engine.context, "enable_prefix_caching", False))

    @property
    def prefix_cache(self) -> base.PrefixCacheCounters:
        """Prompt tokens megatron prefilled and skipped (its engine's running totals plus the
        context's counts not yet folded into them); megatron counts them only with its prefix
        caching on (off: zeros)."""
        engine, context = self.engine, self.engine.context
        computed = getattr(engine, "_prefill_tokens_computed", 0) + getattr(
            context, "prefix_cache_prefill_computed_tokens", 0
        )
        skipped = getattr(engine, "_prefill_tokens_skipped", 0) + getattr(
            context, "prefix_cache_prefill_skipped_tokens", 0
        )
        return base.PrefixCacheCounters(prompt_tokens=int(computed + skipped), hit_tokens=int(skipped))

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

        First rank (on the backend thread, after its own writes, before its resume or switch; a
        tick, so it works parked between steps): tell the others to answer, then all-reduce their
        answers; ``True`` only if every rank wrote the whole version (in place, or into its staging
        copy). A following rank (any thread) records ``ok`` for that question and returns it; it
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
        """Between :meth:`begin_weight_update` and :meth:`finish_weight_update` (or the switch)."""
        return self._kv.suspended

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, batch: Sequence[base.SequenceRequest], admit: base.Admit | None = None
    ) -> Generator[list[base.TokenStep], None, None]:
        """Run ``batch`` on megatron's engine, one yielded list per engine step; with ``admit``,
        take new sequences into the running batch between steps (continuous batching) and apply
        the switch of a refit that parked the thread there."""
        if not self._lockstep.leader:
            raise RuntimeError("on a model-parallel rank other than the first, run serve_followers()")
        if self._kv.kept:  # a keeping refit parked between batches ended without a switch
            self._boundary(None)
        elif self._staging.commit_pending:  # committed without a switch or resume: copy it before any step
            self._control(lockstep.Tick(control="switch", mode="persist", staged=self._staging.take_commit()))
        if self._kv.suspended:
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
        broadcasts (sequences joining and leaving, suspend, resume, settle, switch, discard) and
        step in lockstep with it, until it broadcasts ``None`` (:meth:`close`). While the first rank
        is parked for a refit it sends nothing, and this rank waits in the broadcast."""
        if self._lockstep.leader:
            raise RuntimeError("serve_followers() runs on model-parallel ranks other than the first")
        lockstep.follow(self._lockstep, self._follow)

    def _follow(self, tick: lockstep.Tick) -> None:
        if tick.control == "reset":
            self._batch.reset()
        elif tick.control == "settle":
            self._lockstep.agree(self._settlement.wait(tick.version, tick.timeout_seconds))
        elif tick.control:
            self._apply(tick)
        else:
            self._batch.apply(tick)
            if self.engine.has_unfinished_requests():
                self._batch.step()

    def close(self) -> None:
        """Release the followers (first rank only) and this backend's event loop."""
        if self._lockstep.spans_ranks and self._lockstep.leader:
            self._lockstep.broadcast(None)
        self._batch.close()
