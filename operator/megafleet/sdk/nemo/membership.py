"""NeMo RL's refit membership over a fleet: which shards take part in refits after a shard was lost
(``set_refit_membership``), their rebuilt ranks (``_refit_ranked_workers``), and the rebuild of the
trainer's world over them (``rebuild_collective``; its reshard stages are :mod:`.reshard`'s); NeMo's
fleet-health monitor fed from the fleet's shard states (``attach_fleet_health``).

:class:`MembershipHooks` is a base of :class:`~megafleet.sdk.nemo.adapter.MegafleetGeneration`.
NeMo's membership (``nemo_rl.weight_sync.membership.RefitMembership``, read by its attributes) packs
the surviving shards in ascending index after the trainer's ranks, ``workers_per_shard`` ranks each;
the operator packs a RefitSession's ``spec.shards`` the same way, so the trainer's rebuilt world and
the fleet's agree rank for rank. A rebuild is a new RefitSession over those shards (the old one, which
the lost member broke, is deleted); a shard outside it heals meanwhile and stays ``Stale`` until a
completed refit after it rejoins at a later rebuild.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megafleet.sdk.nemo import fleet_health, refit_wires, refs

__all__ = ["Membership", "MembershipHooks", "RankedWorker"]


@dataclasses.dataclass(frozen=True)
class Membership:
    """NeMo's ``RefitMembership`` as read: ``shard_prefixes`` maps each surviving shard to its rank
    prefix in the inference block (insertion order = ascending shard index)."""

    world_size: int
    train_world_size: int
    shard_prefixes: dict[int, int]
    workers_per_shard: int

    @classmethod
    def of(cls, membership: Any) -> Membership:
        """Read NeMo's object (or a mapping with the same keys); :class:`ValueError` when it is not one
        NeMo's ``plan_refit_membership`` makes (survivors packed in ascending order, no gaps)."""

        def read(key: str) -> Any:
            return membership.get(key) if isinstance(membership, Mapping) else getattr(membership, key, None)

        prefixes = {int(shard): int(prefix) for shard, prefix in dict(read("shard_prefixes") or {}).items()}
        sizes = [int(read(key) or 0) for key in ("world_size", "train_world_size", "workers_per_shard")]
        found = cls(sizes[0], sizes[1], prefixes, sizes[2])
        shards = sorted(prefixes)
        if not shards or found.workers_per_shard < 1 or found.train_world_size < 1:
            raise ValueError(f"a refit membership needs surviving shards and positive sizes, not {found}")
        packed = {shard: position * found.workers_per_shard for position, shard in enumerate(shards)}
        if prefixes != packed or found.world_size != found.train_world_size + len(shards) * found.workers_per_shard:
            raise ValueError(
                f"refit membership {found} is not NeMo's packing of shards {shards}: prefixes {packed}, world size "
                f"{found.train_world_size + len(shards) * found.workers_per_shard}"
            )
        return found

    @property
    def shards(self) -> list[int]:
        return sorted(self.shard_prefixes)


@dataclasses.dataclass(frozen=True)
class RankedWorker:
    """One inference rank in the rebuilt world: ``shard``'s rank ``local_rank`` is ``rank`` now and
    was ``original_rank`` in the full world (``shard * workers_per_shard + local_rank``), both counted
    from the first inference rank as NeMo counts them."""

    shard: int
    local_rank: int
    rank: int
    original_rank: int


class MembershipHooks:
    """The membership and fleet-health parts of NeMo RL's ``MegatronGeneration`` (the seed's line)."""

    _wire: refit_wires.Wire
    _refit_membership: Membership | None = None
    _fleet_monitor: fleet_health.Feed | None = None

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, refit_backend: str | None = None
    ) -> refs.ObjectRefs:
        raise NotImplementedError  # the adapter's

    def fleet_status(self) -> Mapping[str, Any]:
        raise NotImplementedError  # the adapter's

    def get_inference_world_size(self) -> int | None:
        raise NotImplementedError  # the adapter's

    def set_refit_membership(self, membership: Any) -> None:
        """Record which shards take part in refits from now on (NeMo calls it before it rebuilds):
        the next :meth:`rebuild_collective` makes the fleet's world of exactly them.

        Raises:
            ValueError: not a membership NeMo's ``plan_refit_membership`` makes.
        """
        self._refit_membership = Membership.of(membership)
        self._wire.set_membership(self._refit_membership.shards)

    def refit_inference_ranks(self) -> int | None:
        """The inference ranks in the trainer's world now: the membership's, else the fleet's (if known)."""
        membership = self._refit_membership
        if membership is not None:
            return membership.world_size - membership.train_world_size
        return self.get_inference_world_size()

    def refit_ranked_workers(self) -> list[RankedWorker]:
        """The inference ranks that take part in refits, with their rebuilt and original ranks
        (NeMo's ``_refit_ranked_workers``); empty before any membership was set (every shard takes part,
        at its original rank)."""
        membership = self._refit_membership
        if membership is None:
            return []
        per_shard = membership.workers_per_shard
        return [
            RankedWorker(shard, local, prefix + local, shard * per_shard + local)
            for shard, prefix in membership.shard_prefixes.items()
            for local in range(per_shard)
        ]

    _refit_ranked_workers = refit_ranked_workers

    def rebuild_collective(self, membership: Any, ip: str, port: int) -> refs.ObjectRefs:
        """NeMo's rebuild over the surviving shards (its fresh store at ``ip:port``): a new RefitSession
        whose world is the membership's (``spec.shards``), replacing the one a lost member broke; the
        refit info NeMo sends again next goes to it.

        Raises:
            ValueError: a membership NeMo would not make, or shards the fleet does not have.
            RefitFailed: the survivors could not join.
        """
        self.set_refit_membership(membership)
        assert self._refit_membership is not None
        return self.init_collective(
            ip, port, self._refit_membership.world_size, train_world_size=self._refit_membership.train_world_size
        )

    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        """Give NeMo's fleet-health monitor the fleet's shard states from now on (at once, and after
        every refit; :meth:`sync_fleet_health` any time): a shard the operator re-places is
        ``restarting``, one loaded with old weights ``stale``, one serving the fleet's version
        ``healthy`` again (NeMo's only way back is a completed refit, and so is the fleet's).
        ``selector`` is NeMo's; the fleet's frontends route by themselves.

        Raises:
            ValueError: the monitor tracks another number of shards than the fleet has.
        """
        feed = fleet_health.Feed(monitor)
        feed.check(self.fleet_status())
        self._fleet_monitor = feed
        self.sync_fleet_health()

    def sync_fleet_health(self) -> None:
        """Fold the fleet's shard states into the attached monitor (nothing without one)."""
        if self._fleet_monitor is not None:
            self._fleet_monitor.sync(self.fleet_status())
