"""Sibling-aware routing (:mod:`megafleet.sdk.affinity`): the samples of one prompt share a shard,
distinct prompts spread within the load bound, a conversation's later turn follows its earlier turn,
a shared system prompt pulls nothing; and the router sends each request to the shard placed."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from megafleet.sdk import affinity, routing

SYSTEM = list(range(1000, 1200))  # a 200-token system prompt every prompt starts with


def prompt(seed: int, length: int = 300) -> list[int]:
    rng = random.Random(seed)
    return SYSTEM + [rng.randrange(2, 30000) for _ in range(length - len(SYSTEM))]


@settings(max_examples=60, deadline=None)
@given(
    distinct=st.integers(min_value=1, max_value=40),
    samples=st.integers(min_value=1, max_value=16),
    shards=st.integers(min_value=1, max_value=8),
    outstanding=st.lists(st.integers(min_value=0, max_value=50), min_size=8, max_size=8),
)
def test_siblings_share_a_shard_and_no_shard_passes_the_bound(
    distinct: int, samples: int, shards: int, outstanding: list[int]
) -> None:
    keys = [affinity.key(prompt(seed)) for seed in range(distinct) for _ in range(samples)]
    random.Random(distinct).shuffle(keys)
    load = {shard: outstanding[shard] for shard in range(shards)}
    chosen = affinity.assign(keys, list(range(shards)), load=load)
    by_prompt: dict[bytes, set[int]] = {}
    for key, shard in zip(keys, chosen, strict=True):
        by_prompt.setdefault(key.whole, set()).add(shard)
    assert all(len(found) == 1 for found in by_prompt.values())  # never split
    bound = math.ceil(affinity.DEFAULT_BALANCE * (sum(load.values()) + len(keys)) / shards)
    for shard in range(shards):
        placed = chosen.count(shard)
        # within the bound, over it by less than one group only where no shard had room for one
        assert not placed or load[shard] + placed < bound + samples, (shard, placed, load)


def test_distinct_prompts_spread_evenly_and_identical_ones_do_not() -> None:
    mixed = [affinity.key(prompt(seed)) for seed in range(64)]
    chosen = affinity.assign(mixed, [0, 1, 2, 3])
    counts = [chosen.count(shard) for shard in range(4)]
    assert counts == [16, 16, 16, 16], counts
    same = [affinity.key(prompt(7))] * 8
    assert len(set(affinity.assign(same, [0, 1, 2, 3]))) == 1


def test_rendezvous_moves_only_the_prompts_of_a_removed_shard() -> None:
    wholes = [affinity.key(prompt(seed)).whole for seed in range(200)]
    before = [affinity.rank(whole, [0, 1, 2, 3])[0] for whole in wholes]
    after = [affinity.rank(whole, [0, 1, 3])[0] for whole in wholes]
    moved = [index for index, (old, new) in enumerate(zip(before, after, strict=True)) if old != new]
    assert moved and all(before[index] == 2 for index in moved)


def test_a_later_turn_follows_its_conversation_but_a_shared_system_prompt_pulls_nothing() -> None:
    memory = affinity.Memory()
    shards = list(range(8))
    first_turns = [prompt(seed, 260) for seed in range(32)]
    placed = affinity.assign([affinity.key(turn) for turn in first_turns], shards, memory=memory)
    rng = random.Random(3)
    second_turns = [turn + [rng.randrange(2, 30000) for _ in range(150)] for turn in first_turns]
    followed = affinity.assign([affinity.key(turn) for turn in second_turns], shards, memory=memory)
    assert followed == placed  # every conversation stays on its shard
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{n}"}] for n in range(16)]
    chat_shards = affinity.assign([affinity.key(chat) for chat in chats], shards, memory=memory)
    longer = [[*chat, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}] for chat in chats]
    assert affinity.assign([affinity.key(chat) for chat in longer], shards, memory=memory) == chat_shards
    # prompts ending inside the system prompt's blocks mark them shared: new prompts still spread
    for seed in range(8):
        affinity.assign([affinity.key([*SYSTEM, seed])], shards, memory=memory)
    fresh = affinity.assign([affinity.key(prompt(1000 + seed)) for seed in range(64)], shards, memory=memory)
    assert len(set(fresh)) == len(shards)


def test_keys_of_text_tokens_and_chats_differ_and_blocks_chain() -> None:
    assert affinity.key("abc") != affinity.key([97, 98, 99])
    long = affinity.key(list(range(200)))
    assert len(long.blocks) == 200 // affinity.BLOCK_TOKENS
    assert affinity.key(list(range(130))).blocks == long.blocks[:2]
    assert len(affinity.key("x" * 600).blocks) == 600 // affinity.BLOCK_CHARACTERS
    assert affinity.key([]).blocks == ()


def test_the_router_sends_each_request_to_its_placed_shard_and_counts_sequences() -> None:
    router = routing.Router([routing.Frontend(i, f"http://f{i}/v1", 0) for i in range(3)])
    shards = router.place([affinity.key(prompt(1))] * 4 + [affinity.key(prompt(2))])
    assert len(set(shards[:4])) == 1
    first = router.acquire(prefer=shards[0], sequences=4)
    assert first.shard == shards[0]
    assert router.load()[first.shard] == 4
    other = router.acquire(prefer=first.shard, exclude=[first.url])  # its shard failed: the least busy
    assert other.shard != first.shard
    router.release(first, sequences=4)
    router.release(other)
    assert router.load() == {0: 0, 1: 0, 2: 0}
    assert routing.Router().place([affinity.key([1])]) == [None]
