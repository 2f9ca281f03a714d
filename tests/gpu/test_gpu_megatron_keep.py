"""Refits that keep the running sequences, on megatron-core's dynamic engine at TP=1 (NVIDIA GPUs with
megatron-core and flash-attention; skipped cleanly elsewhere): the backend driven directly, as the
engine's scheduler drives it (``generate`` with an ``admit`` that parks between two steps, writes
the weights there and hands back a :class:`~megafleet_engine.backends.base.Switch`).

* ``persist``: switching to the same weights changes no token, keeps the CUDA graphs, the KV buffer
  and every parameter's storage; switching to new weights continues every sequence with the new
  weights over the KV the old ones computed (an HF replay: the prefix's KV from the old weights,
  then the new weights), from the first token after the switch;
* ``recompute``: the tokens after the switch equal a fresh run at the new weights from each prompt
  plus the tokens before the switch (with or without ``begin_weight_update(keep=True)`` before the
  writes), and the switch reports the tokens it recomputed;
* ``offload`` (built for it, with static KV pointers, which need ``torch_memory_saver``: skipped
  without it): ``begin_weight_update(keep=True)`` frees the KV buffer into the host while the weights
  are written, and the sequences continue as under ``persist``; without static pointers the backend
  does not offer ``offload`` as a keep mode (megatron's graph capture at the resume would reset the
  context that holds the kept requests);
* staging: writes into the staging copy while the engine generates leave the live weights alone; a
  switch copies them in (as an in-place ``persist`` switch would have written them); a discard
  leaves the live weights as they were.

Each test checks every sequence's token count (none lost, none duplicated) and finish reasons, and
the default build's asynchronous scheduling (a forward launched ahead of each step) is on. With
``MEGAFLEET_GPU_REPORT=FILE`` set, the tests append what they measured to ``FILE``. The same logic runs
on the CPU against a fake engine in ``test_megatron_keep_steps.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from helpers import gpu
from megafleet_engine.backends import base, megatron
from megafleet_engine.backends.megatron import staging
from megafleet_engine.models import tiny
from megafleet_protocol import vocabulary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu.GPU_SKIP is not None, reason=gpu.GPU_SKIP or ""),
    pytest.mark.filterwarnings("default"),  # megatron-core's and the kernels' own warnings
]

PARK_AT = 8
"""The ``admit`` call that parks (megatron's first steps prefill; every sequence has tokens by then)."""
TIE = 0.1
"""Log-probability gap of the best two tokens under which two bf16 runs of one greedy step may differ."""
HF_SLACK = 0.25
"""How far below the HF fp32 replay's best log-probability megatron's bf16 greedy token may be."""


def build(kv_cache_mode: vocabulary.KvCacheMode = "persist", **options: Any) -> megatron.MegatronBackend:
    """The tiny model (bf16, decode CUDA graphs, the default asynchronous scheduling) with the
    scaled reference weights (seed 0)."""
    loaded = megatron.load(
        gpu.SOURCE,
        name="tiny",
        max_sequence_length=gpu.MAX_SEQUENCE_LENGTH,
        dtype="bfloat16",
        device="cuda",
        load_weights=True,
        options=megatron.EngineOptions(
            max_batch_size=8, kv_buffer_gb=1.0, max_step_tokens=2048, kv_cache_mode=kv_cache_mode, **options
        ),
    )
    loaded.write_weights(gpu.scaled_reference_weights())
    return loaded


@pytest.fixture(scope="module")
def backend() -> Iterator[megatron.MegatronBackend]:
    """Built for ``persist`` with a staging copy (``auto``: a tiny model always has room)."""
    loaded = build(staging="auto")
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def prompts(backend: megatron.MegatronBackend) -> list[list[int]]:
    return [backend.tokenizer.encode(text) for text in gpu.TEXTS]


def requests(
    prompts: list[list[int]], count: int = gpu.NEW_TOKENS, logprobs: int | None = None
) -> list[base.SequenceRequest]:
    """Greedy sequences; without ``logprobs`` the odd ones ask for one (read from megatron's records,
    across its checkpoints), the even ones for none (read from the step's arrays)."""
    return [
        base.SequenceRequest(
            str(index),
            tuple(prompt),
            base.SamplingParams(
                max_tokens=count,
                temperature=0.0,
                ignore_eos=True,
                logprobs=logprobs if logprobs is not None else (1 if index % 2 else None),
            ),
        )
        for index, prompt in enumerate(prompts)
    ]


def run(backend: base.Backend, batch: list[base.SequenceRequest], admit: Any = None) -> dict[str, list[base.TokenStep]]:
    produced: dict[str, list[base.TokenStep]] = {request.request_id: [] for request in batch}
    for steps in backend.generate(batch, admit):
        for step in steps:
            produced[step.request_id].append(step)
    return produced


def ids(produced: dict[str, list[base.TokenStep]]) -> dict[str, list[int]]:
    return {key: [step.token_id for step in steps] for key, steps in produced.items()}


class Park:
    """The scheduler's ``admit``: at its :data:`PARK_AT`-th call it runs ``during`` (the refit's
    writes, on the backend thread) and hands back ``switch`` (with ``done`` recording what the
    backend reports); it notes each sequence's tokens delivered before the park."""

    def __init__(self, during: Callable[[], None], mode: vocabulary.KvCacheMode | None, staged: bool = False) -> None:
        self.during = during
        self.switch = base.Switch(version=1, kv_cache_mode=mode, staged=staged, done=self.done) if mode else None
        self.calls = 0
        self.produced: dict[str, list[base.TokenStep]] = {}
        self.before: dict[str, int] = {}
        self.switched: list[base.Switched] = []

    def __call__(self, capacity: int) -> base.Admission:
        self.calls += 1
        if self.calls != PARK_AT:
            return base.Admission()
        self.before = {key: len(steps) for key, steps in self.produced.items()}
        self.during()
        return base.Admission(switch=self.switch)

    def done(self, switched: base.Switched) -> None:
        self.switched.append(switched)

    def run(
        self, backend: megatron.MegatronBackend, batch: list[base.SequenceRequest]
    ) -> dict[str, list[base.TokenStep]]:
        self.produced = {request.request_id: [] for request in batch}
        for steps in backend.generate(batch, self):
            for step in steps:
                self.produced[step.request_id].append(step)
        assert self.calls >= PARK_AT, f"the batch ended after {self.calls} steps, before the park"
        assert len(set(self.before.values())) == 1 and 0 < min(self.before.values()) < gpu.NEW_TOKENS - 4, self.before
        return self.produced


def check_counts(produced: dict[str, list[base.TokenStep]], batch: list[base.SequenceRequest]) -> None:
    """None lost, none duplicated: exactly ``max_tokens`` tokens each, the last one ``length``; a
    sequence that asked for log-probabilities has one for every token."""
    for request in batch:
        steps = produced[request.request_id]
        count = request.params.max_tokens
        assert len(steps) == count, f"sequence {request.request_id}: {len(steps)} tokens across the switch, not {count}"
        finishes = [step.finish_reason for step in steps]
        assert finishes == [None] * (count - 1) + ["length"], f"sequence {request.request_id}: finishes {finishes}"
        assert all(step.token_id != base.NO_TOKEN for step in steps), f"sequence {request.request_id} was aborted"
        if request.params.logprobs is not None:
            missing = [index for index, step in enumerate(steps) if step.logprob is None]
            assert not missing, f"sequence {request.request_id}: no log-probability at tokens {missing}"


def agreed_prefix(reference: list[base.TokenStep], produced: list[int], what: str) -> int:
    """Leading tokens of ``produced`` equal to the reference's greedy ones (which carry two
    alternatives); a difference only where the reference's best two are within :data:`TIE`."""
    assert len(produced) == len(reference), f"{what}: {len(produced)} tokens against {len(reference)}"
    for position, step in enumerate(reference):
        if produced[position] != step.token_id:
            margin = step.top_logprobs[0][1] - step.top_logprobs[1][1]
            differs = f"{what}: token {position} is {produced[position]}, not {step.token_id}"
            assert margin < TIE, f"{differs} (reference margin {margin:.3f})"
            return position
    return len(reference)


def pointers(backend: megatron.MegatronBackend) -> dict[str, int]:
    return {name: parameter.data_ptr() for name, parameter in backend.model.named_parameters()}


def restore(backend: megatron.MegatronBackend) -> None:
    backend.write_weights(gpu.scaled_reference_weights())
    torch.cuda.synchronize()


# -- the reference for persist: the old weights' KV, then the new weights (Hugging Face, fp32) --------


def hf_model(seed: int) -> Any:
    model, _ = tiny.build_tiny(gpu.SOURCE)
    model.load_state_dict({name: tensor.float() for name, tensor in gpu.scaled_reference_weights(seed).items()})
    return model.cuda()


def _forward(model: Any, token_ids: list[int], cache: Any) -> tuple[torch.Tensor, Any]:
    """One forward over ``token_ids`` after ``cache`` (``None``: a fresh one): the last position's
    log-probabilities and the cache (keyword ``cache`` in newer transformers, ``past_key_values`` before)."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        output = model(input_ids=torch.tensor([token_ids], device="cuda"), use_cache=True, **{keyword: cache})
    return torch.log_softmax(output.logits[0, -1].float(), dim=-1), getattr(output, keyword)


def persist_replay(old: Any, new: Any, prefix: list[int], produced: list[int]) -> int:
    """Teacher-force ``produced`` (megatron's tokens after the switch) through ``new`` over the KV
    ``old`` computed for ``prefix`` but its last token (which the first step after the switch feeds
    through the new weights). Returns how many leading tokens are within :data:`HF_SLACK` of the
    replay's best (the comparison stops where the sequences part)."""
    _, cache = _forward(old, prefix[:-1], None)
    logprobs, cache = _forward(new, prefix[-1:], cache)
    agreed = 0
    for produced_token in produced:
        if float(logprobs[produced_token]) < float(logprobs.max()) - HF_SLACK:
            break
        agreed += 1
        logprobs, cache = _forward(new, [produced_token], cache)
    return agreed


# -- the tests ------------------------------------------------------------------------------------


def test_a_persist_switch_to_the_same_weights_changes_nothing(
    backend: megatron.MegatronBackend, prompts: list[list[int]]
) -> None:
    """No token lost, duplicated or changed; CUDA graphs, KV buffer and parameter storage kept. The
    forward megatron launched ahead with the (same) old weights is run again: still equal."""
    batch = requests(prompts)
    straight = ids(run(backend, batch))
    graphs, kv = backend.engine.capture_stats, backend.engine.context.memory_buffer.data_ptr()
    before = pointers(backend)
    park = Park(lambda: restore(backend), "persist")

    produced = park.run(backend, batch)

    check_counts(produced, batch)
    assert ids(produced) == straight, "a persist switch to the same weights changed tokens"
    assert park.switched == [base.Switched()]
    assert backend.engine.capture_stats is graphs, "a persist switch captured the CUDA graphs again"
    assert backend.engine.context.memory_buffer.data_ptr() == kv
    assert pointers(backend) == before, "a parameter was rebound"
    assert not backend.suspended


def test_a_persist_switch_continues_over_the_old_kv_with_the_new_weights(
    backend: megatron.MegatronBackend, prompts: list[list[int]]
) -> None:
    batch = requests(prompts)
    straight = ids(run(backend, batch))
    park = Park(lambda: backend.write_weights(gpu.scaled_reference_weights(seed=1)), "persist")
    try:
        produced = ids(park.run(backend, batch))
    finally:
        restore(backend)
    check_counts(park.produced, batch)
    old, new = hf_model(0), hf_model(1)
    agreed, old_refused = [], 0
    for request in batch:
        key, at = request.request_id, park.before[request.request_id]
        assert produced[key][:at] == straight[key][:at], f"sequence {key}: tokens before the switch changed"
        prefix = list(request.prompt_token_ids) + produced[key][:at]
        agreed.append(persist_replay(old, new, prefix, produced[key][at:]))
        old_refused += persist_replay(old, new, prefix, straight[key][at : at + 1]) == 0  # the old weights' next token
    gpu.report("keep_persist_new_weights", agreed_with_replay=agreed, of=gpu.NEW_TOKENS - park.before["0"])
    assert min(agreed) >= 1, f"the first token after a persist switch is not the new weights' over the old KV: {agreed}"
    assert sum(agreed) >= 0.75 * sum(gpu.NEW_TOKENS - at for at in park.before.values()), agreed
    assert old_refused >= 1, "the old and new weights agree on every first token: the test cannot tell them apart"


@pytest.mark.parametrize("begun", [False, True], ids=["at-the-switch", "begun-before-the-writes"])
def test_a_recompute_switch_equals_a_fresh_run_from_the_prefix(
    backend: megatron.MegatronBackend, prompts: list[list[int]], begun: bool
) -> None:
    batch = requests(prompts)
    before = pointers(backend)

    def write() -> None:
        if begun:
            backend.begin_weight_update("recompute", keep=True)
            assert backend.suspended, "a keeping recompute begin did not suspend megatron's engine"
        backend.write_weights(gpu.scaled_reference_weights(seed=1))

    park = Park(write, "recompute")
    try:
        produced = ids(park.run(backend, batch))
        at = park.before["0"]
        prefixes = [list(request.prompt_token_ids) + produced[request.request_id][:at] for request in batch]
        fresh = run(backend, requests(prefixes, gpu.NEW_TOKENS - at, logprobs=2))  # the new weights, live
    finally:
        restore(backend)
    check_counts(park.produced, batch)
    agreed = [
        agreed_prefix(fresh[request.request_id], produced[request.request_id][at:], f"sequence {request.request_id}")
        for request in batch
    ]
    gpu.report(
        f"keep_recompute_{'begun' if begun else 'switch'}",
        agreed_with_fresh=agreed,
        of=gpu.NEW_TOKENS - at,
        switched=park.switched,
    )
    assert sum(agreed) >= 0.75 * (gpu.NEW_TOKENS - at) * len(batch), agreed
    recomputed = sum(len(prefix) for prefix in prefixes)
    assert [switched.recomputed_tokens for switched in park.switched] == [recomputed], park.switched
    assert pointers(backend) == before, "a parameter was rebound"
    assert not backend.suspended


def test_offload_keeps_sequences_only_with_static_kv_pointers(backend: megatron.MegatronBackend) -> None:
    assert not backend.engine.context.static_kv_memory_pointers  # the default build: graphs captured again
    assert backend.keep_modes == {"persist", "recompute"}


@pytest.mark.skipif(
    importlib.util.find_spec("torch_memory_saver") is None,
    reason="an offload that keeps sequences needs static KV pointers, which megatron-core 0.19 allows outside "
    "persist only with torch_memory_saver (pip install torch-memory-saver)",
)
def test_offload_frees_the_kv_while_the_weights_are_written_and_continues_as_persist(
    backend: megatron.MegatronBackend, prompts: list[list[int]]
) -> None:
    batch = requests(prompts, logprobs=2)
    persisted = Park(lambda: backend.write_weights(gpu.scaled_reference_weights(seed=1)), "persist")
    try:
        reference = persisted.run(backend, batch)
    finally:
        restore(backend)
    offloading = build("offload", static_kv_pointers=True)
    assert offloading.keep_modes == {"persist", "recompute", "offload"}
    graphs = offloading.engine.capture_stats
    context = offloading.engine.context
    kv_bytes = context.memory_buffer.numel() * context.memory_buffer.element_size()
    seen: dict[str, Any] = {}

    def write() -> None:  # device memory as the driver sees it: torch_memory_saver releases it under torch
        torch.cuda.synchronize()
        seen["before"] = torch.cuda.mem_get_info()[0]
        offloading.begin_weight_update("offload", keep=True)
        torch.cuda.synchronize()
        seen["during"] = torch.cuda.mem_get_info()[0]
        seen["suspended"] = offloading.suspended
        offloading.write_weights(gpu.scaled_reference_weights(seed=1))

    park = Park(write, "offload")
    try:
        produced = ids(park.run(offloading, batch))
    finally:
        offloading.close()
    check_counts(park.produced, batch)
    freed = seen["during"] - seen["before"]
    agreed = [
        agreed_prefix(reference[request.request_id], produced[request.request_id], f"sequence {request.request_id}")
        for request in batch
    ]
    gpu.report("keep_offload", kv_bytes=kv_bytes, freed_while_parked=freed, agreed_with_persist=agreed)
    assert seen["suspended"] and freed >= 0.9 * kv_bytes, (freed, kv_bytes)
    assert park.before == persisted.before
    assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(batch), agreed
    assert park.switched == [base.Switched()] and not offloading.suspended
    assert offloading.engine.capture_stats is graphs, "static KV pointers, yet the graphs were captured again"


def test_staged_writes_while_generating_then_the_switch_copies_them_and_a_discard_does_not(
    backend: megatron.MegatronBackend, prompts: list[list[int]]
) -> None:
    assert backend.staging_reason is None, backend.staging_reason
    assert staging.free_device_bytes(torch.cuda.current_device()) >= torch.cuda.mem_get_info()[0]
    live, staged = backend.shard_map().live, backend.staged_shard_map().live
    assert set(staged) == set(live)
    assert backend.staging_bytes() == sum(tensor.numel() * tensor.element_size() for tensor in live.values())
    assert not {t.data_ptr() for t in staged.values()} & {t.data_ptr() for t in live.values()}
    batch = requests(prompts, logprobs=2)
    in_place = Park(lambda: backend.write_weights(gpu.scaled_reference_weights(seed=1)), "persist")
    try:
        reference = in_place.run(backend, batch)
    finally:
        restore(backend)
    before = pointers(backend)
    calls = 0
    untouched: list[bool] = []

    def admit(capacity: int) -> base.Admission:  # a staged refit: written while generating, switched at the park
        nonlocal calls
        calls += 1
        if calls == 2:
            backend.write_weights(gpu.scaled_reference_weights(seed=1), staged=True)
            torch.cuda.synchronize()
            untouched.append(
                bool(
                    torch.equal(
                        backend.parameters()["lm_head.weight"].cpu(), gpu.scaled_reference_weights()["lm_head.weight"]
                    )
                )
            )
        if calls == PARK_AT:
            backend.commit_staged()
            return base.Admission(switch=base.Switch(version=1, kv_cache_mode="persist", staged=True))
        return base.Admission()

    try:
        produced = run(backend, batch, admit)
        after_switch = ids(run(backend, batch))
        backend.write_weights(gpu.scaled_reference_weights(seed=2), staged=True)
        backend.discard_staged()
        after_discard = ids(run(backend, batch))
    finally:
        restore(backend)
    check_counts(produced, batch)
    agreed = [
        agreed_prefix(reference[key], [step.token_id for step in produced[key]], f"sequence {key}") for key in reference
    ]
    gpu.report("keep_staged", agreed_with_in_place=agreed)
    assert untouched == [True], "a write into the staging copy reached the live weights"
    assert sum(agreed) >= 0.75 * gpu.NEW_TOKENS * len(batch), agreed
    assert after_discard == after_switch, "a discarded staging copy changed the live weights"
    assert pointers(backend) == before, "the commit rebound a parameter"
