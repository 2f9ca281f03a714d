"""The version a refit targets, whatever order NeMo RL calls the adapter in.

Called by the adapter when a refit starts (``suspend_for_refit`` in the Megatron synchronizer's
order, else ``update_weights_from_collective``). Pure. Versions never go backwards: the target is
above the fleet's current version, and the trainer's own number wins when it is larger.
"""

from __future__ import annotations

__all__ = ["next_version"]


def next_version(current: int | None, trainer_version: int | None) -> int:
    """``max(current + 1, trainer_version)``; a fleet with no version yet (``None``) starts at 0."""
    candidates = [0 if current is None else current + 1]
    if trainer_version is not None:
        candidates.append(trainer_version)
    return max(candidates)
