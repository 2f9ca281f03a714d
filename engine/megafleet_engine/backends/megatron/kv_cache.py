"""What a refit does to megatron's KV cache and CUDA graphs on one rank: megatron's engine suspended
and resumed through its ``KVCacheManagementMode``, with nothing in flight (a drained or aborted
refit) or with the running sequences kept (a refit that keeps them, switched between two steps).

Called by :class:`.backend.MegatronBackend` on every rank of a shard alike (the first rank applies
each refit control itself and broadcasts it; the others apply it from :mod:`.lockstep`).

megatron-core (0.19) carries requests across ``suspend()``/``resume()``: under ``PERSIST`` and
``OFFLOAD`` its active requests keep their KV blocks (``OFFLOAD`` copies the KV buffer to the pinned
host copy it allocated at build and back); under ``RECOMPUTE`` it frees every context tensor,
checkpoints each active request (``record.checkpoint()``: its prompt becomes prompt + generated
tokens, and its ``generated_tokens`` restart empty) and re-adds them on resume, so their next step prefills the
whole prefix with the weights live then. It deletes its CUDA graphs at suspend and captures them
again at resume unless the mode is ``PERSIST`` or the context keeps static KV pointers
(:attr:`.build.EngineOptions.static_kv_pointers`); capturing resets its context, which loses the
active requests an ``OFFLOAD`` suspend kept there, so an offload keeps sequences only with static
pointers (the backend's ``keep_modes`` say so), while a recompute re-adds its requests after the
capture.

Keeping sequences (``keep``): :meth:`KvCache.suspend` under ``offload`` (KV to the host while the
weights are written) or ``recompute`` (KV freed, requests checkpointed) leaves the running requests
in megatron's engine, and :meth:`KvCache.switch` resumes them between the same two steps on every
rank; a ``recompute`` switch without an earlier suspend runs both there. Under ``persist`` the KV
stays as computed. Every switch also discards the forward megatron's asynchronous scheduling launched
ahead with the old weights (its logits would give the next token; megatron runs it again at its next
step, as after a prefill), so every token after a switch comes from the new weights.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megafleet_engine.backends.megatron import build
from megafleet_protocol import vocabulary

__all__ = ["KvCache", "check_mode", "invalidate_prefixes"]

log = logging.getLogger(__name__)


def check_mode(kv_cache_mode: str) -> None:
    if kv_cache_mode not in ("persist", "offload", "recompute"):
        raise ValueError(f"unknown KV-cache mode {kv_cache_mode!r}: persist, offload or recompute")


def invalidate_prefixes(allocator: Any) -> int:
    """Forget every prefix hash megatron's ``KVBlockAllocator`` registered (see the module docstring);
    returns how many blocks were registered. Nothing to do with prefix caching off. Runs in
    inference mode whatever the caller's (a refit's thread is not): the allocator's tensors were made
    in it, and torch refuses in-place updates of those outside it."""
    if not getattr(allocator, "enable_prefix_caching", False):
        return 0
    with torch.inference_mode():
        return _invalidate(allocator)


def _invalidate(allocator: Any) -> int:
    registered = torch.nonzero(allocator.block_hashes != -1, as_tuple=True)[0]
    if registered.numel() == 0:
        allocator.kv_hash_to_block_id.clear()
        return 0
    held = allocator.block_ref_counts[registered] > 0
    allocator._deregister_blocks(registered[~held])  # cached, held by nobody: back to the free pool
    kept = registered[held]
    allocator.block_hashes[kept] = -1  # a running request's own blocks: unmatched from now on
    if hasattr(allocator, "block_parent_id"):  # the LRU policy's chain bookkeeping
        allocator.block_parent_id[kept] = -1
        allocator.block_child_count[kept] = 0
        allocator.block_timestamps[kept] = 0
    allocator.kv_hash_to_block_id.clear()
    return int(registered.numel())


class KvCache:
    """megatron's ``engine`` on this rank (CUDA ``device``), built with ``built_mode`` (the KV-cache
    mode its context was allocated for: ``offload`` has the pinned host copy)."""

    def __init__(self, engine: Any, built_mode: vocabulary.KvCacheMode, device: int) -> None:
        self.engine = engine
        self.built_mode = built_mode
        self.device = device
        self.suspended = False
        self.kept = False
        """Suspended with the running sequences kept: the next switch (or the unpause) resumes."""
        self.mode: vocabulary.KvCacheMode | None = None
        """The mode of the suspension in force (megatron's own mode, after :meth:`effective`)."""
        self.recomputed_tokens = 0
        """Tokens of the running sequences checkpointed by the last keeping ``recompute`` suspend."""

    def effective(self, kv_cache_mode: vocabulary.KvCacheMode) -> vocabulary.KvCacheMode:
        """megatron's mode for ``kv_cache_mode``: its offload needs the pinned host copy it
        allocates with the KV buffer, so without it an offload frees the KV buffer as recompute does
        (only with nothing in flight: a keeping offload needs it, see :meth:`suspend`)."""
        if kv_cache_mode == "offload" and self.built_mode != "offload":
            return "recompute"
        return kv_cache_mode

    def suspend(self, kv_cache_mode: vocabulary.KvCacheMode, *, keep: bool = False) -> None:
        """Suspend megatron's engine for a refit; ``keep``: with its running requests kept
        (``persist`` then only waits for the work already launched, which reads the weights about
        to be written). Idempotent."""
        torch.cuda.set_device(self.device)
        if self.suspended:
            return
        if keep and kv_cache_mode == "offload" and self.built_mode != "offload":
            raise ValueError("keeping sequences under offload needs a backend built with kv_cache_mode='offload'")
        if not keep and self.engine.has_unfinished_requests():
            raise RuntimeError("a weight update cannot begin while megatron's engine has requests in flight")
        if keep and kv_cache_mode == "persist":
            torch.cuda.synchronize(self.device)
            return
        effective = self.effective(kv_cache_mode)
        self.recomputed_tokens = self._running_tokens() if keep and effective == "recompute" else 0
        self._set_mode(effective)  # read by megatron's suspend() and resume()
        self.engine.suspend()
        if effective != "persist":
            torch.cuda.empty_cache()
        self.suspended, self.kept, self.mode = True, keep, effective

    def resume(self, kv_cache_mode: vocabulary.KvCacheMode | None = None) -> None:
        """Resume megatron's engine (its suspension's mode). Not suspended: nothing, except that a
        ``recompute`` still drops and rebuilds the KV cache (with nothing in flight). Idempotent."""
        torch.cuda.set_device(self.device)
        if not self.suspended:
            if kv_cache_mode != "recompute":
                return
            self.suspend(kv_cache_mode)
        kept = self.kept
        self.engine.resume()
        self._set_mode(self.built_mode)
        self.suspended, self.kept, self.mode = False, False, None
        if kept:
            self.discard_launched_forward()

    def switch(self, kv_cache_mode: vocabulary.KvCacheMode) -> tuple[int, float]:
        """The weights changed under the running requests: apply ``kv_cache_mode`` before the next
        step. Returns the tokens recomputed (``recompute``: every running sequence's prompt and
        generated tokens, prefilled at megatron's next step) and the seconds the switch took here
        (megatron's suspend and resume: the KV buffer freed and allocated, graphs captured again).
        With nothing in flight there is nothing to recompute (prefix caching is off: no later
        request reads the KV cache), so megatron's engine is left as it is."""
        started = time.perf_counter()
        running = self.suspended or self.engine.has_unfinished_requests()
        if kv_cache_mode == "recompute" and self.mode != "recompute" and running:
            self.resume()  # an offload suspension of the same refit brings its KV back first
            self.suspend("recompute", keep=True)
        recomputed = self.recomputed_tokens if kv_cache_mode == "recompute" else 0
        self.resume()
        self.discard_launched_forward()
        self.recomputed_tokens = 0
        return recomputed, time.perf_counter() - started

    def discard_launched_forward(self) -> None:
        """Drop the logits of the forward megatron's asynchronous scheduling launched ahead (with
        the weights live then, over requests a recompute may have checkpointed since): its next
        step runs that forward again, as after a prefill. Nothing pending in the ordinary step order."""
        pending = getattr(self.engine.controller, "_async_sched_logits", None)
        if pending is not None and getattr(pending, "is_valid", False):
            pending.clear()

    def _set_mode(self, kv_cache_mode: vocabulary.KvCacheMode) -> None:
        modes = build.megatron_core("inference.config").KVCacheManagementMode
        self.engine.context.kv_cache_management_mode = modes(kv_cache_mode)

    def _running_tokens(self) -> int:
        """The prompt and generated tokens of megatron's active requests (those a recompute
        suspend checkpoints; waiting ones have no KV yet)."""
        waiting = set(self.engine.waiting_request_ids)
        total = 0
        for request_id in self.engine.requests:
            if request_id not in waiting:
                request = self.engine.get_request(request_id)
                total += len(request.prompt_tokens) + len(request.generated_tokens)
        return total
