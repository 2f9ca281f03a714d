"""The megatron backend's sampler: NeMo RL's filter (:mod:`megafleet_engine.backends.sampling`)
inside megatron's engine, and per-request raw log-probabilities.

Called by megatron's ``TextGenerationController`` at every step, in place of megatron-core's
``TorchSampling`` (:func:`install` swaps it in; :class:`.batch_runner.Runner` does so once per
engine): ``sample_kernel`` draws each active request's token and ``log_probs_kernel`` computes the
log-probabilities megatron returns (the engine is built with ``logprobs_mode="processed_logprobs"``
by :func:`.build.build_engine`, so megatron asks this sampler for them; top-n alternatives are taken
from the same rows). megatron-core 0.19's own ``TorchSampling`` refuses top-k together with top-p,
filters the bfloat16 logits, and cuts top-p with a descending cumulative sum, which differs from
NeMo's trainer at the boundary; this one takes both, filters in float32 and follows NeMo exactly.

Per request, from megatron's per-request metadata: ``(temperature, top_k, top_p)`` (megatron's
``top_p == 0`` means no nucleus cut, as does ``>= 1``); greedy (``top_k == 1`` or temperature 0) is
the argmax with raw log-probabilities. Requests whose megatron id is in
:attr:`NemoSampling.raw_request_ids` (kept by the runner on every rank) get raw log-probabilities
(``log_softmax`` of the logits) whatever they sample with. Imports no megatron: it only reads the
context megatron hands it.

No host synchronisation: megatron calls the sampler between launching a forward pass and
reading its tokens back, and with asynchronous scheduling it launches the next forward right after
it, so a sampler that waits for the GPU stalls the launch queue. The request metadata megatron
hands over is in pinned host memory (reading it waits for nothing); when every active request
samples alike (the common case: a greedy or uniformly sampled RL batch) the rows are the first
``n`` of the logits, taken as a slice, with no index tensor; otherwise each bucket's row index
travels from pinned memory without blocking. :attr:`NemoSampling.sync_free` turns both off (the
benchmark's A/B baseline: per-bucket index tensors copied with a blocking host-to-device copy).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from megafleet_engine.backends import base, sampling
from megafleet_engine.backends.megatron import build

__all__ = ["NemoSampling", "install"]


class NemoSampling:
    """What megatron's controller calls on its sampler (``megatron.core.inference.sampling``'s
    ``Sampling`` interface, without speculative decoding), with NeMo's filter.

    ``rng``: megatron's sampling generator (the same seed on every rank of a shard, so ranks draw
    alike); ``vocab_size``: the model's (padded) vocabulary, the bound sampled ids are clamped to.
    """

    def __init__(self, rng: torch.Generator, vocab_size: int) -> None:
        self._rng = rng
        self._vocab_size = vocab_size
        self.raw_request_ids: set[int] = set()
        """megatron request ids whose log-probabilities are raw; the runner adds and removes them."""
        self.sync_free = True
        """Sample without host synchronisation (see the module's docstring); ``False`` is the old
        per-bucket path, kept for the benchmark's A/B."""

    def sample_kernel(
        self,
        logits: torch.Tensor,
        n: int,
        context: Any,
        *,
        no_top_k: bool,
        no_top_p: bool,
        gather_indices: torch.Tensor | None = None,
        token_to_request_index: torch.Tensor | None = None,
        output: torch.Tensor | None = None,
        eager: bool = False,
        cache_key: Any = None,
    ) -> torch.Tensor:
        """One token for each of the ``n`` active requests (rows of ``logits``, or
        ``logits[gather_indices[:n]]``), drawn bucket by bucket of equal parameters; written into
        ``output`` when given. The batch-level flags and graph arguments do not apply here."""
        del no_top_k, no_top_p, eager, cache_key
        if gather_indices is not None:
            logits = logits[gather_indices[:n], :]
        if output is None:
            output = torch.empty(n, device=logits.device, dtype=torch.int64)
        knobs = _knobs(context)
        if self.sync_free and token_to_request_index is None and knobs and knobs.count(knobs[0]) == len(knobs):
            temperature, top_k, top_p = knobs[0]
            drawn = sampling.sample(
                logits[: len(knobs), :], temperature=temperature, top_k=top_k, top_p=top_p, generator=self._rng
            )
            torch.clamp(drawn, 0, self._vocab_size - 1, out=output[: len(knobs)])
            return output
        buckets: defaultdict[tuple[float, int, float], list[int]] = defaultdict(list)
        for request, request_knobs in enumerate(knobs):
            buckets[request_knobs].append(request)
        for (temperature, top_k, top_p), requests in buckets.items():
            index = self._index(requests, logits.device)
            if token_to_request_index is None:
                rows = index
            else:
                rows = torch.where(torch.isin(token_to_request_index, index.to(token_to_request_index.device)))[0]
                rows = rows.to(logits.device)
            drawn = sampling.sample(
                logits[rows, :], temperature=temperature, top_k=top_k, top_p=top_p, generator=self._rng
            )
            output[rows] = drawn.clamp(0, self._vocab_size - 1)
        return output

    def log_probs_kernel(
        self, logits: torch.Tensor, context: Any, *, token_to_request_index: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-row log-probabilities (float32 ``logits`` ``[rows, vocab]``): processed for each row's
        request, raw for requests in :attr:`raw_request_ids` and greedy ones. Row ``i`` belongs to
        active request ``token_to_request_index[i]`` (a CPU tensor), else to active request ``i``."""
        knobs = _knobs(context)
        first, last = context.paused_request_count, context.total_request_count
        request_ids = context.request_ids[first:last].tolist()
        owners = range(logits.shape[0]) if token_to_request_index is None else token_to_request_index.tolist()
        buckets: defaultdict[tuple[bool, float, int, float], list[int]] = defaultdict(list)
        for row, request in enumerate(owners):
            buckets[(int(request_ids[request]) in self.raw_request_ids, *knobs[request])].append(row)
        if self.sync_free and len(buckets) == 1:  # every row alike: no index tensor
            ((raw, temperature, top_k, top_p),) = buckets
            mode: base.LogprobsMode = "raw" if raw else "processed"
            return sampling.logprobs(logits, temperature=temperature, top_k=top_k, top_p=top_p, mode=mode).float()
        result = torch.empty_like(logits, dtype=torch.float32)
        for (raw, temperature, top_k, top_p), rows in buckets.items():
            index = self._index(rows, logits.device)
            mode = "raw" if raw else "processed"
            result[index] = sampling.logprobs(
                logits[index], temperature=temperature, top_k=top_k, top_p=top_p, mode=mode
            )
        return result

    def _index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """``rows`` as a device index tensor: through pinned memory without blocking when
        :attr:`sync_free`, else with a blocking copy (the old path)."""
        if not self.sync_free or device.type != "cuda":
            return torch.tensor(rows, device=device, dtype=torch.long)
        return torch.tensor(rows, dtype=torch.long).pin_memory().to(device, non_blocking=True)

    def sample_speculative(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Never called: the engine is built without speculative decoding."""
        raise NotImplementedError("the megatron backend's sampler does not do speculative decoding")


def _knobs(context: Any) -> list[tuple[float, int, float]]:
    """``(temperature, top_k, top_p)`` of each active request, in megafleet's meaning (``top_p``
    1.0 = no nucleus cut; megatron stores 0.0 for that)."""
    count = context.total_request_count - context.paused_request_count
    metadata = context.active_request_metadata
    temperatures = metadata["temperature"][:count].tolist()
    top_ks = metadata["top_k"][:count].tolist()
    top_ps = metadata["top_p"][:count].tolist()
    return [
        (float(temperature), int(top_k), float(top_p) if 0.0 < top_p < 1.0 else 1.0)
        for temperature, top_k, top_p in zip(temperatures, top_ks, top_ps, strict=True)
    ]


def install(controller: Any) -> NemoSampling:
    """Put a :class:`NemoSampling` in place of megatron's own sampler on ``controller`` (a
    ``TextGenerationController`` built with ``sampling_backend="torch"``) and return it."""
    torch_sampling = build.megatron_core("inference.sampling.torch_sampling")
    if not isinstance(controller._sampling, torch_sampling.TorchSampling):
        raise RuntimeError(f"megatron's controller samples with {type(controller._sampling).__name__}, not torch")
    sampler = NemoSampling(controller.sampling_rng, controller.vocab_size)
    controller._sampling = sampler
    return sampler
