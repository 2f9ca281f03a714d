"""Which shard takes each prompt of a batch: siblings together, prompts spread, a bound on load.

Pure code, no I/O. Used by :mod:`megafleet.sdk.generation` (every request it sends): an RL rollout
sends each prompt many times (GRPO's samples of one prompt) and continues a conversation turn after
turn, and an engine prefills a prompt once for all its samples only when they reach the same engine
(the transformers backend shares one prefill among identical prompts of a batch; megatron's prefix
cache shares KV blocks among requests on one engine). So the samples of one prompt and the turns of
one conversation go to one shard, while different prompts spread over the shards.

The choice is *bounded-load rendezvous hashing* (highest-random-weight hashing, Thaler and Ravishankar,
with the load bound of Mirrokni, Thorup and Zadimoghaddam's consistent hashing with bounded loads):

* A prompt's :class:`Key` is a chain of hashes over its blocks (:data:`BLOCK_TOKENS` token ids,
  :data:`BLOCK_CHARACTERS` characters of a text prompt, or one message of a conversation), each
  chained to the one before, plus the hash of the whole prompt (:attr:`Key.whole`). Identical
  prompts have identical keys, so a batch's samples of one prompt form one *group*; a group is never
  split over shards.
* Each group's shard is the first, in the rendezvous order of its whole-prompt hash (every shard
  ranked by a hash of the prompt's hash and the shard index), whose load stays within the bound:
  ``ceil(balance * (load already outstanding + this batch) / shards)`` sequences (the largest
  groups placed first). Distinct prompts therefore spread evenly, each on its first choice while
  that has room; removing a shard moves only the groups that preferred it (when loads allow).
* A later turn of a conversation extends the earlier turn's prompt: its chain contains the
  earlier prompt's deepest whole block (or every message of it). :class:`Memory` remembers the shard
  of each prompt's whole hash and deepest block (a bounded LRU map), and :func:`assign` sends a
  prompt whose chain reaches a remembered entry to that shard first (still within the bound).
  Blocks shared by *many* prompts (a system prompt) are not remembered, so they do not pull every
  prompt to one shard.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence

__all__ = [
    "BLOCK_CHARACTERS",
    "BLOCK_TOKENS",
    "DEFAULT_BALANCE",
    "Key",
    "Memory",
    "assign",
    "key",
    "rank",
]

BLOCK_TOKENS = 64
"""Token ids per block of a token prompt's chain: four of megatron's 16-token KV blocks (a turn's
continuation is found on its shard as long as the earlier turn had one whole block)."""
BLOCK_CHARACTERS = 256
"""Characters per block of a text prompt's chain (about 64 tokens of English)."""
DEFAULT_BALANCE = 1.0
"""The load bound's factor: a shard takes at most its fair share of the sequences in flight (rounded
up), over by less than one group only where no shard has room for a whole group. Bounded-load
consistent hashing usually allows 1.25 times the mean, but a rollout's wall time is its slowest
shard's: 1.25 would let one shard take 25% more than the mean (measured: 20 against 8 of 64 prompts on
four shards). The cache locality it would buy is small here, since a refit between batches
invalidates every cached block anyway; siblings and a conversation's turns stay together at any
bound."""


@dataclasses.dataclass(frozen=True)
class Key:
    """A prompt's identity for routing: the chained hashes of its whole blocks, and of all of it."""

    blocks: tuple[bytes, ...]
    whole: bytes


def _digest(parent: bytes, part: bytes) -> bytes:
    return hashlib.blake2b(parent + part, digest_size=16).digest()


def key(prompt: str | Sequence[int] | Sequence[Mapping[str, str]]) -> Key:
    """The :class:`Key` of a text prompt, a token-id prompt or a conversation (a list of messages)."""
    if isinstance(prompt, str):
        raw = prompt.encode()
        parts = [raw[start : start + BLOCK_CHARACTERS] for start in range(0, len(raw), BLOCK_CHARACTERS)]
        whole_blocks = len(raw) // BLOCK_CHARACTERS
        kind = b"text"
    elif prompt and isinstance(prompt[0], Mapping):
        parts = [repr(sorted(dict(message).items())).encode() for message in prompt]  # type: ignore[arg-type]
        whole_blocks = len(parts)
        kind = b"chat"
    else:
        tokens = [int(token) for token in prompt]  # type: ignore[arg-type]
        parts = [
            b"".join(token.to_bytes(8, "little", signed=True) for token in tokens[start : start + BLOCK_TOKENS])
            for start in range(0, len(tokens), BLOCK_TOKENS)
        ]
        whole_blocks = len(tokens) // BLOCK_TOKENS
        kind = b"tokens"
    chain: list[bytes] = []
    parent = kind
    for part in parts:
        parent = _digest(parent, part)
        chain.append(parent)
    whole = _digest(b"whole", parent)
    return Key(tuple(chain[:whole_blocks]), whole)


def rank(whole: bytes, shards: Sequence[int]) -> list[int]:
    """``shards`` in the rendezvous order of a prompt's whole hash: highest weight first."""

    def weight(shard: int) -> bytes:
        return hashlib.blake2b(whole + shard.to_bytes(4, "little"), digest_size=8).digest()

    return sorted(shards, key=weight, reverse=True)


class Memory:
    """The shard each recent prompt went to, by its whole hash and its deepest block: what a later
    turn of the same conversation finds. A block that is the deepest of two different prompts (a
    shared system prompt, say) is marked shared and leads nowhere. A bounded LRU map; not
    thread-safe (one event loop)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[bytes, tuple[int, bytes | None]] = collections.OrderedDict()
        """Whole hash or block -> (shard, the whole hash that put it there; ``None``: shared)."""

    def __len__(self) -> int:
        return len(self._entries)

    def recall(self, prompt: Key) -> int | None:
        """The shard remembered for the prompt itself or the deepest unshared block of its chain."""
        for entry in (prompt.whole, *reversed(prompt.blocks)):
            found = self._entries.get(entry)
            if found is not None and found[1] is not None:
                self._entries.move_to_end(entry)
                return found[0]
        return None

    def remember(self, prompt: Key, shard: int) -> None:
        """The prompt went to ``shard``: its whole hash and its deepest block (its next turn's
        chain holds that block) now point there."""
        self._entries[prompt.whole] = (shard, prompt.whole)
        self._entries.move_to_end(prompt.whole)
        for block in prompt.blocks[-1:]:
            before = self._entries.get(block)
            owner = prompt.whole if before is None or before[1] == prompt.whole else None
            self._entries[block] = (shard, owner)
            self._entries.move_to_end(block)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def assign(
    prompts: Sequence[Key],
    shards: Sequence[int],
    *,
    load: Mapping[int, int] | None = None,
    memory: Memory | None = None,
    balance: float = DEFAULT_BALANCE,
) -> list[int]:
    """The shard of every prompt, in prompt order: identical prompts share one; each group goes to its
    remembered shard, else the first of its rendezvous order, that stays within the load bound
    (sequences ``load`` says are outstanding per shard, plus this batch's). The largest groups are
    placed first, so the bound leaves room for them; a group that fits nowhere goes to the least
    loaded shard. ``memory`` (when given) learns every placement.

    Raises:
        ValueError: ``shards`` is empty.
    """
    if not shards:
        raise ValueError("no shard to assign prompts to")
    if balance < 1.0:
        raise ValueError(f"balance must be at least 1, got {balance}")
    groups: dict[bytes, list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(prompt.whole, []).append(index)
    used = {shard: int((load or {}).get(shard, 0)) for shard in shards}
    bound = math.ceil(balance * (sum(used.values()) + len(prompts)) / len(shards))
    chosen: list[int] = [shards[0]] * len(prompts)
    for whole, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0])):
        prompt = prompts[members[0]]
        order = rank(whole, shards)
        recalled = memory.recall(prompt) if memory is not None else None
        if recalled is not None and recalled in used:
            order.remove(recalled)
            order.insert(0, recalled)
        fits = [shard for shard in order if used[shard] + len(members) <= bound]
        shard = fits[0] if fits else min(order, key=lambda candidate: used[candidate])
        used[shard] += len(members)
        for index in members:
            chosen[index] = shard
        if memory is not None:
            memory.remember(prompt, shard)
    return chosen
