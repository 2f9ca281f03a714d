"""A NeMo-RL-style async trajectory collector for Ray tests: an actor that receives the generation
backend as a constructor argument (pickled by Ray, as NeMo RL's ``AsyncTrajectoryCollector`` receives
``policy_generation``) and runs each batch in a fresh thread under ``asyncio.run``, one-row batches
consumed through ``generate_async``, several threads at once.

Its refit path mirrors ``AsyncTrajectoryCollector`` (nemo_rl/algorithms/async_utils/
trajectory_collector.py at NVIDIA-NeMo/RL 7ea279a): :meth:`Collector.start` waits while a refit pauses
new starts and stamps the weight version current when it starts (``_process_batch``, :462-516);
:meth:`Collector.prepare_for_refit` pauses new starts and waits for the pending generations unless
the engine is async (``backend: megatron``) and ``in_flight_weight_updates`` is on (:606-667);
:meth:`Collector.resume_after_refit` asks ``invalidate_kv_cache()`` with
``recompute_kv_cache_after_weight_updates`` and then resumes (:669-702).

Used by tests/sdk/test_nemo_ray.py, tests/sdk/test_nemo_in_flight_flags.py (without Ray, on a pickled
copy), tests/e2e/test_sdk.py and tests/e2e/test_nemo_in_flight.py; the actor class is made with
``ray.remote(Collector)`` there. :func:`local_ray` starts the local Ray instance they use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from megafleet.sdk import nemo


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray instance (one CPU, no dashboard) whose workers import what this process imports
    (the repository's packages and tests/helpers, through ``PYTHONPATH``)."""
    import ray  # the tests that use it need ray; importing this module does not

    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


class Collector:
    """Holds the adapter it was given; :meth:`collect` generates and reports weight versions; the
    refit path (:meth:`start`, :meth:`prepare_for_refit`, :meth:`resume_after_refit`,
    :meth:`finish`) is NeMo RL's, read from ``master_config`` as it reads it."""

    def __init__(self, policy_generation: nemo.MegafleetGeneration, master_config: Any = None) -> None:
        self.policy_generation = policy_generation
        self.master_config = master_config or {}
        self.async_config = _field(_field(self.master_config, "grpo"), "async_grpo") or {}
        self.current_weight_version = 0
        self.invalidations: list[bool] = []
        """What each ``invalidate_kv_cache()`` after a refit answered."""
        self.waited_for_generations = 0
        """How many refits waited for the pending generations."""
        self._refit_pause_cleared = threading.Event()
        self._refit_pause_cleared.set()
        self._threads_lock = threading.Lock()
        self._inflight_threads: set[threading.Thread] = set()
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}
        self._failures: list[BaseException] = []
        self._batches = 0
        self._starters: list[threading.Thread] = []

    def connected(self) -> bool:
        return self.policy_generation.connected

    def invalidate_kv_cache(self) -> bool:
        return self.policy_generation.invalidate_kv_cache()

    def refit_record(self) -> tuple[list[bool], int]:
        """(:attr:`invalidations`, :attr:`waited_for_generations`), for a caller through Ray."""
        return list(self.invalidations), self.waited_for_generations

    def metrics(self) -> dict[str, Any]:
        """The copy's ``get_logger_metrics()``: it counts what it generated."""
        return self.policy_generation.get_logger_metrics()

    # -- NeMo RL's async refit path ---------------------------------------------------------------

    def set_weight_version(self, version: int) -> None:
        self.current_weight_version = version

    def start(self, prompts: list[list[int]], greedy: bool = True, together: bool = False) -> int:
        """Start one batch on a new thread under ``asyncio.run`` and return its number at once: one-row
        ``generate_async`` calls (NeMo's per-sample rollouts), or with ``together`` one call for the
        whole batch (NeMo's ``generate_responses_async``; the adapter then sends one request per
        frontend, which a batch-at-a-time engine starts together). The thread waits first while a
        refit pauses new starts."""
        batch = self._batches
        self._batches += 1

        def run(stamped: int) -> None:
            try:
                asyncio.run(self._generate(batch, prompts, greedy, stamped, together))
            except BaseException as error:  # reported by finish
                self._failures.append(error)

        def begin() -> None:  # NeMo's collection loop: a worker starts only once no refit pauses starts
            self._refit_pause_cleared.wait()
            worker = threading.Thread(target=run, args=(self.current_weight_version,), daemon=True)
            with self._threads_lock:
                self._inflight_threads.add(worker)
            worker.start()

        starter = threading.Thread(target=begin, daemon=True)
        self._starters.append(starter)
        starter.start()
        return batch

    def pending(self) -> int:
        """Batches still generating."""
        with self._threads_lock:
            return sum(thread.is_alive() for thread in self._inflight_threads)

    def prepare_for_refit(self) -> None:
        """Pause new starts; wait for the pending generations unless they stay in flight."""
        self._refit_pause_cleared.clear()
        if self._is_async_engine() and bool(_field(self.async_config, "in_flight_weight_updates")):
            return  # "ongoing generations will continue with their current KV caches"
        self.waited_for_generations += 1
        self.wait_for_pending_generations()

    def resume_after_refit(self) -> None:
        """Ask ``invalidate_kv_cache()`` with the recompute flag, then resume new starts."""
        try:
            if _field(self.async_config, "recompute_kv_cache_after_weight_updates"):
                self.invalidations.append(bool(self.policy_generation.invalidate_kv_cache()))
        finally:
            self._refit_pause_cleared.set()

    def wait_for_pending_generations(self) -> None:
        with self._threads_lock:
            threads = list(self._inflight_threads)
        for thread in threads:
            thread.join()
        with self._threads_lock:
            self._inflight_threads -= {thread for thread in threads if not thread.is_alive()}

    def finish(self, batch: int) -> list[dict[str, Any]]:
        """Wait for every batch; batch ``batch``'s samples in order: generated tokens, logprobs,
        ``token_weight_versions``, the first and last versions and the collector's own stamp."""
        for starter in self._starters:
            starter.join()
        self.wait_for_pending_generations()
        if self._failures:
            raise self._failures[0]
        indexes = sorted(index for found, index in self._rows if found == batch)
        return [self._rows[(batch, index)] for index in indexes]

    async def _generate(self, batch: int, prompts: list[list[int]], greedy: bool, stamped: int, together: bool) -> None:
        async def rows(indexes: list[int]) -> None:
            width = max(len(prompts[index]) for index in indexes)
            data = {
                "input_ids": torch.tensor([prompts[index] + [0] * (width - len(prompts[index])) for index in indexes]),
                "input_lengths": torch.tensor([len(prompts[index]) for index in indexes]),
                "stop_strings": [None] * len(indexes),
            }
            async for row, single in self.policy_generation.generate_async(data, greedy=greedy):
                prompt = prompts[indexes[row]]
                generated = slice(len(prompt), len(prompt) + int(single["generation_lengths"][0]))
                self._rows[(batch, indexes[row])] = {
                    "tokens": single["output_ids"][0, generated].tolist(),
                    "logprobs": single["logprobs"][0, generated].tolist(),
                    "token_weight_versions": single["token_weight_versions"][0, generated].tolist(),
                    "weight_version": int(single["weight_versions"][0]),
                    "last_weight_version": int(single["last_weight_versions"][0]),
                    "generation_weight_version": stamped,
                    "truncated": bool(single["truncated"][0]),
                }

        everything = list(range(len(prompts)))
        await asyncio.gather(*([rows(everything)] if together else [rows([index]) for index in everything]))

    def _is_async_engine(self) -> bool:
        """NeMo's test: ``policy.generation.backend`` megatron, or vLLM with ``async_engine``."""
        generation_cfg = _field(_field(self.master_config, "policy"), "generation") or {}
        backend = _field(generation_cfg, "backend")
        if backend == "vllm":
            return bool(_field(_field(generation_cfg, "vllm_cfg"), "async_engine"))
        return bool(backend == "megatron")

    def collect(self, prompts: list[list[int]], threads: int = 2) -> list[dict[str, Any]]:
        """Every prompt as a one-row batch, split over ``threads`` threads that each run their share
        under their own ``asyncio.run``; returns per prompt its generated tokens and weight version."""
        results: dict[int, dict[str, Any]] = {}
        failures: list[BaseException] = []

        async def run(share: list[int]) -> None:
            async def one(index: int) -> None:
                prompt = prompts[index]
                data = {
                    "input_ids": torch.tensor([prompt]),
                    "input_lengths": torch.tensor([len(prompt)]),
                    "stop_strings": [None],
                }
                async for row, single in self.policy_generation.generate_async(data, greedy=True):
                    assert row == 0
                    length = int(single["generation_lengths"][0])
                    results[index] = {
                        "tokens": single["output_ids"][0, len(prompt) : len(prompt) + length].tolist(),
                        "weight_version": int(single["weight_versions"][0]),
                        "truncated": bool(single["truncated"][0]),
                    }

            await asyncio.gather(*(one(index) for index in share))

        def worker(share: list[int]) -> None:
            try:
                asyncio.run(run(share))
            except BaseException as error:  # reported to the caller below
                failures.append(error)

        shares = [list(range(len(prompts)))[start::threads] for start in range(threads)]
        started = [threading.Thread(target=worker, args=(share,)) for share in shares]
        for thread in started:
            thread.start()
        for thread in started:
            thread.join()
        if failures:
            raise failures[0]
        return [results[index] for index in range(len(prompts))]


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` of a mapping, ``obj.name`` of an object (NeMo's pydantic configs); None if absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)
