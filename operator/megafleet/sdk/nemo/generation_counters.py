"""Generation counters for NeMo RL's logger and step metrics (``get_logger_metrics``,
``get_step_metrics``); thread-safe, because the async collector generates from many threads.

Called by :class:`~megafleet.sdk.nemo.MegafleetGeneration` after every generation and when NeMo RL
reads or clears its metrics. Not Prometheus metrics (those are the engine's and the operator's
``metrics`` modules): plain totals NeMo RL logs under ``megafleet/``, counted by the adapter that
generated (in async GRPO, the trajectory collector's copy).

Besides requests, generated tokens and truncated answers: ``samples_spanning_refit`` (answers whose
tokens came from more than one weight version: a refit kept them running) and
``tokens_older_than_latest`` (tokens of an answer generated with an older version than its last
token's).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from megafleet.sdk import generation

__all__ = ["Counters"]


class Counters:
    """Totals since creation, and the marks each of NeMo RL's two views counts from."""

    NAMES = ("requests", "generated_tokens", "truncated", "samples_spanning_refit", "tokens_older_than_latest")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = dict.fromkeys(self.NAMES, 0)
        self._logger = dict.fromkeys(self.NAMES, 0)
        self._step = dict.fromkeys(self.NAMES, 0)

    def add(self, answers: Sequence[generation.Answer]) -> None:
        with self._lock:
            self._total["requests"] += len(answers)
            self._total["generated_tokens"] += sum(len(answer.token_ids) for answer in answers)
            self._total["truncated"] += sum(answer.finish_reason == "length" for answer in answers)
            for answer in answers:
                older = _older_than_latest(answer)
                self._total["samples_spanning_refit"] += older > 0
                self._total["tokens_older_than_latest"] += older

    def clear(self) -> None:
        with self._lock:
            self._logger = dict(self._total)

    def snapshot(self) -> None:
        with self._lock:
            self._step = dict(self._total)

    def logger(self) -> dict[str, Any]:
        with self._lock:
            return {f"megafleet/{name}": self._total[name] - self._logger[name] for name in self.NAMES}

    def step(self) -> dict[str, float]:
        with self._lock:
            return {f"megafleet/{name}": float(self._total[name] - self._step[name]) for name in self.NAMES}


def _older_than_latest(answer: generation.Answer) -> int:
    """Generated tokens of ``answer`` whose weight version is older than its last token's (0 for an
    answer of one version, or of unknown versions)."""
    latest = answer.last_weight_version
    if latest is None:
        return 0
    return sum(version is not None and version < latest for version in answer.token_weight_versions)
