"""The megatron backend keeping its running sequences across a refit, on the CPU: the switch in each
KV-cache mode, megatron's checkpoints (no token emitted twice or lost), the staging copy, and a
two-rank shard whose ranks switch between the same two steps.

megatron-core is not needed: :class:`KeepEngine` keeps megatron's contract as the backend uses it
(one token per running request per step; ``suspend()``/``resume()`` reading the context's KV-cache
mode, a ``recompute`` suspend checkpointing every active request: its prompt becomes prompt +
generated tokens and a new request with empty ``generated_tokens`` continues it; the logits of a
forward launched ahead by asynchronous scheduling, which give the next step's tokens until cleared).
Its token at a position depends on the weights live when the token's forward ran (a value of the
model's final norm), so a token from the wrong weights shows. The model is CPU tensors named and
shaped as megatron's, from the weight map. The GPU test ``test_gpu_megatron_keep.py`` checks the same
on megatron itself.
"""

from __future__ import annotations

import queue
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from megafleet_engine.backends import base, weight_maps
from megafleet_engine.backends.megatron import backend as backend_module
from megafleet_engine.backends.megatron import build, kv_cache, lockstep, model_sources, nemo_sampler, staging
from megafleet_engine.backends.megatron.nemo_sampler import NemoSampling
from megafleet_protocol import vocabulary

SOURCE = "tiny://llama?hidden=64&heads=4&kv_heads=2&intermediate=128&layers=2"
VOCAB = 263
NORM = "decoder.final_layernorm.weight"
PROMPTS = [(40, 41, 42), (50, 51), (60, 61, 62, 63), (70,)]
WAIT = 10.0


class Part:
    """One megatron request of a record (a checkpoint starts the next)."""

    def __init__(self, request_id: int, prompt: list[int], params: Any, origin: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt
        self.sampling_params = params
        self.origin = origin  # the first request's prompt length
        self.generated_tokens: list[int] = []
        self.generated_log_probs: list[float] = []
        self.generated_top_n_logprobs: list[dict[int, float]] = []
        self.status = "active"

    @property
    def position(self) -> int:
        """The index, among every token its record generated, of this request's next token."""
        return len(self.prompt_tokens) - self.origin + len(self.generated_tokens)


class Record:
    def __init__(self, part: Part) -> None:
        self.requests = [part]

    def checkpoint(self) -> None:
        old = self.requests[-1]
        budget = old.sampling_params.num_tokens_to_generate - len(old.generated_tokens)
        params = types.SimpleNamespace(**{**vars(old.sampling_params), "num_tokens_to_generate": budget})
        self.requests.append(Part(old.request_id, old.prompt_tokens + old.generated_tokens, params, old.origin))

    def merge(self) -> Part:
        merged = Part(self.requests[0].request_id, self.requests[0].prompt_tokens, None, self.requests[0].origin)
        for part in self.requests:
            merged.generated_tokens += part.generated_tokens
            merged.generated_log_probs += part.generated_log_probs
            merged.generated_top_n_logprobs += part.generated_top_n_logprobs
        merged.status = self.requests[-1].status
        return merged


class Launched:
    """megatron's controller's record of a forward launched ahead (asynchronous scheduling)."""

    def __init__(self) -> None:
        self.is_valid = False
        self.version = 0.0
        self.cleared = 0

    def clear(self) -> None:
        self.is_valid = False
        self.cleared += 1


def token(first: int, position: int, version: float) -> int:
    return (first * 7 + position * 3 + int(version) * 101) % VOCAB


class KeepEngine:
    """megatron's engine as the megatron backend drives it, over ``model``'s live weights."""

    def __init__(self, model: FakeModel, *, launch_ahead: bool = True, static: bool = False) -> None:
        self.model = model
        self.launch_ahead = launch_ahead
        self.requests: dict[int, Any] = {}
        self.waiting_request_ids: list[int] = []
        self.stop_word_finished_request_ids: set[int] = set()
        self.controller = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eod=2), _async_sched_logits=Launched())
        self.context = types.SimpleNamespace(kv_cache_management_mode="persist", static_kv_memory_pointers=static)
        self.order: list[int] = []
        self.suspended = False
        self.calls: list[tuple[str, str, int]] = []  # (suspend|resume, mode, requests in flight)
        self.seen: list[float] = []  # the weights each step's tokens came from
        self.evict: dict[int, int] = {}  # step index -> megatron id checkpointed right after that step's token

    def version(self) -> float:
        return float(self.model.live[NORM][0])

    def add_request(self, request_id: int, prompt: list[int], params: Any) -> Any:
        self.requests[request_id] = types.SimpleNamespace(
            record=Record(Part(request_id, list(prompt), params, len(prompt)))
        )
        self.order.append(request_id)
        return types.SimpleNamespace(done=lambda: False)

    def get_request(self, request_id: int) -> Part:
        part: Part = self.requests[request_id].record.requests[-1]
        return part

    def has_unfinished_requests(self) -> bool:
        return bool(self.order)

    def reset(self) -> None:
        self.requests.clear()
        self.order.clear()
        self.stop_word_finished_request_ids.clear()

    def suspend(self) -> None:
        mode = self.context.kv_cache_management_mode
        self.calls.append(("suspend", mode, len(self.order)))
        self.suspended = True
        if mode == "recompute":
            for request_id in self.order:
                self.requests[request_id].record.checkpoint()

    def resume(self) -> None:
        self.calls.append(("resume", self.context.kv_cache_management_mode, len(self.order)))
        self.suspended = False

    async def async_forward(self) -> tuple[dict[str, Any] | None, dict[str, Any], float]:
        assert not self.suspended, "megatron steps no suspended engine"
        launched = self.controller._async_sched_logits
        version = launched.version if launched.is_valid else self.version()  # the launched forward's weights
        self.seen.append(version)
        ids, tokens, finished = [], [], []
        for request_id in self.order:
            part = self.get_request(request_id)
            ids.append(request_id)
            tokens.append(token(part.prompt_tokens[0], part.position, version))
            stopped = request_id in self.stop_word_finished_request_ids
            if stopped or len(part.generated_tokens) + 1 >= part.sampling_params.num_tokens_to_generate:
                finished.append(request_id)
        if self.launch_ahead:
            launched.is_valid, launched.version = True, self.version()
        output = {
            "active_request_ids": torch.tensor(ids, dtype=torch.int64),
            "sample": torch.tensor(tokens, dtype=torch.int64),
            "finished_request_ids": torch.tensor(finished, dtype=torch.int64),
        }
        return output, {}, 0.0

    async def async_bookkeep(self, output: dict[str, Any] | None, state: Any, step_time: float) -> dict[str, Any]:
        assert output is not None
        finished = set(output["finished_request_ids"].tolist())
        active, records = [], []
        for request_id, sampled in zip(output["active_request_ids"].tolist(), output["sample"].tolist(), strict=True):
            record = self.requests[request_id].record
            if request_id not in self.stop_word_finished_request_ids:
                part = record.requests[-1]
                part.generated_tokens.append(sampled)
                part.generated_log_probs.append(-0.25 * sampled)
                part.generated_top_n_logprobs.append({sampled: -0.25 * sampled})
            if request_id in finished:
                self.stop_word_finished_request_ids.discard(request_id)
                del self.requests[request_id]
                self.order.remove(request_id)
                records.append(record)
            else:
                active.append(request_id)
                if self.evict.get(len(self.seen) - 1) == request_id:  # megatron evicts under KV pressure
                    record.checkpoint()
        return {"active_request_ids": active, "finished_request_records": records}


class FakeModel:
    """This rank's megatron parameters (CPU tensors, shaped by the weight map); the final norm's
    first value stands for the weight version."""

    def __init__(self, layout: weight_maps.Layout) -> None:
        shape = model_sources.parse_source(SOURCE).shape
        self.live = {name: torch.zeros(spec.shape) for name, spec in weight_maps.shard_map(shape, layout).items()}

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, tensor in self.live.items():
            yield name, torch.nn.Parameter(tensor, requires_grad=False)


class FakeGroup:
    """A model-parallel group of two ranks in one process: ticks through a queue, votes through a
    barrier (stands in for ``Lockstep``'s broadcast and all-reduce)."""

    def __init__(self) -> None:
        self.ticks: queue.Queue[lockstep.Tick | None] = queue.Queue()
        self.barrier = threading.Barrier(2, timeout=WAIT)
        self.votes: dict[bool, bool] = {}


def fake_send(self: lockstep.Lockstep, tick: lockstep.Tick | None) -> lockstep.Tick | None:
    group: FakeGroup = self.group
    if self.leader:
        group.ticks.put(tick)
        return tick
    return group.ticks.get(timeout=WAIT)


def fake_agree(self: lockstep.Lockstep, ok: bool) -> bool:
    group: FakeGroup = self.group
    group.votes[self.leader] = ok
    group.barrier.wait()
    agreed = all(group.votes.values())
    group.barrier.wait()
    return agreed


@pytest.fixture(autouse=True)
def no_megatron(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """megatron's modules answered by plain stand-ins, CUDA calls by nothing (CPU tensors)."""
    modules = types.SimpleNamespace(
        SamplingParams=lambda **kwargs: types.SimpleNamespace(**kwargs), KVCacheManagementMode=lambda mode: mode
    )
    monkeypatch.setattr(build, "megatron_core", lambda module: modules)
    monkeypatch.setattr(nemo_sampler, "install", lambda controller: NemoSampling(torch.Generator(), VOCAB))
    for name in ("set_device", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(staging, "free_device_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(lockstep.Lockstep, "_send", fake_send)
    monkeypatch.setattr(lockstep.Lockstep, "agree", fake_agree)
    yield
    while MADE:  # their event loops (a follower's once its first rank released it)
        MADE.pop()._batch.close()


MADE: list[backend_module.MegatronBackend] = []


def make(
    kv_cache_mode: vocabulary.KvCacheMode = "persist",
    *,
    layout: weight_maps.Layout | None = None,
    group: FakeGroup | None = None,
    launch_ahead: bool = True,
    static: bool = False,
) -> tuple[backend_module.MegatronBackend, KeepEngine]:
    layout = layout or weight_maps.Layout()
    model = FakeModel(layout)
    engine = KeepEngine(model, launch_ahead=launch_ahead, static=static)
    backend = backend_module.MegatronBackend(
        engine=engine,
        model=model,
        source=model_sources.parse_source(SOURCE),
        layout=layout,
        name="fake",
        max_sequence_length=64,
        tokenizer=None,
        group=group,
        max_requests=8,
        kv_cache_mode=kv_cache_mode,
    )
    MADE.append(backend)
    return backend, engine


def requests(max_tokens: int = 12) -> list[base.SequenceRequest]:
    """Four greedy sequences, the odd ones with log-probabilities (read from megatron's records)."""
    return [
        base.SequenceRequest(
            str(index),
            prompt,
            base.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=index % 2 or None),
        )
        for index, prompt in enumerate(PROMPTS)
    ]


class Park:
    """``admit`` that parks at its ``at``-th call: runs ``during`` (the refit's writes) there and
    hands back ``switch`` (or none); counts each sequence's tokens delivered before the park."""

    def __init__(self, at: int, during: Any, switch: base.Switch | None) -> None:
        self.at, self.during, self.switch = at, during, switch
        self.calls = 0
        self.produced: dict[str, list[base.TokenStep]] = {}
        self.before: dict[str, int] = {}
        self.switched: list[base.Switched] = []

    def __call__(self, capacity: int) -> base.Admission:
        self.calls += 1
        if self.calls != self.at:
            return base.Admission()
        self.before = {key: len(steps) for key, steps in self.produced.items()}
        self.during()
        return base.Admission(switch=self.switch)

    def done(self, switched: base.Switched) -> None:
        self.switched.append(switched)

    def run(self, backend: base.Backend, batch: list[base.SequenceRequest]) -> dict[str, list[base.TokenStep]]:
        self.produced = {request.request_id: [] for request in batch}
        for steps in backend.generate(batch, self):
            for step in steps:
                self.produced[step.request_id].append(step)
        return self.produced


def set_version(model: FakeModel, version: float) -> None:
    model.live[NORM].fill_(version)


def expected(
    batch: list[base.SequenceRequest], switch_at: dict[str, int], old: float, new: float
) -> dict[str, list[int]]:
    """Each sequence's tokens: the old weights' before its switch position, the new weights' after."""
    return {
        request.request_id: [
            token(request.prompt_token_ids[0], position, old if position < switch_at[request.request_id] else new)
            for position in range(request.params.max_tokens)
        ]
        for request in batch
    }


def check_steps(produced: dict[str, list[base.TokenStep]], batch: list[base.SequenceRequest]) -> None:
    """Every sequence delivered exactly its ``max_tokens`` tokens, the last one ``length``, and the
    sequences that asked for log-probabilities got one per token (from the right megatron request)."""
    for request in batch:
        steps = produced[request.request_id]
        count = request.params.max_tokens
        assert len(steps) == count, f"sequence {request.request_id}: {len(steps)} tokens, not {count}"
        assert [step.finish_reason for step in steps] == [None] * (count - 1) + ["length"], request.request_id
        if request.params.logprobs is not None:
            assert [step.logprob for step in steps] == [-0.25 * step.token_id for step in steps], request.request_id


@pytest.mark.parametrize("launch_ahead", [True, False], ids=["async-schedule", "ordinary-order"])
@pytest.mark.parametrize("mode", ["persist", "recompute"])
def test_a_switch_mid_generation_keeps_every_sequence_and_token(
    mode: vocabulary.KvCacheMode, launch_ahead: bool
) -> None:
    backend, engine = make(launch_ahead=launch_ahead)
    batch = requests()
    park = Park(5, lambda: set_version(backend.model, 1.0), None)
    park.switch = base.Switch(version=1, kv_cache_mode=mode, done=park.done)

    produced = park.run(backend, batch)

    check_steps(produced, batch)
    tokens = {key: [step.token_id for step in steps] for key, steps in produced.items()}
    assert tokens == expected(batch, park.before, 0.0, 1.0), "a token after the switch came from the old weights"
    assert park.before == dict.fromkeys(park.produced, 4), park.before  # one token per step before the 5th
    prefixes = sum(len(prompt) + 4 for prompt in PROMPTS)
    if mode == "recompute":
        assert engine.calls == [("suspend", "recompute", 4), ("resume", "recompute", 4)]
        assert park.switched == [
            base.Switched(recomputed_tokens=prefixes, recompute_seconds=park.switched[0].recompute_seconds)
        ]
    else:
        assert engine.calls == [] and park.switched == [base.Switched()]
    assert engine.controller._async_sched_logits.cleared == (1 if launch_ahead else 0)
    assert not backend.suspended and not backend._batch.held


def test_offload_keeps_the_kv_on_the_host_while_parked_and_resumes_at_the_switch() -> None:
    backend, engine = make("offload", static=True)
    assert backend.keep_modes == {"persist", "recompute", "offload"}
    assert make()[0].keep_modes == {"persist", "recompute"}, "offload keeps need the pinned host copy"
    # without static KV pointers megatron captures its graphs again at the resume, resetting its context
    assert make("offload")[0].keep_modes == {"persist", "recompute"}
    batch = requests()
    seen: dict[str, Any] = {}

    def during() -> None:
        backend.begin_weight_update("offload", keep=True)
        seen["suspended"] = backend.suspended
        set_version(backend.model, 1.0)

    park = Park(4, during, None)
    park.switch = base.Switch(version=1, kv_cache_mode="offload", done=park.done)
    produced = park.run(backend, batch)

    check_steps(produced, batch)
    assert seen["suspended"] and engine.calls == [("suspend", "offload", 4), ("resume", "offload", 4)]
    tokens = {key: [step.token_id for step in steps] for key, steps in produced.items()}
    assert tokens == expected(batch, park.before, 0.0, 1.0)
    assert park.switched == [base.Switched()]
    with pytest.raises(ValueError, match="keeps sequences with persist, recompute"):
        make()[0].begin_weight_update("offload", keep=True)


def test_a_refit_that_ends_without_a_switch_resumes_what_it_suspended() -> None:
    """A keeping recompute suspend, then the refit fails before any write: the next boundary
    resumes megatron, whose checkpointed requests go on (on the unchanged weights)."""
    backend, engine = make()
    batch = requests()
    park = Park(4, lambda: backend.begin_weight_update("recompute", keep=True), None)

    produced = park.run(backend, batch)

    check_steps(produced, batch)
    assert engine.calls == [("suspend", "recompute", 4), ("resume", "recompute", 4)]
    tokens = {key: [step.token_id for step in steps] for key, steps in produced.items()}
    assert tokens == expected(batch, park.before, 0.0, 0.0)


def test_a_checkpoint_in_the_step_that_made_a_token_loses_nothing() -> None:
    """megatron checkpoints a request it evicts right after that step's token: the token sits in
    the record's earlier request, and is still delivered once."""
    backend, engine = make(launch_ahead=False)
    batch = requests()
    first = batch_runner_first_id()
    engine.evict = {2: first + 1, 6: first + 3, 7: first + 1}  # "1" and "3" ask for log-probabilities

    produced = Park(0, lambda: None, None).run(backend, batch)

    check_steps(produced, batch)
    tokens = {key: [step.token_id for step in steps] for key, steps in produced.items()}
    assert tokens == expected(batch, dict.fromkeys(tokens, 99), 0.0, 0.0)


def batch_runner_first_id() -> int:
    from megafleet_engine.backends.megatron import batch_runner

    return batch_runner._FIRST_REQUEST_ID


def test_staged_writes_while_generating_then_a_switch_copies_them_and_a_discard_does_not() -> None:
    backend, engine = make()
    with pytest.raises(RuntimeError, match="staging is off"):
        backend.staged_parameters()
    backend.prepare_staging()
    pointers = {name: tensor.data_ptr() for name, tensor in backend.shard_map().live.items()}
    staged = backend.staged_shard_map()
    assert set(staged.live) == set(pointers) and set(backend.staged_parameters()) == set(backend.parameters())
    assert all(staged.live[name].data_ptr() != pointer for name, pointer in pointers.items())
    assert backend.staging_bytes() == sum(t.numel() * t.element_size() for t in backend.shard_map().live.values())

    batch = requests()
    calls = 0

    def admit(capacity: int) -> base.Admission:  # a staged refit: written between steps, switched at the 6th
        nonlocal calls
        calls += 1
        if calls == 3:
            for tensor in backend.staged_shard_map().live.values():
                tensor.fill_(2.0)
        if calls == 6:
            backend.commit_staged()
            return base.Admission(switch=base.Switch(version=2, kv_cache_mode="persist", staged=True))
        return base.Admission()

    produced: dict[str, list[int]] = {request.request_id: [] for request in batch}
    for steps in backend.generate(batch, admit):
        for step in steps:
            produced[step.request_id].append(step.token_id)
    assert engine.seen[:5] == [0.0] * 5 and set(engine.seen[5:]) == {2.0}, engine.seen
    assert all(bool((tensor == 2.0).all()) for tensor in backend.shard_map().live.values())
    assert {name: tensor.data_ptr() for name, tensor in backend.shard_map().live.items()} == pointers

    for tensor in backend.staged_shard_map().live.values():
        tensor.fill_(3.0)
    backend.discard_staged()
    Park(0, lambda: None, None).run(backend, requests(4))
    assert set(engine.seen[-4:]) == {2.0}, "a discarded staging copy reached the live weights"


def test_without_room_a_shard_stages_nowhere_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert staging.decide(
        free_bytes=10 * staging.GIB,
        parameter_bytes=6 * staging.GIB,
        buffer_bytes=2 * staging.GIB,
        headroom_bytes=staging.GIB,
    ).stage
    decision = staging.decide(
        free_bytes=9 * staging.GIB,
        parameter_bytes=15 * staging.GIB,
        buffer_bytes=2 * staging.GIB,
        headroom_bytes=staging.GIB,
    )
    assert decision == staging.Decision(False, "needs 18.0 GiB (P 15.0 + B 2.0 + H 1.0 GiB), free 9.0 GiB")
    monkeypatch.setattr(staging, "free_device_bytes", lambda device: 1000)
    backend, _ = make()
    backend._staging.decide(buffer_bytes=0, headroom_bytes=0)
    assert backend.staging_reason is not None and backend.staging_reason.startswith("needs")
    with pytest.raises(RuntimeError, match="no staging copy: needs"):
        backend.prepare_staging()


def two_ranks(kv_cache_mode: vocabulary.KvCacheMode = "persist") -> tuple[Any, Any, threading.Thread]:
    group = FakeGroup()
    leader, leading = make(kv_cache_mode, layout=weight_maps.Layout(tp_rank=0, tp_size=2), group=group)
    follower, following = make(kv_cache_mode, layout=weight_maps.Layout(tp_rank=1, tp_size=2), group=group)
    deciding = threading.Thread(target=follower._staging.decide, kwargs={"buffer_bytes": 0, "headroom_bytes": 0})
    deciding.start()
    leader._staging.decide(buffer_bytes=0, headroom_bytes=0)  # collective, as every rank's load() runs it
    deciding.join(WAIT)
    thread = threading.Thread(target=follower.serve_followers, daemon=True)
    thread.start()
    return (leader, leading), (follower, following), thread


@pytest.mark.parametrize("mode", ["persist", "recompute"])
def test_two_ranks_switch_between_the_same_two_steps(mode: vocabulary.KvCacheMode) -> None:
    """TP=2: the follower waits while the first rank is parked, settles there, and applies the
    staged switch in the same tick: every step of both ranks ran on one weight version."""
    (leader, leading), (follower, following), thread = two_ranks()
    batch = requests()
    settled: list[bool] = []

    def during() -> None:
        for rank in (leader, follower):  # each rank writes its own staging copy (the follower on its own thread)
            for tensor in rank.staged_shard_map().live.values():
                tensor.fill_(1.0)
        follower.settle_weight_update(1, ok=True, timeout_seconds=WAIT)
        settled.append(leader.settle_weight_update(1, ok=True, timeout_seconds=WAIT))
        leader.commit_staged()

    park = Park(5, during, None)
    park.switch = base.Switch(version=1, kv_cache_mode=mode, staged=True, done=park.done)
    try:
        produced = park.run(leader, batch)
        follower.settle_weight_update(7, ok=True, timeout_seconds=WAIT)
        leader.discard_staged()  # a later staged refit failed: the follower forgets at the next tick
        Park(0, lambda: None, None).run(leader, requests(3))
    finally:
        leader.close()
        thread.join(WAIT)
    check_steps(produced, batch)
    assert settled == [True]
    assert leading.seen == following.seen, "the ranks stepped with different weights"
    assert leading.seen[:4] == [0.0] * 4 and set(leading.seen[4:]) == {1.0}, leading.seen
    assert following.calls == leading.calls
    assert bool((follower.shard_map().live[NORM] == 1.0).all())
    assert follower._settlement._written == {}, "the discard did not reach the follower"
    assert not thread.is_alive()


def test_kv_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown KV-cache mode"):
        kv_cache.check_mode("drop")
