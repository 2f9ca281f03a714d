"""An independent NeMo RL trainer for the tests of the fleet's side of NeMo's own refit collective
(it holds no tests). Written from the description of NeMo's wire (docs/refit-protocol.md, "NeMo RL's
collective"), not from the receiver's code (:mod:`megafleet_protocol.refit.nemo`): a ``TCPStore``
master at rank 0 that waits for every rank, the unique id under NeMo's or vLLM's key, the warm-up of
that generation, then NeMo's packing (raw bytes back to back, a bucket closing once its size exceeds
the target) broadcast over gloo (standing in for NCCL, over the same store under a prefix both ends
agree on). Every trainer rank takes part, as in NeMo.

* :func:`trainer_rank`: one trainer rank, refit after refit over one world.
* :func:`nemo_buckets`: NeMo's producer loop; :func:`vllm_pickled_id`: vLLM's pickled unique id.
* :func:`running`: run ranks on threads and collect what they raised.
* :class:`PolicyWorkers`: NeMo RL's policy side (T ranks, weights per step) for a Ray actor.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import itertools
import os
import pickle
import queue
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from helpers import refit_harness as harness

ADDRESS = harness.TRAINER_ADDRESS
GLOO_PREFIX = "test-gloo/"
AGENT_GLOO_PREFIX = "megafleet/nemo-gloo/"
"""The gloo stand-in's store prefix as the engine's agent uses it (documented with the wire)."""


def vllm_pickled_id(raw: bytes) -> bytes:
    """What vLLM's ``broadcast_obj`` stores for its ctypes ``ncclUniqueId`` (a 128-byte Structure of
    vLLM's ``pynccl_wrapper`` module), built with a stand-in module of that name."""
    name = "vllm.distributed.device_communicators.pynccl_wrapper"

    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = name, "ncclUniqueId"
    module = types.ModuleType(name)
    module.ncclUniqueId = ncclUniqueId  # type: ignore[attr-defined]
    unique = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(unique), raw, 128)
    parents = ["vllm", "vllm.distributed", "vllm.distributed.device_communicators"]
    stand_ins = {parent: types.ModuleType(parent) for parent in parents} | {name: module}
    assert not set(stand_ins) & set(sys.modules), "vLLM must not be importable here"
    sys.modules.update(stand_ins)
    try:
        return pickle.dumps(unique, protocol=4)
    finally:
        for stand_in in stand_ins:
            del sys.modules[stand_in]


def nemo_buckets(tensors: list[torch.Tensor], target: int) -> list[list[torch.Tensor]]:
    """NeMo's producer loop: append each tensor's bytes, close the bucket once its size exceeds the
    target; the partial last bucket goes if it holds any tensor."""
    buckets: list[list[torch.Tensor]] = []
    parts: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        size += flat.numel()
        if size > target:
            buckets.append(parts)
            parts, size = [], 0
    if parts:
        buckets.append(parts)
    return buckets


def trainer_rank(
    rank: int,
    *,
    port: int,
    world_size: int,
    tensors: list[torch.Tensor],
    target: int,
    generation: Literal["nemo", "vllm"],
    unique_id: bytes,
    sent: list[int],
    later: Iterable[list[torch.Tensor]] = (),
    prefix: str = GLOO_PREFIX,
    joined: threading.Event | None = None,
) -> None:
    """One NeMo trainer rank: rank 0 hosts the store (its constructor returns once every rank
    connected) and publishes the id; every rank builds the world group, warms up (then sets
    ``joined``) and broadcasts ``tensors``, then each refit of ``later`` (which may block until the
    test hands over the next one), over the same world."""
    timeout = datetime.timedelta(seconds=30)
    if rank == 0:
        store = c10d.TCPStore(ADDRESS, port, world_size, True, timeout, wait_for_workers=True)
        writer: Any = store  # torch's stubs type values as str; bytes are what NeMo stores
        if generation == "nemo":
            writer.set("nccl_unique_id", unique_id)
        else:
            writer.set("broadcast_from/0/0", vllm_pickled_id(unique_id))
    else:
        store = c10d.TCPStore(ADDRESS, port, world_size, False, timeout)
        store.wait(["nccl_unique_id" if generation == "nemo" else "broadcast_from/0/0"])
    distributed: Any = dist
    options = distributed.ProcessGroupGloo._Options()
    options._devices = [distributed.ProcessGroupGloo.create_device(hostname=ADDRESS)]
    options._timeout = datetime.timedelta(seconds=20)
    group = distributed.ProcessGroupGloo(c10d.PrefixStore(prefix, store), rank, world_size, options)
    if generation == "nemo":
        data = torch.ones(1) if rank == 0 else torch.zeros(1)
        group.broadcast([data]).wait()
    else:
        data = torch.zeros(1)
        group.allreduce([data]).wait()
    if joined is not None:
        joined.set()
    for refit in itertools.chain([tensors], later):  # one world, refit after refit
        for parts in nemo_buckets(refit, target):
            buffer = torch.cat(parts)
            group.broadcast([buffer]).wait()
            if rank == 0:
                sent.append(buffer.numel())


@contextlib.contextmanager
def running(*targets: Callable[[], None], timeout: float = 60.0) -> Iterator[list[BaseException]]:
    """Run ``targets`` on threads; after the block, join them and collect what they raised."""
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:
                failures.append(error)

        return run

    threads = [threading.Thread(target=guarded(target), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    try:
        yield failures
    finally:
        for thread in threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in threads), "a rank is still blocked"


class PolicyWorkers:
    """NeMo RL's policy side of a non-colocated GRPO run, for end-to-end tests: ``train_world_size``
    trainer ranks (threads of :func:`trainer_rank`) of a tiny Llama whose weights change per step.
    Made a Ray actor by the test (``ray.remote(PolicyWorkers)``), so it runs in its own process, as
    NeMo's policy workers do; its methods are the ``Policy`` calls GRPO makes, each returning once
    every rank is done (GRPO ``ray.get``s their futures).

    Weights of step ``s`` are :func:`step_source` ``(s)``'s; the wire is NeMo's (``nemo`` generation),
    over gloo under the agent's store prefix. The bucket target is NeMo's own rule for a GPU of
    ``gpu_memory_bytes`` (vLLM's legacy order), or ``bucket_bytes`` (what the collective synchronizer
    got from the generation's sender spec; each broadcast names it again and must match: the ranks
    pack with one target per world).
    """

    def __init__(
        self,
        *,
        gpu_memory_bytes: int | None = None,
        ratio: float = 0.02,
        bucket_bytes: int | None = None,
        timeout: float = 120.0,
    ) -> None:
        from megafleet_engine.models import tiny  # the engines' model family; imported in the actor

        self._tiny = tiny
        if bucket_bytes is None:
            assert gpu_memory_bytes is not None, "give gpu_memory_bytes or bucket_bytes"
            bucket_bytes = min(int(gpu_memory_bytes * ratio), 5 * 1024**3)  # NeMo's policy workers' rule
        self._target = bucket_bytes
        self._timeout = timeout
        self._queues: list[queue.Queue[list[torch.Tensor] | None]] = []
        self._finished = threading.Semaphore(0)
        self._running: contextlib.AbstractContextManager[list[BaseException]] | None = None
        self._failures: list[BaseException] = []
        self.sent: list[int] = []

    def weights(self, step: int) -> dict[str, torch.Tensor]:
        """The policy's tensors after training step ``step`` (HF names, in ``named_parameters`` order)."""
        return self._tiny.reference_weights(step_source(step))

    def prepare_refit_info(self) -> dict[str, tuple[list[int], str]]:
        """NeMo's ``{name: (shape, dtype)}`` in the order every broadcast packs."""
        return {name: (list(tensor.shape), str(tensor.dtype)) for name, tensor in self.weights(0).items()}

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> bool:
        """Every rank joins NeMo's world (rank 0 hosts the store); returns once all warmed up."""
        assert ip == ADDRESS, f"the trainer's store listens on {ADDRESS}"
        unique_id = bytes(range(128))
        joined = [threading.Event() for _ in range(train_world_size)]
        self._queues = [queue.Queue() for _ in range(train_world_size)]
        ranks = [
            functools.partial(
                trainer_rank,
                rank,
                port=port,
                world_size=world_size,
                tensors=[],
                target=self._target,
                generation="nemo",
                unique_id=unique_id,
                sent=self.sent,
                later=self._feed(self._queues[rank]),
                prefix=AGENT_GLOO_PREFIX,
                joined=joined[rank],
            )
            for rank in range(train_world_size)
        ]
        self._running = running(*ranks, timeout=self._timeout)
        self._failures = self._running.__enter__()
        for event in joined:
            if not event.wait(self._timeout):
                raise TimeoutError(f"trainer ranks did not join in {self._timeout} s: {self._failures}")
        return True

    def broadcast_weights_for_collective(self, step: int, buffer_size_bytes: int | None = None) -> int:
        """Every rank broadcasts step ``step``'s weights in NeMo's packing; returns the buckets sent."""
        if buffer_size_bytes is not None and buffer_size_bytes != self._target:
            raise ValueError(f"the ranks pack with {self._target} bytes, not buffer_size_bytes={buffer_size_bytes}")
        before = len(self.sent)
        tensors = list(self.weights(step).values())
        for pending in self._queues:
            pending.put(tensors)
        for _ in self._queues:
            if not self._finished.acquire(timeout=self._timeout):
                raise TimeoutError(f"a trainer rank is still broadcasting after {self._timeout} s: {self._failures}")
        if self._failures:
            raise RuntimeError(f"a trainer rank failed: {self._failures}")
        return len(self.sent) - before

    def shutdown(self) -> list[str]:
        """End every rank; what they raised, as text."""
        for pending in self._queues:
            pending.put(None)
        if self._running is not None:
            with contextlib.suppress(AssertionError):
                self._running.__exit__(None, None, None)
        return [repr(failure) for failure in self._failures]

    def _feed(self, pending: queue.Queue[list[torch.Tensor] | None]) -> Iterator[list[torch.Tensor]]:
        """The refits one rank sends: the next is asked for once the previous one's buckets went out."""
        while (tensors := pending.get(timeout=self._timeout)) is not None:
            yield tensors
            self._finished.release()


def step_source(step: int) -> str:
    """The tiny model source of the policy after ``step`` (the fleet starts at ``tiny://llama``)."""
    return f"tiny://llama?seed={100 + step}"


class AgentTrainer:
    """NeMo's trainer rank 0 on a thread, in a world of itself and ``members`` inference ranks joined
    through the agent (the gloo prefix of :data:`AGENT_GLOO_PREFIX`): joins, sends ``first`` (if any),
    then broadcasts each version handed to :meth:`send` until :meth:`finish`."""

    def __init__(
        self, first: Mapping[str, torch.Tensor], bucket_bytes: int, *, members: int = 1, wait_seconds: float = 60.0
    ) -> None:
        self.port = harness.free_port()
        self.sent: list[int] = []
        self.joined = threading.Event()
        self._next: queue.Queue[list[torch.Tensor] | None] = queue.Queue()
        rank = functools.partial(
            trainer_rank,
            0,
            port=self.port,
            world_size=1 + members,
            tensors=list(first.values()),
            target=bucket_bytes,
            generation="nemo",
            unique_id=os.urandom(128),
            sent=self.sent,
            later=iter(functools.partial(self._next.get, timeout=wait_seconds), None),
            prefix=AGENT_GLOO_PREFIX,
            joined=self.joined,
        )
        self._running = running(rank)
        self.failures = self._running.__enter__()

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._next.put(list(weights.values()))

    def finish(self) -> None:
        self._next.put(None)
        self._running.__exit__(None, None, None)
        assert not self.failures, self.failures
