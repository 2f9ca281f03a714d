"""NeMo RL's policy side of a non-colocated GRPO run with ``refit_transport: nccl_reshard``, for
end-to-end tests (it holds no tests): ``pp x tp`` trainer ranks (threads running the steps of
:mod:`helpers.nemo_reshard_trainer`) of a tiny Llama whose weights change per step. Made a Ray actor
by the test (``ray.remote(ReshardPolicyWorkers)``), so it runs in its own process as NeMo's policy
workers do; its methods are the ``Policy`` calls NeMo's ``NcclReshardWeightSynchronizer`` makes, each
returning once every rank is done (the synchronizer ``ray.get``s them with the generation side's):
``init_collective``, ``init_nccl_reshard_comm_group``, ``prepare_nccl_reshard_refit_info`` and, per
step, ``nccl_reshard_refit``.

Weights of step ``s`` are :func:`helpers.nemo_trainer.step_source` ``(s)``'s; NeMo's world and the
stage communicators are gloo (NCCL's stand-in) under the engine agent's store prefixes.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Sequence
from typing import Any

from helpers import nemo_reshard_trainer as trainer
from helpers import nemo_trainer


class ReshardPolicyWorkers:
    """The trainer ranks of ``layout`` (its ``gen_ranks``: the fleet's), packing the misc tensors in
    buckets of ``bucket_bytes``; ``timeout`` bounds every wait (a store's, a group's operation, a call's)."""

    def __init__(self, *, layout: trainer.Layout, bucket_bytes: int, timeout: float = 120.0) -> None:
        from megafleet_engine.models import tiny  # the engines' model family; imported in the actor

        self._tiny = tiny
        self.layout = layout
        self._bucket = bucket_bytes
        self._timeout = timeout
        self._stage_ports: list[queue.Queue[int]] = []
        self._refits: list[queue.Queue[Any]] = []
        self._done = threading.Semaphore(0)
        self._misc_joined: list[threading.Event] = []
        self._stage_joined: list[threading.Event] = []
        self._running: contextlib.AbstractContextManager[list[BaseException]] | None = None
        self._failures: list[BaseException] = []
        self.sent: list[tuple[int, str, int]] = []

    def weights(self, step: int) -> dict[str, Any]:
        return self._tiny.reference_weights(nemo_trainer.step_source(step))

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> bool:
        """Every rank joins NeMo's world (the misc tensors'); returns once all warmed up."""
        assert ip == trainer.ADDRESS and train_world_size == self.layout.train_ranks
        assert world_size == train_world_size + self.layout.gen_ranks
        ranks = range(train_world_size)
        self._stage_ports = [queue.Queue() for _ in ranks]
        self._refits = [queue.Queue() for _ in ranks]
        self._misc_joined = [threading.Event() for _ in ranks]
        self._stage_joined = [threading.Event() for _ in ranks]
        self._running = nemo_trainer.running(
            *(functools.partial(self._rank, rank, port) for rank in ranks), timeout=self._timeout
        )
        self._failures = self._running.__enter__()
        return self._wait(self._misc_joined, "joined NeMo's world")

    def init_nccl_reshard_comm_group(
        self,
        *,
        pp_ips: Sequence[str],
        pp_ports: Sequence[int],
        pp_size: int,
        pp_stages: Sequence[int],
        sub_world_size: int,
        ranks_in_group: Sequence[int],
    ) -> bool:
        """Every rank joins its stage's communicator (``pp_stages[rank]``, at ``ranks_in_group[rank]``)."""
        assert pp_size == self.layout.pp and sub_world_size == self.layout.tp + self.layout.gen_ranks
        for rank, pending in enumerate(self._stage_ports):
            assert pp_ips[pp_stages[rank]] == trainer.ADDRESS and ranks_in_group[rank] == rank % self.layout.tp
            pending.put(pp_ports[pp_stages[rank]])
        return self._wait(self._stage_joined, "joined its stage's communicator")

    def prepare_nccl_reshard_refit_info(self) -> dict[str, Any]:
        """NeMo's refit info in its wire-safe form (what the synchronizer hands the generation side)."""
        return trainer.refit_info(self.weights(0), self.layout)

    def nccl_reshard_refit(self, step: int) -> int:
        """Every rank sends step ``step``'s slices and the misc broadcast; the bulk bytes sent."""
        before = sum(count for _, _, count in self.sent)
        weights = self.weights(step)
        for pending in self._refits:
            pending.put(weights)
        for _ in self._refits:
            if not self._done.acquire(timeout=self._timeout):
                raise TimeoutError(f"a trainer rank is still sending after {self._timeout} s: {self._failures}")
        if self._failures:
            raise RuntimeError(f"a trainer rank failed: {self._failures}")
        return sum(count for _, _, count in self.sent) - before

    def shutdown(self) -> list[str]:
        """End every rank; what they raised, as text."""
        for pending in self._refits:
            pending.put(None)
        if self._running is not None:
            with contextlib.suppress(AssertionError):
                self._running.__exit__(None, None, None)
        return [repr(failure) for failure in self._failures]

    def _rank(self, rank: int, port: int) -> None:
        layout, timeout = self.layout, self._timeout
        misc = trainer.join_misc(rank, layout=layout, port=port, prefix=nemo_trainer.AGENT_GLOO_PREFIX, timeout=timeout)
        self._misc_joined[rank].set()
        stage = trainer.join_stage(
            rank, layout=layout, port=self._stage_ports[rank].get(timeout=timeout), timeout=timeout
        )
        self._stage_joined[rank].set()
        while (weights := self._refits[rank].get(timeout=timeout)) is not None:
            groups = (stage, misc)
            trainer.send_refit(
                rank, layout=layout, weights=weights, groups=groups, bucket_bytes=self._bucket, sent=self.sent
            )
            self._done.release()

    def _wait(self, events: list[threading.Event], what: str) -> bool:
        for event in events:
            if not event.wait(self._timeout):
                raise TimeoutError(f"trainer ranks have not {what} in {self._timeout} s: {self._failures}")
        return True
