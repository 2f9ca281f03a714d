"""The megatron backend's staging copy: one tensor beside each live megatron parameter, which a
staged refit writes while the engine keeps generating, and the memory rule that decides, once at
build, whether the copy is allocated.

Called by :class:`.backend.MegatronBackend`, which holds one :class:`Staging`: :func:`.backend.load`
has it apply the memory rule (:meth:`Staging.decide`) after the model, the KV buffer and the CUDA
graphs exist, so the copy never shrinks the KV cache the user sized; the backend hands out the copy's
views to the refit sinks and commits it at a weight switch. The copy mirrors the
backend's own tensors (megatron names, fused QKV and gate/up), so the Hugging Face views over it are
built exactly as over the live parameters (:class:`.live_weights.Weights` over the copy's tensors).
It is allocated once and reused by every refit: no refit allocates, fragments or runs out of memory
for it. The commit copies it into the live tensors in place (``torch._foreach_copy_`` on the calling
thread's stream, the engine's), never rebinding them: captured CUDA graphs read the live addresses.

The memory rule (``auto`` and ``required``; ``off`` allocates nothing)::

    P = bytes of this rank's parameters        B = receive buffers (two buckets)
    H = headroom                               F = free device memory + memory torch holds unallocated
    stage  <=>  F >= P + B + H

A model-parallel shard stages only if every rank can (the caller agrees across the ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megafleet_engine.backends import base
from megafleet_engine.backends.megatron import live_weights, lockstep
from megafleet_engine.backends.weight_maps import Layout, LlamaShape

__all__ = ["GIB", "MIB", "Decision", "Staging", "StagingCopy", "decide", "free_device_bytes"]

OFF = "staging is off (EngineOptions.staging)"

MIB = 1 << 20
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Decision:
    """The memory rule's outcome: ``stage``, or ``reason`` why not (the rule's numbers)."""

    stage: bool
    reason: str | None = None


def decide(*, free_bytes: int, parameter_bytes: int, buffer_bytes: int, headroom_bytes: int) -> Decision:
    """Whether a staging copy of ``parameter_bytes`` fits in ``free_bytes`` (``F``) beside the
    receive buffers (``B``) and the headroom (``H``)."""
    needed = parameter_bytes + buffer_bytes + headroom_bytes
    if free_bytes >= needed:
        return Decision(True)
    return Decision(
        False,
        f"needs {needed / GIB:.1f} GiB (P {parameter_bytes / GIB:.1f} + B {buffer_bytes / GIB:.1f} + "
        f"H {headroom_bytes / GIB:.1f} GiB), free {free_bytes / GIB:.1f} GiB",
    )


def free_device_bytes(device: int) -> int:
    """``F`` on ``device``: what the driver reports free plus what torch's allocator holds reserved
    but unallocated (it hands that out before asking the driver)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class StagingCopy:
    """One empty tensor beside each live megatron tensor (same shape, dtype and device), and the
    Hugging Face views over them."""

    def __init__(self, live: Callable[[], dict[str, torch.Tensor]], shape: LlamaShape, layout: Layout) -> None:
        self._live = live
        tensors = {name: torch.empty_like(tensor) for name, tensor in live().items()}
        self.weights = live_weights.Weights(lambda: dict(tensors), shape, layout)

    def views(self) -> dict[str, torch.Tensor]:
        """The staging copy as :meth:`.backend.MegatronBackend.parameters` shows the live weights."""
        return self.weights.views()

    def shard_map(self) -> base.ShardMap:
        """The staging copy as :meth:`.backend.MegatronBackend.shard_map` shows the live weights."""
        return self.weights.shard_map()

    @torch.no_grad()
    def commit(self) -> None:
        """Copy every staged tensor into its live tensor, in place, on the current stream."""
        live = self._live()
        staged = self.weights.live
        if set(live) != set(staged):
            raise RuntimeError("the live parameters no longer match the staging copy's")
        names = sorted(staged)
        torch._foreach_copy_([live[name] for name in names], [staged[name] for name in names])


class Staging:
    """This rank's staging state: the copy once allocated (over ``weights``' live tensors), or why
    there is none, and whether a commit waits for the next switch or resume."""

    def __init__(self, weights: live_weights.Weights, ranks: lockstep.Lockstep) -> None:
        self._weights = weights
        self._ranks = ranks
        self.copy: StagingCopy | None = None
        self.reason: str | None = OFF
        """Why this rank holds no copy (the memory rule's numbers); ``None`` once it holds one."""
        self._refused = False  # the memory rule said no at build
        self._decided = False  # the rule ran at build (a model-parallel shard decides only there)
        self.commit_pending = False
        """A staged refit committed: the next switch or resume copies the copy into the live weights."""

    def decide(self, *, buffer_bytes: int, headroom_bytes: int) -> None:
        """The memory rule, once, at build (every rank of the shard alike: the ranks agree, and the
        shard stages only if every rank has room); allocates the copy when it allows."""
        device = self._ranks.device
        torch.cuda.set_device(device)
        decision = decide(
            free_bytes=free_device_bytes(device),
            parameter_bytes=self._weights.bytes,
            buffer_bytes=buffer_bytes,
            headroom_bytes=headroom_bytes,
        )
        everyone = self._ranks.agree(decision.stage) if self._ranks.spans_ranks else decision.stage
        self._decided = True
        if everyone:
            self.prepare()
        else:
            self._refused = True
            self.reason = decision.reason or "another rank of this model-parallel shard has no room for its copy"

    def prepare(self) -> None:
        """Allocate the copy (idempotent). Without a decision at build, one rank allocates when asked
        (its caller applied the memory rule); raises if the build refused or the shard spans ranks."""
        if self.copy is not None:
            return
        if self._refused:
            raise RuntimeError(f"no staging copy: {self.reason}")
        if not self._decided and self._ranks.spans_ranks:
            raise RuntimeError("a model-parallel shard decides staging at build (EngineOptions.staging)")
        torch.cuda.set_device(self._ranks.device)
        self.copy = StagingCopy(self._weights.tensors, self._weights.shape, self._weights.layout)
        self.reason = None

    def held(self) -> StagingCopy:
        """The copy; raises when this rank holds none (saying why)."""
        if self.copy is None:
            raise RuntimeError(f"this engine holds no staging copy: {self.reason}")
        return self.copy

    def take_commit(self) -> bool:
        """Whether a commit waits (and it no longer does)."""
        pending, self.commit_pending = self.commit_pending, False
        return pending
