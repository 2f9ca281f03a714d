"""Shared test helper (it holds no tests): the trainer's side of NeMo RL's Megatron synchronizer
(``init_collective_mcore_generation``), written from its protocol for the megatron-native tests, and
a checksum of a model's parameters that both sides compute.

:func:`refit_group` is what NeMo's trainer rank builds: the ``TCPStore`` at ``port + 1`` (rank 0
is its master, counting ``world_size`` ranks), a ``ProcessGroup`` over ``PrefixStore("refit/")`` with
a Gloo backend over ``cpu/`` as its default and, for ``nccl``, an NCCL backend over ``cuda/``; named
``refit`` and registered in torch.distributed's world map with an identity rank map. It is
independent of the engine's code (:mod:`megafleet_engine.backends.megatron.native_refit`).
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

__all__ = ["checksum", "forget_group", "refit_group"]


def refit_group(
    address: str, port: int, world_size: int, rank: int, *, refit_backend: str = "gloo", timeout_seconds: float = 60
) -> tuple[Any, Any]:
    """NeMo's refit group as trainer rank ``rank`` builds it; returns ``(store, group)`` (keep the
    store alive: rank 0 hosts it). Blocks until every rank of the group built its Gloo backend."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    store = torch._C._distributed_c10d.TCPStore(
        host_name=address, port=port + 1, world_size=world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = c10d.PrefixStore("refit/", store)
    group = c10d.ProcessGroup(prefixed, rank, world_size)
    gloo = c10d.ProcessGroupGloo(c10d.PrefixStore("cpu/", prefixed), rank, world_size, timeout)
    gloo._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), c10d.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(c10d.ProcessGroup.BackendType.GLOO)
    if refit_backend == "nccl":
        nccl = c10d.ProcessGroupNCCL(
            c10d.PrefixStore("cuda/", prefixed), rank, world_size, c10d.ProcessGroupNCCL.Options()
        )
        nccl._set_sequence_number_for_group()
        group._register_backend(torch.device("cuda"), c10d.ProcessGroup.BackendType.NCCL, nccl)
    name: Any = "refit"
    group._set_group_name(name)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    c10d._world.pg_map[group] = ("gloo", prefixed)
    c10d._world.pg_names[group] = name
    return store, group


def forget_group(group: Any) -> None:
    """Take a group built by :func:`refit_group` out of torch.distributed's world map."""
    for table in (c10d._world.pg_group_ranks, c10d._world.pg_map, c10d._world.pg_names):
        table.pop(group, None)


def checksum(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name and bytes, in name order: equal only for bit-equal weights."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()
