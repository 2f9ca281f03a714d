"""The ports of an engine pod and the rule for a refit attempt's rendezvous port.

The operator declares these ports on the pods and Services it builds and calls the agent on
:data:`AGENT_PORT`; the engine's settings default to them; the trainer SDK and the operator both
derive an attempt's port with :func:`attempt_port`.
"""

from __future__ import annotations

__all__ = ["AGENT_PORT", "MASTER_PORT", "METRICS_PORT", "PEER_PORT", "attempt_port"]

AGENT_PORT = 8471
"""The pod agent's API (the operator's calls)."""
METRICS_PORT = 9400
"""The engine's Prometheus ``/metrics``."""
MASTER_PORT = 29500
"""Rank 0's torch.distributed rendezvous inside a shard (torch's default)."""
PEER_PORT = 29600
"""Where a shard that sends its weights to shards catching up from it (``POST /v1/peer/send``) listens:
shard rank ``r``'s store at ``PEER_PORT + r`` on its pod's address (one copy at a time per engine)."""


def attempt_port(base_port: int, attempt: int) -> int:
    """The rendezvous port of attempt ``attempt`` (1, 2, ...) of a Refit whose spec names
    ``base_port``: a fresh port per attempt, so a retry never meets a stale store or group."""
    if attempt < 1:
        raise ValueError(f"attempts count from 1, got {attempt}")
    return base_port + attempt - 1
