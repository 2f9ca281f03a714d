"""Names, labels, annotations and environment keys shared by the operator, its objects and the engine.

Mirrored in docs/api.md's object list; every key lives under the ``megafleet.dev/`` prefix.
"""

from __future__ import annotations

PREFIX = "megafleet.dev"
FIELD_MANAGER = "megafleet-operator"

LABEL_FLEET = f"{PREFIX}/fleet"
"""On every object a fleet owns: the fleet's name."""
LABEL_SHARD = f"{PREFIX}/shard"
"""On shard objects (pods, Services): the shard index."""
LABEL_POD_INDEX = f"{PREFIX}/pod-index"
"""On pods: the pod's index inside its shard (pod 0 hosts the frontend rank)."""
LABEL_COMPONENT = f"{PREFIX}/component"
"""engine, frontends, frontend (one shard's, before the frontends Services), ranks, endpoints or agent-token."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_TEMPLATE_HASH = f"{PREFIX}/template-hash"
"""On pods: a hash of the spec fields that shape the pod; a change rolls the shard."""

AGENT_TOKEN_KEY = "token"
AGENT_TOKEN_MOUNT = "/var/run/megafleet/agent"
TMP_MOUNT = "/tmp"
"""A per-pod emptyDir: HOME and scratch space (the root filesystem is read-only)."""
SHM_MOUNT = "/dev/shm"
"""A memory-backed emptyDir (``spec.pod.shmSize``): NCCL and torch need more than the runtime's 64 MiB."""
CACHE_MOUNT = "/var/cache/megafleet"
"""Where every library cache of the engine points (``spec.pod.cache``): an emptyDir or the user's volume."""
VOLUME_AGENT_TOKEN, VOLUME_TMP, VOLUME_SHM, VOLUME_CACHE = "agent-token", "tmp", "megafleet-shm", "megafleet-cache"
OPERATOR_VOLUMES = (VOLUME_AGENT_TOKEN, VOLUME_TMP, VOLUME_SHM, VOLUME_CACHE)
"""The volume names the operator gives engine pods; a user volume may not take them (nor any ``megafleet-`` name)."""
OPERATOR_MOUNTS = (AGENT_TOKEN_MOUNT, TMP_MOUNT, SHM_MOUNT, CACHE_MOUNT)
"""The engine container's mount paths the operator owns; a user mount may not take or cover one."""


def frontends_service(fleet: str, group: int) -> str:
    """The ClusterIP Service of a group of shards' frontends (one port per shard); its address and
    the shard's port are the shard's published endpoint."""
    return f"{fleet}-f{group}"


def frontend_port_name(shard: int) -> str:
    """The name of a frontend pod's HTTP container port: the shard's port of its frontends Service
    targets it by name, so only that shard's frontend pod carries the shard's endpoint."""
    return f"shard-{shard}"


def frontend_service(fleet: str, shard: int) -> str:
    """The ClusterIP Service of one shard's frontend, as operators before the frontends Services made
    it; a fleet that has one keeps that scheme (:func:`megafleet.desired.legacy_frontends`)."""
    return f"{fleet}-s{shard}"


def ranks_service(fleet: str) -> str:
    """The headless Service giving every pod of a fleet of multi-pod shards a DNS name (the master
    address is pod 0's)."""
    return f"{fleet}-ranks"


def shard_ranks_service(fleet: str, shard: int) -> str:
    """The headless Service of one shard, as operators before the fleet's ranks Service made it: kept
    while its shard lives (its pods' master address may name it)."""
    return f"{fleet}-s{shard}-ranks"


def pod(fleet: str, shard: int, index: int) -> str:
    return f"{fleet}-s{shard}-p{index}"


def agent_secret(fleet: str) -> str:
    return f"{fleet}-agent-token"


def endpoints_configmap(fleet: str) -> str:
    """The ConfigMap RL jobs read the frontend URLs from."""
    return f"{fleet}-endpoints"
