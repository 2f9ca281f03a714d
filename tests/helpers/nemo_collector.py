"""A NeMo-RL-style async trajectory collector for Ray tests: an actor that receives the generation
backend as a constructor argument (pickled by Ray, as NeMo RL's ``AsyncTrajectoryCollector`` receives
``policy_generation``) and runs each batch in a fresh thread under ``asyncio.run``, one-row batches
consumed through ``generate_async``, several threads at once.

Used by tests/sdk/test_nemo_ray.py and tests/e2e/test_sdk.py; the actor class is made with
``ray.remote(Collector)`` there. :func:`local_ray` starts the local Ray instance both use.
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
    """Holds the adapter it was given; :meth:`collect` generates and reports weight versions."""

    def __init__(self, policy_generation: nemo.MegafleetGeneration) -> None:
        self.policy_generation = policy_generation

    def connected(self) -> bool:
        return self.policy_generation.connected

    def invalidate_kv_cache(self) -> bool:
        return self.policy_generation.invalidate_kv_cache()

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
