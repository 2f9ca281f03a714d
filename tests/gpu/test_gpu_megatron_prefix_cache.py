"""megatron-core's own prefix caching in the megatron backend (``EngineOptions.prefix_caching``), at
TP=1 on NVIDIA GPUs with megatron-core and flash-attention (skipped cleanly elsewhere):

* siblings (the samples of one prompt, prompts longer than one KV block) share their whole blocks:
  megatron reports skipped prefill tokens, and with caching on and off the greedy tokens agree (up to
  near-ties of bf16) at several batch sizes;
* the cache is tied to the weight version: after a refit in every mode the backend offers (drained in
  place under ``persist``, ``offload`` and ``recompute``; kept across a ``persist`` or ``recompute``
  switch; staged), a new batch of the same prompts gets a fresh engine's greedy tokens at the new
  weights (a second backend without caching), never tokens over blocks the old weights computed, and
  no registered hash survives the resume or switch;
* :func:`~megafleet_engine.backends.megatron.kv_cache.invalidate_prefixes` on megatron's real
  allocator returns the cached blocks nobody holds to the free pool.

With ``MEGAFLEET_GPU_REPORT=FILE`` set, the tests append what they measured to ``FILE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from helpers import gpu
from megafleet_engine.backends import base, megatron
from megafleet_engine.backends.megatron import kv_cache
from megafleet_protocol import vocabulary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu.GPU_SKIP is not None, reason=gpu.GPU_SKIP or ""),
    pytest.mark.filterwarnings("default"),  # megatron-core's and the kernels' own warnings
]

MAX_SEQUENCE_LENGTH = 1024
BLOCK = 256
"""megatron's default KV block (flash-attention's paged KV wants multiples of 256)."""
PROMPT_TOKENS = 2 * BLOCK + 40
"""Two whole blocks to share, and a partial one each sibling computes itself."""
NEW_TOKENS = 24
TIE = 0.1
"""Log-probability gap of the best two tokens under which two bf16 runs of one greedy step may differ."""
PARK_AT = 8
NEW_SEED = 7


def build(prefix_caching: bool, **options: Any) -> megatron.MegatronBackend:
    loaded = megatron.load(
        gpu.SOURCE,
        name="tiny",
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        options=megatron.EngineOptions(
            max_batch_size=32,
            kv_buffer_gb=1.0,
            max_step_tokens=32 * MAX_SEQUENCE_LENGTH,
            block_size_tokens=BLOCK,
            prefix_caching=prefix_caching,
            **options,
        ),
    )
    loaded.write_weights(gpu.scaled_reference_weights())
    return loaded


@pytest.fixture(scope="module")
def cached() -> Iterator[megatron.MegatronBackend]:
    loaded = build(True, staging="auto")
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def plain() -> Iterator[megatron.MegatronBackend]:
    loaded = build(False)
    yield loaded
    loaded.close()


@pytest.fixture(autouse=True)
def old_weights(cached: megatron.MegatronBackend, plain: megatron.MegatronBackend) -> None:
    for backend in (cached, plain):
        backend.write_weights(gpu.scaled_reference_weights())
        backend.finish_weight_update("persist")  # a test's leftovers never match
    torch.cuda.synchronize()


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 250, (PROMPT_TOKENS - 1,), generator=generator).tolist()]


def siblings(prompts: int, samples: int) -> list[base.SequenceRequest]:
    return [
        base.SequenceRequest(
            f"{index}",
            tuple(prompt(index % prompts)),
            base.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1),
        )
        for index in range(prompts * samples)
    ]


def run(backend: base.Backend, batch: list[base.SequenceRequest], admit: Any = None) -> dict[str, list[base.TokenStep]]:
    produced: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in batch}
    for steps in backend.generate(batch, admit):
        for step in steps:
            produced[step.request_id].append(step)
    return produced


def agree(reference: dict[str, list[base.TokenStep]], produced: dict[str, list[base.TokenStep]], what: str) -> None:
    """Every sequence's greedy tokens equal the reference's, up to the first near-tie (:data:`TIE`)."""
    for key, steps in reference.items():
        tokens = [step.token_id for step in produced[key]]
        assert len(tokens) == len(steps), f"{what}, sequence {key}: {len(tokens)} tokens, not {len(steps)}"
        for position, step in enumerate(steps):
            if tokens[position] != step.token_id:
                margin = step.top_logprobs[0][1] - step.top_logprobs[1][1]
                assert margin < TIE, f"{what}, sequence {key}: token {position} differs (margin {margin:.3f})"
                break


def registered(backend: megatron.MegatronBackend) -> int:
    return len(backend.engine.context.kv_block_allocator.kv_hash_to_block_id)


@pytest.mark.parametrize(("prompts", "samples"), [(1, 1), (1, 8), (4, 4), (2, 16)])
def test_siblings_share_whole_blocks_and_the_tokens_equal_caching_off(
    cached: megatron.MegatronBackend, plain: megatron.MegatronBackend, prompts: int, samples: int
) -> None:
    batch = siblings(prompts, samples)
    before = cached.prefix_cache
    with_cache = run(cached, batch)
    counted = cached.prefix_cache
    agree(run(plain, batch), with_cache, f"caching on vs off at {prompts} x {samples}")
    hits = counted.hit_tokens - before.hit_tokens
    prompt_tokens = counted.prompt_tokens - before.prompt_tokens
    assert prompt_tokens == len(batch) * PROMPT_TOKENS
    assert hits >= (len(batch) - prompts) * 2 * BLOCK  # every sibling after the first skips two blocks
    assert plain.prefix_cache.hit_tokens == 0
    gpu.report("prefix_cache_siblings", prompts=prompts, samples=samples, hit_tokens=hits, prompt_tokens=prompt_tokens)


def drained(backend: megatron.MegatronBackend, mode: vocabulary.KvCacheMode) -> None:
    backend.begin_weight_update(mode)
    backend.write_weights(gpu.scaled_reference_weights(NEW_SEED))
    backend.finish_weight_update(mode)


class Park:
    """The scheduler's ``admit``: at its :data:`PARK_AT`-th call it runs ``during`` (the refit's
    writes) and hands back a :class:`~megafleet_engine.backends.base.Switch` in ``mode``."""

    def __init__(self, during: Callable[[], None], mode: vocabulary.KvCacheMode, staged: bool = False) -> None:
        self.during, self.calls = during, 0
        self.switch = base.Switch(version=1, kv_cache_mode=mode, staged=staged)

    def __call__(self, capacity: int) -> base.Admission:
        self.calls += 1
        if self.calls != PARK_AT:
            return base.Admission()
        self.during()
        return base.Admission(switch=self.switch)


def kept(backend: megatron.MegatronBackend, mode: vocabulary.KvCacheMode, staged: bool = False) -> None:
    def write() -> None:
        if staged:
            backend.write_weights(gpu.scaled_reference_weights(NEW_SEED), staged=True)
            backend.commit_staged()
        else:
            backend.write_weights(gpu.scaled_reference_weights(NEW_SEED))

    park = Park(write, mode, staged)
    run(backend, siblings(2, 4), park)
    assert park.calls >= PARK_AT
    assert registered(backend) == 0 or mode == "recompute"  # recompute's re-added prefills register new blocks


REFITS: dict[str, Callable[[megatron.MegatronBackend], None]] = {
    "drain-persist": lambda backend: drained(backend, "persist"),
    "drain-offload": lambda backend: drained(backend, "offload"),
    "drain-recompute": lambda backend: drained(backend, "recompute"),
    "keep-persist": lambda backend: kept(backend, "persist"),
    "keep-recompute": lambda backend: kept(backend, "recompute"),
    "keep-persist-staged": lambda backend: kept(backend, "persist", staged=True),
}


@pytest.mark.parametrize("refit", sorted(REFITS))
def test_after_a_refit_no_block_of_the_old_weights_serves(
    cached: megatron.MegatronBackend, plain: megatron.MegatronBackend, refit: str
) -> None:
    batch = siblings(2, 4)
    run(cached, batch)  # the old weights' blocks, cached (LRU keeps them after the requests end)
    assert registered(cached) > 0
    REFITS[refit](cached)
    assert registered(cached) == 0 or refit == "keep-recompute"
    plain.write_weights(gpu.scaled_reference_weights(NEW_SEED))
    agree(run(plain, batch), run(cached, batch), f"after {refit}")
    assert cached.prefix_cache.hit_tokens > 0


def test_invalidation_returns_cached_blocks_to_the_pool(cached: megatron.MegatronBackend) -> None:
    allocator = cached.engine.context.kv_block_allocator
    free = allocator.total_avail
    run(cached, siblings(4, 2))
    assert allocator.total_avail < free  # whole blocks stay cached after their requests ended
    assert kv_cache.invalidate_prefixes(allocator) > 0
    assert allocator.total_avail == free and registered(cached) == 0
    assert int((allocator.block_hashes != -1).sum()) == 0
