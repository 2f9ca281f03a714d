"""NeMo RL's M-to-N reshard (``refit_transport: nccl_reshard``) over a fleet, in the order NeMo's
``NcclReshardWeightSynchronizer`` calls it: ``init_collective`` (NeMo's world, for the misc tensors),
``init_nccl_reshard_comm_group`` (every training pipeline stage's communicator), then
``prepare_nccl_reshard_refit_info`` (what the bulk is and where it goes), and per step
``nccl_reshard_refit``; after a lost shard, ``rebuild_collective`` and ``rebuild_nccl_reshard_comm_group``
over the survivors (its membership), then the refit info again.

:class:`ReshardHooks` is a base of :class:`~megafleet.sdk.nemo.adapter.MegafleetGeneration`. Each
call goes through the RefitSession that ``init_collective`` made
(:class:`~megafleet.sdk.nemo.refit_wire_nemo.NemoWire`): the stages become its ``nemoReshard`` and the
members join them beside NeMo's world; the refit info is checked here (its inference ranks against the
fleet's, no grouped MoE experts) and stored for the operator; each refit is a Refit through the
session, which the operator runs as the members' reshard. Each call returns once the fleet is done,
as NeMo's ``ray.get`` of both sides' futures expects (the trainer's futures run meanwhile).
"""

from __future__ import annotations

from typing import Any

from megafleet.sdk import fleet
from megafleet.sdk.nemo import async_flags, refit_wire_nemo, refit_wires, refs
from megafleet_protocol.refit import nemo_reshard_info

__all__ = ["ReshardHooks"]


class ReshardHooks:
    """NeMo RL's ``MegatronGeneration`` reshard methods (the seed's line)."""

    _wire: refit_wires.Wire
    _reshard_info: nemo_reshard_info.ReshardInfo | None = None
    weight_version: int | None

    def set_refit_membership(self, membership: Any) -> None:
        raise NotImplementedError  # the membership hooks'

    def refit_inference_ranks(self) -> int | None:
        raise NotImplementedError  # the membership hooks'

    def sync_fleet_health(self) -> None:
        raise NotImplementedError  # the membership hooks'

    def _target(self) -> int:
        raise NotImplementedError  # the adapter's

    def _refit_modes(self) -> async_flags.RefitModes:
        raise NotImplementedError  # the adapter's

    def init_nccl_reshard_comm_group(
        self, *, pp_ips: list[str], pp_ports: list[int], pp_size: int, train_ranks_per_stage: int, sub_world_size: int
    ) -> refs.ObjectRefs:
        """Have the fleet join every training pipeline stage's communicator (stage ``s``'s store at
        ``pp_ips[s]:pp_ports[s]``, ``sub_world_size`` ranks of which ``train_ranks_per_stage`` are
        the stage's trainer ranks) beside NeMo's world; returns once every member joined.

        Raises:
            ValueError: ``pp_size`` stages are not what ``pp_ips``/``pp_ports`` name, or they do not
                fit the session's world (``sub_world_size`` is not ``train_ranks_per_stage`` plus the
                fleet's ranks); nothing was changed.
            RuntimeError: no ``init_collective`` before.
            NotImplementedError: ``refit_wire="megafleet"`` (the reshard is the trainer's own wire).
            RefitFailed: the members could not join.
        """
        wire = self._nemo_wire()
        if not pp_size == len(pp_ips) == len(pp_ports):
            raise ValueError(f"pp_size {pp_size} stages, but {len(pp_ips)} pp_ips and {len(pp_ports)} pp_ports")
        wire.join_stages(pp_ips, pp_ports, train_ranks_per_stage, sub_world_size)
        return refs.object_refs([True])

    def rebuild_nccl_reshard_comm_group(
        self,
        membership: Any,
        *,
        pp_ips: list[str],
        pp_ports: list[int],
        pp_size: int,
        train_ranks_per_stage: int,
        sub_world_size: int,
    ) -> refs.ObjectRefs:
        """NeMo's rebuild of the stage communicators over ``membership``'s shards (after
        ``rebuild_collective`` made the session of exactly them): the same as
        :meth:`init_nccl_reshard_comm_group` on that session.

        Raises:
            ValueError: a membership NeMo would not make, or stages that do not fit its world.
        """
        self._nemo_wire()
        self.set_refit_membership(membership)
        return self.init_nccl_reshard_comm_group(
            pp_ips=pp_ips,
            pp_ports=pp_ports,
            pp_size=pp_size,
            train_ranks_per_stage=train_ranks_per_stage,
            sub_world_size=sub_world_size,
        )

    def prepare_nccl_reshard_refit_info(self, refit_info: dict[str, Any]) -> None:
        """Read and check NeMo's M-to-N reshard refit info (its trainer's
        ``prepare_nccl_reshard_refit_info``, wire-safe form) and store it for the session's refits
        (at once when the session has its stages, else when it gets them).

        Raises:
            ValueError: it does not parse, names grouped MoE experts, or was built for another number
                of inference ranks than the refit membership's (after a rebuild) or the fleet's (when
                the API server is known).
        """
        parsed = nemo_reshard_info.ReshardInfo.parse(refit_info)
        ranks = self.refit_inference_ranks()
        if ranks is not None and parsed.gen_world_size not in (0, ranks):
            raise ValueError(
                f"NeMo's reshard refit info was built for {parsed.gen_world_size} inference ranks; the fleet "
                f"has {ranks} in the trainer's world"
            )
        self._reshard_info = parsed
        if isinstance(self._wire, refit_wire_nemo.NemoWire):
            self._wire.prepare_reshard_info(refit_info)

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> refs.ObjectRefs:
        """Refit the fleet by NeMo's M-to-N reshard to this refit's version (see
        :mod:`megafleet.sdk.nemo.versions`) and return once it serves it.

        Raises:
            RuntimeError: no stages or no refit info yet.
            NotImplementedError: ``refit_wire="megafleet"``.
            RefitFailed: the refit failed or did not finish in ``refit_timeout_s``.
        """
        wire = self._nemo_wire()
        target = self._target()
        timeout = fleet.DEFAULT_REFIT_TIMEOUT_SECONDS if refit_timeout_s is None else refit_timeout_s
        wire.reshard(target, timeout, self._refit_modes())
        self.weight_version = target
        self.sync_fleet_health()
        return refs.object_refs([True])

    def _nemo_wire(self) -> refit_wire_nemo.NemoWire:
        if not isinstance(self._wire, refit_wire_nemo.NemoWire):
            raise NotImplementedError(
                "NeMo's M-to-N reshard (refit_transport='nccl_reshard') is the trainer's own wire: make the "
                "adapter with refit_wire='nemo' (the default without weights= and frontends=)"
            )
        return self._wire
