"""megatron-core's own refit receiver on this rank: the trainer's hand-built refit group and
``prepare_swap_model_weights``/``swap_model_weights`` into the live ``GPTModel``.

Called by the engine's megatron-native refits (:mod:`megafleet_engine.refit_attempts.megatron_group`)
through :meth:`.backend.MegatronBackend.native_receiver`: :func:`unsupported` when a join is asked for,
:meth:`NativeRefit.connect` on the join's thread, then :meth:`RefitGroup.prepare` and each
:meth:`RefitGroup.swap` on the backend thread, :meth:`RefitGroup.close` at leave.

The group is the one NeMo RL's Megatron synchronizer (``init_collective_mcore_generation``) builds on
every rank of both sides, which is what makes them one group: a ``TCPStore`` client at ``port + 1``
counted in the trainer's ``world_size``; a ``ProcessGroup`` over ``PrefixStore("refit/")`` with a Gloo
backend over ``PrefixStore("cpu/")`` as its default (the plan's object collectives run on CPU) and,
for the ``nccl`` copy service, an NCCL backend over ``PrefixStore("cuda/")`` for CUDA tensors; group
name ``refit``; registered in torch.distributed's world map with an identity rank map, *next to* the
engine's own groups (never as the default group). This rank is ``rank_offset + local rank`` in it.

megatron-core plans from the model's ``pg_collection``: a destination's parallel-group ranks are
its own world's ranks plus ``dst_rank_offset``. NeMo passes ``T`` (the trainer's world size) because
its inference ranks form one world; each megafleet shard is a world of its own, so a shard passes its
own first rank (``rank_offset``), which is ``T`` for the first shard and keeps every shard's ranks
distinct in the plan. The trainer's own ``dst_rank_offset`` only names its plan cache entry.

Invariants: the swap writes into the live parameters' storage (megatron-core receives into
contiguous parameter slices or copies into them), so captured CUDA graphs stay valid; the copy
service is built for this group (never megatron's per-backend-name cache, which would outlive a
rejoin); every op of the group ends within the join's ``timeout_seconds`` (Gloo's timeout, NCCL's).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
from typing import Any, Literal

import torch

__all__ = ["GROUP_NAME", "MIN_VERSION", "NativeRefit", "RefitGroup", "installed_version", "unsupported"]

log = logging.getLogger(__name__)

GROUP_NAME = "refit"
"""The refit group's name (NeMo's ``init_collective_mcore_generation``)."""
MIN_VERSION = (0, 17)
"""The first megatron-core with ``prepare_swap_model_weights`` and rank offsets (0.16 has neither)."""

CopyBackend = Literal["gloo", "nccl"]


def installed_version() -> str | None:
    """megatron-core's version string, or ``None`` when it is not installed."""
    try:
        core = importlib.import_module("megatron.core")
    except ImportError:
        return None
    return str(getattr(core, "__version__", "unknown"))


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def unsupported() -> str | None:
    """Why this process cannot take megatron-core's refit (naming the installed version), or ``None``."""
    version = installed_version()
    if version is None:
        return "megatron-core is not installed; megatron-native refits need megatron-core >= 0.17"
    if version != "unknown" and _version_tuple(version)[:2] < MIN_VERSION:
        return (
            f"the installed megatron-core {version} has no prepare_swap_model_weights/swap_model_weights with "
            "rank offsets; megatron-native refits need megatron-core >= 0.17"
        )
    try:
        refit = importlib.import_module("megatron.core.resharding.refit")
    except ImportError as error:
        return f"megatron-core {version} has no megatron.core.resharding.refit ({error}); it needs >= 0.17"
    missing = [name for name in ("prepare_swap_model_weights", "swap_model_weights") if not hasattr(refit, name)]
    if missing:
        return f"megatron-core {version} lacks {', '.join(missing)}; megatron-native refits need >= 0.17"
    return None


@dataclasses.dataclass(frozen=True)
class NativeRefit:
    """This rank's model as a destination of megatron-core's reshard (``model``: the unwrapped
    ``GPTModel`` with its ``pg_collection``, ``device``: this rank's CUDA device index)."""

    model: Any
    device: int

    def unsupported(self) -> str | None:
        return unsupported()

    def connect(
        self,
        *,
        address: str,
        port: int,
        world_size: int,
        rank: int,
        rank_offset: int,
        copy_backend: CopyBackend,
        timeout_seconds: float,
    ) -> RefitGroup:
        """Join the trainer's refit group as ``rank`` of ``world_size`` (blocks until every rank of
        both sides built its Gloo backend: the Gloo full mesh is a rendezvous; call it off the
        backend thread). ``rank_offset`` is the shard's first rank (the plan's ``dst_rank_offset``)."""
        from torch.distributed import distributed_c10d as c10d

        reason = unsupported()
        if reason is not None:
            raise RuntimeError(reason)
        if copy_backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown copy backend {copy_backend!r}: gloo or nccl")
        timeout = datetime.timedelta(seconds=timeout_seconds)
        store = torch._C._distributed_c10d.TCPStore(
            host_name=address, port=port + 1, world_size=world_size, is_master=False, timeout=timeout
        )
        prefixed = c10d.PrefixStore(f"{GROUP_NAME}/", store)
        group = c10d.ProcessGroup(prefixed, rank, world_size)
        gloo = c10d.ProcessGroupGloo(c10d.PrefixStore("cpu/", prefixed), rank, world_size, timeout)
        gloo._set_sequence_number_for_group()
        group._register_backend(torch.device("cpu"), c10d.ProcessGroup.BackendType.GLOO, gloo)
        group._set_default_backend(c10d.ProcessGroup.BackendType.GLOO)
        if copy_backend == "nccl":
            torch.cuda.set_device(self.device)
            options = c10d.ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = c10d.ProcessGroupNCCL(c10d.PrefixStore("cuda/", prefixed), rank, world_size, options)
            nccl._set_sequence_number_for_group()
            group._register_backend(torch.device("cuda"), c10d.ProcessGroup.BackendType.NCCL, nccl)
        name: Any = GROUP_NAME  # a plain str: torch's GroupName type is newer than some torch releases
        group._set_group_name(name)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        c10d._world.pg_map[group] = ("gloo", prefixed)
        c10d._world.pg_names[group] = name
        log.info("joined the trainer's refit group as rank %d of %d (%s copy service)", rank, world_size, copy_backend)
        return RefitGroup(self.model, self.device, store, group, rank_offset, copy_backend)


class RefitGroup:
    """The trainer's refit group as this rank joined it, and megatron-core's calls over it."""

    def __init__(
        self, model: Any, device: int, store: Any, group: Any, rank_offset: int, copy_backend: CopyBackend
    ) -> None:
        self.model = model
        self.device = device
        self.store = store  # kept: the group's store client lives as long as the group
        self.group = group
        self.rank_offset = rank_offset
        self.copy_backend = copy_backend
        self._service: Any = None
        self.closed = False

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    def prepare(self) -> None:
        """``prepare_swap_model_weights`` as a destination: the plan, built collectively with every
        trainer rank (an all-gather of parameter metadata over Gloo), cached by megatron-core."""
        refit = importlib.import_module("megatron.core.resharding.refit")
        torch.cuda.set_device(self.device)
        refit.prepare_swap_model_weights(
            None, self.model, group=self.group, src_rank_offset=0, dst_rank_offset=self.rank_offset
        )

    def swap(self) -> tuple[int, int]:
        """One ``swap_model_weights`` as a destination (collective with every trainer rank's); returns
        the number of parameters and persistent buffers it wrote and their bytes."""
        refit = importlib.import_module("megatron.core.resharding.refit")
        torch.cuda.set_device(self.device)
        if self._service is None:
            services = importlib.import_module("megatron.core.resharding.copy_services")
            service_class = services.NCCLCopyService if self.copy_backend == "nccl" else services.GlooCopyService
            self._service = service_class(group=self.group)
        refit.swap_model_weights(
            None,
            self.model,
            refit_method=self._service,
            group=self.group,
            src_rank_offset=0,
            dst_rank_offset=self.rank_offset,
        )
        tensors = importlib.import_module("megatron.core.resharding.utils").get_refit_tensor_dict(self.model)
        return len(tensors), sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())

    def close(self) -> None:
        """Leave the group: unregister it from torch.distributed's world map, shut its backends down
        and drop megatron-core's cached plans (they name this group's ranks). Idempotent; best
        effort (a peer already gone is no error here)."""
        from torch.distributed import distributed_c10d as c10d

        if self.closed:
            return
        self.closed = True
        for table in (c10d._world.pg_group_ranks, c10d._world.pg_map, c10d._world.pg_names):
            table.pop(self.group, None)
        try:
            self.group.shutdown()
        except Exception as error:  # a backend that cannot shut down (an old torch, a broken peer)
            log.info("shutting the refit group down: %s", error)
        try:
            importlib.import_module("megatron.core.resharding.refit").clear_plan_cache()
        except (ImportError, AttributeError) as error:
            log.info("clearing megatron-core's plan cache: %s", error)
        self._service = None
