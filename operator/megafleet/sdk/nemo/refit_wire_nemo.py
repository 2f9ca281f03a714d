"""``refit_wire="nemo"``: NeMo RL's own trainer broadcast, received by the fleet over a RefitSession.

NeMo's policy workers send (``policy.init_collective`` at setup, ``broadcast_weights_for_collective``
or megatron-core's swap per step); this wire makes the fleet the receiving ranks (proposal 0001,
section 4), through Kubernetes objects the operator acts on:

* ``init_collective``: check ``W - T`` against the fleet's ranks and that the bucket target ``B`` is known
  (:mod:`~megafleet.sdk.nemo.buckets`), *before* creating anything; delete this adapter's older session;
  create a ``RefitSession`` (``nemoCollective``, or ``megatronNative`` when the Megatron synchronizer
  passed ``refit_backend``) owned by the fleet; store the refit info if already held; wait for ``Joined``.
* ``prepare_refit_info``: encode (:mod:`~megafleet.sdk.nemo.refit_info`); with a session, store it in
  an immutable ConfigMap the session owns, set ``spec.refitInfo`` and wait until the fleet accepted it.
* ``update`` (``update_weights_from_collective``): a ``Refit`` with ``source.session`` and the
  in-flight modes of NeMo RL's async flags, created then (or at ``begin``, the Megatron
  synchronizer's ``suspend_for_refit``); wait for ``Succeeded``. A failure
  raises :class:`~megafleet.sdk.errors.RefitFailed` naming the session's state and the restart advice.
* ``close`` (``shutdown``): delete the session (its finalizer makes the members leave).
* NeMo's M-to-N reshard: ``join_stages`` (``init_nccl_reshard_comm_group``) sets the session's
  ``nemoReshard`` and waits for ``ReshardJoined``; ``prepare_reshard_info`` stores NeMo's reshard refit
  info as ``nemoReshard.refitInfo``; ``reshard`` (``nccl_reshard_refit``) is ``update``'s Refit, which
  the operator sends to the reshard route (``update`` itself is refused on such a session).

Only the driver's adapter refits; pickled copies (the async collector) never touch this wire.
Waiting polls the API server (every :data:`POLL_SECONDS`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megafleet import kube
from megafleet.api import v1alpha1
from megafleet.sdk import errors
from megafleet.sdk import weights as weight_senders
from megafleet.sdk.nemo import async_flags, buckets, refit_info, refit_wires, sessions
from megafleet.sdk.nemo import clients as connection

__all__ = ["POLL_SECONDS", "NemoOptions", "NemoWire"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
"""How often a wait reads the session and Refit again."""
MIB = 1024 * 1024
_World = v1alpha1.NemoCollectiveSpec | v1alpha1.MegatronNativeSpec


@dataclasses.dataclass(frozen=True)
class NemoOptions:
    """The adapter's options for this wire (all pickled with its handle)."""

    trainer_bucket_bytes: int | None = None
    """The trainer's exact packed-bucket target, when known (section 5, option 2)."""
    trainer_gpu_memory_bytes: int | None = None
    """A trainer GPU's ``total_memory``, from which NeMo RL computes the target (option 3)."""
    join_timeout_s: int = 240
    """The session's ``joinTimeoutSeconds``: below NeMo's 300 s store timeout."""


class NemoWire:
    """Refits through NeMo RL's own collective (see the module docstring); one per adapter."""

    def __init__(self, connect: Callable[[], connection.Clients], fleet_name: str, options: NemoOptions) -> None:
        self._connect = connect
        self._fleet_name = fleet_name
        self._options = options
        self._handed_out: int | None = None  # B given to the trainer by sender_spec
        self._info: refit_info.Encoded | None = None
        self._session: str | None = None
        self._info_stored = False
        self._pending: tuple[int, str] | None = None  # (version, Refit) made by begin
        self._native = False  # the session is megatronNative (megatron-core plans the transfer: no refit info)
        self._bucket_bytes: int | None = None  # the nemoCollective session's B
        self._shards: list[int] | None = None  # the trainer's refit membership (None: every shard)
        self._reshard = False  # the session has NeMo's reshard stages (init_nccl_reshard_comm_group)
        self._reshard_info: refit_info.Encoded | None = None  # prepare_nccl_reshard_refit_info's
        self._reshard_stored = False

    @property
    def session(self) -> str | None:
        """The RefitSession this wire holds, if any."""
        return self._session

    # -- NeMo RL's calls --------------------------------------------------------------------------

    def sender_spec(self) -> refit_wires.CollectiveSenderSpec:
        """``B`` for the trainer's broadcast: ``trainer_bucket_bytes``, else the fleet's
        ``spec.refit.bucketSizeMiB``; remembered, so the session uses exactly what was handed out."""
        if self._handed_out is None:
            if self._options.trainer_bucket_bytes is not None:
                self._handed_out = self._options.trainer_bucket_bytes
            else:
                found = self._clients().loop.run(self._fleet())
                spec = v1alpha1.MegatronGenerationSpec.model_validate(found.get("spec") or {})
                self._handed_out = spec.refit.bucket_size_mi_b * MIB
        return refit_wires.CollectiveSenderSpec(nccl_peer="nemo", buffer_size_bytes=self._handed_out)

    def inference_world_size(self) -> int | None:
        """The fleet's ranks: ``spec.replicas`` x ranks per shard."""
        shards, per_shard = sessions.fleet_ranks(self._clients().loop.run(self._fleet()))
        return shards * per_shard

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any] | None) -> None:
        """Encode the trainer's tensor list; store it now when a session exists, else at ``init_collective``."""
        if state_dict_info is None:  # MegatronGeneration's call: megatron-core plans the transfer itself
            return
        encoded = refit_info.encode(state_dict_info)
        if self._info is not None and self._info_stored and encoded.sha256 != self._info.sha256:
            raise ValueError(
                f"the refit info changed ({self._info.tensors} -> {encoded.tensors} tensors) but RefitSession "
                f"{self._session} holds the first one: call init_collective again for a new session"
            )
        self._info = encoded
        if self._session is not None and not self._info_stored:
            self._clients().loop.run(self._store_info(self._session))

    def set_membership(self, shards: Sequence[int] | None) -> None:
        """The shards of the next session (NeMo's refit membership), packed by the operator as NeMo packs them."""
        self._shards = None if shards is None else sorted(shards)

    def init_collective(self, ip: str, port: int, world_size: int, train_world_size: int, backend: str | None) -> None:
        """Check, then create the session and wait until every shard joined NeMo's world.

        Raises:
            ValueError: the fleet cannot field ``world_size - train_world_size`` ranks, or ``B`` is
                unknown (nemoCollective); nothing was created.
            RefitFailed: the session failed to join (its reason, e.g. ``NotReady`` or ``JoinFailed``).
        """
        clients = self._clients()
        found = clients.loop.run(self._fleet())
        problem = sessions.world_check(found, world_size, train_world_size, self._shards)
        if problem is not None:
            raise ValueError(problem)
        world: _World
        if backend is None:
            ratio = buckets.memory_ratio()
            bucket = buckets.resolve(
                self._handed_out, self._options.trainer_bucket_bytes, self._options.trainer_gpu_memory_bytes, ratio
            )
            if self._handed_out is None and self._options.trainer_bucket_bytes is None:  # computed: check the ratio
                mismatch = buckets.ratio_mismatch(ratio, buckets.ray_runtime_env())
                if mismatch is not None:
                    log.warning("%s", mismatch)
                    warnings.warn(mismatch, RuntimeWarning, stacklevel=3)
            world = v1alpha1.NemoCollectiveSpec(
                address=ip, port=port, world_size=world_size, trainer_world_size=train_world_size, bucket_bytes=bucket
            )
        else:
            world = v1alpha1.MegatronNativeSpec(
                address=ip,
                port=port,
                world_size=world_size,
                trainer_world_size=train_world_size,
                copy_backend="nccl" if backend == "nccl" else "gloo",
            )
        clients.loop.run(self._open(found, world))

    def begin(self, version: int, modes: async_flags.RefitModes) -> None:
        """The Megatron synchronizer's ``suspend_for_refit``: create the Refit now (asking for
        ``modes``), so the engines drain while the trainer offloads."""
        self._require_session()
        if self._pending is None or self._pending[0] != version:
            self._pending = (version, self._clients().loop.run(self._create_refit(version, modes)))

    def update(
        self, version: int, timeout: float, weights: weight_senders.NamedTensors | None, modes: async_flags.RefitModes
    ) -> None:
        """Wait until the fleet received ``version`` over the session (creating its Refit, asking for
        ``modes``, unless ``begin`` did).

        Raises:
            ValueError: ``weights`` given (the trainer's policy sends them on this wire).
            RuntimeError: no session, or no refit info for a nemoCollective session.
            RefitFailed: the Refit failed or the session broke; the message says why and to restart.
        """
        if weights is not None:
            raise ValueError(
                "refit_wire='nemo': the trainer's policy sends the weights (broadcast_weights_for_collective); "
                "weights= is for refit_wire='megafleet'"
            )
        if self._reshard:
            raise RuntimeError(
                f"RefitSession {self._session} receives NeMo's M-to-N reshard: the trainer sends with "
                "nccl_reshard_refit, and so must this side (nccl_reshard_refit, not update_weights_from_collective)"
            )
        self._refit(version, timeout, modes)

    def _refit(self, version: int, timeout: float, modes: async_flags.RefitModes) -> None:
        session = self._require_session()
        clients = self._clients()
        pending, self._pending = self._pending, None
        name = pending[1] if pending is not None and pending[0] == version else None
        if name is None:
            name = clients.loop.run(self._create_refit(version, modes))
        clients.loop.run(self._await_refit(name, session, timeout))
        if clients.fleet is not None:
            clients.loop.run(clients.fleet.refresh())  # route to the shards at the new version now

    # -- NeMo's M-to-N reshard --------------------------------------------------------------------

    def join_stages(self, pp_ips: Sequence[str], pp_ports: Sequence[int], per_stage: int, sub_world: int) -> None:
        """NeMo's ``init_nccl_reshard_comm_group``: the stages (their stores, ``per_stage`` trainer ranks
        each, ``sub_world`` ranks in all) become the session's ``nemoReshard``; returns once every
        member joined them (and stores the reshard refit info if it was given first).

        Raises:
            ValueError: the stages do not fit the session's world; nothing was changed.
            RuntimeError: no session, or a megatron-native one (the reshard rides NeMo's collective).
            RefitFailed: the members could not join the stages.
        """
        session = self._require_session()
        if self._native:
            raise RuntimeError("NeMo's reshard rides NeMo's collective: init_collective without refit_backend")
        self._clients().loop.run(self._join_stages(session, pp_ips, pp_ports, per_stage, sub_world))

    def prepare_reshard_info(self, info: Mapping[str, Any]) -> None:
        """NeMo's reshard refit info (its wire-safe form, already checked by the adapter): stored for
        the session now when it has its stages, else when it gets them."""
        encoded = refit_info.encode_reshard(info)
        if self._reshard_info is not None and self._reshard_stored and encoded.sha256 != self._reshard_info.sha256:
            raise ValueError(
                f"NeMo's reshard refit info changed but RefitSession {self._session} holds the first one: "
                "rebuild (rebuild_collective, rebuild_nccl_reshard_comm_group) for a new session"
            )
        self._reshard_info = encoded
        if self._session is not None and self._reshard and not self._reshard_stored:
            self._clients().loop.run(self._store_reshard_info(self._session))

    def reshard(self, version: int, timeout: float, modes: async_flags.RefitModes) -> None:
        """NeMo's ``nccl_reshard_refit``: a Refit over the session, which the operator sends to the
        members' reshard route; returns once the fleet serves ``version``.

        Raises:
            RuntimeError: no session with stages, or no reshard refit info stored.
            RefitFailed: as :meth:`update`.
        """
        if not self._reshard or not self._reshard_stored:
            raise RuntimeError(
                "call init_nccl_reshard_comm_group(...) and prepare_nccl_reshard_refit_info(...) "
                "before nccl_reshard_refit"
            )
        self._refit(version, timeout, modes)

    def end(self) -> None:
        """``resume_after_refit``: the fleet resumed itself; forget a Refit ``update`` did not wait for."""
        self._pending = None

    def close(self) -> None:
        """Delete the session (the operator makes its members leave); the fleet keeps serving."""
        session, self._session = self._session, None
        if session is None:
            return
        clients = self._connect()
        assert clients.api is not None
        clients.loop.run(clients.api.delete("RefitSession", session, self._namespace(clients)))

    # -- internals --------------------------------------------------------------------------------

    def _clients(self) -> connection.Clients:
        clients = self._connect()
        if clients.api is None or clients.fleet is None:
            raise errors.FleetError(
                "refit_wire='nemo' needs the API server: this adapter was made with fixed frontends"
            )
        return clients

    def _namespace(self, clients: connection.Clients) -> str:
        assert clients.fleet is not None
        return clients.fleet.namespace

    def _api(self) -> tuple[kube.Api, str]:
        clients = self._clients()
        assert clients.api is not None
        return clients.api, self._namespace(clients)

    def _require_session(self) -> str:
        if self._session is None:
            raise RuntimeError("call init_collective(ip, port, world_size, train_world_size=...) before refitting")
        return self._session

    async def _fleet(self) -> dict[str, Any]:
        api, namespace = self._api()
        found = await api.get("MegatronGeneration", self._fleet_name, namespace)
        if found is None:
            raise errors.FleetNotFound(f"fleet {namespace}/{self._fleet_name} does not exist")
        return found

    async def _open(self, found: dict[str, Any], world: _World) -> None:
        api, namespace = self._api()
        older, self._session = self._session, None
        self._pending = None
        if older is not None:
            log.info("deleting RefitSession %s/%s: init_collective makes a new one", namespace, older)
            await api.delete("RefitSession", older, namespace)
        name = f"{self._fleet_name}-nemo-{secrets.token_hex(3)}"
        await api.create(sessions.session(name, namespace, found, world, self._options.join_timeout_s, self._shards))
        self._session, self._info_stored = name, False
        # a new world: NeMo joins its stages again and sends a reshard refit info planned for it
        self._reshard = self._reshard_stored = False
        self._reshard_info = None
        self._native = isinstance(world, v1alpha1.MegatronNativeSpec)
        self._bucket_bytes = world.bucket_bytes if isinstance(world, v1alpha1.NemoCollectiveSpec) else None
        log.info("RefitSession %s/%s: %s", namespace, name, world)
        if self._info is not None and isinstance(world, v1alpha1.NemoCollectiveSpec):
            await self._store_info(name)
        else:
            await self._await_session(name, None)

    async def _store_info(self, name: str) -> None:
        api, namespace = self._api()
        info = self._info
        assert info is not None
        owner = await api.get("RefitSession", name, namespace)
        if owner is None:
            raise errors.RefitFailed(name, f"{sessions.describe(name, None)}; {sessions.RESTART_ADVICE}")
        config_map = f"{name}-refit-info"
        await api.create(refit_info.config_map(config_map, namespace, info, owner))
        reference = refit_info.reference(config_map, info).model_dump(mode="json", by_alias=True)
        await api.patch("RefitSession", name, namespace, {"spec": {"refitInfo": reference}})
        self._info_stored = True
        await self._await_session(name, info.sha256)

    async def _join_stages(
        self, name: str, pp_ips: Sequence[str], pp_ports: Sequence[int], per_stage: int, sub_world: int
    ) -> None:
        api, namespace = self._api()
        found = await api.get("RefitSession", name, namespace)
        if found is None:
            raise errors.RefitFailed(name, f"{sessions.describe(name, None)}; {sessions.RESTART_ADVICE}")
        stages = sessions.reshard_stages(found.get("spec") or {}, pp_ips, pp_ports, per_stage, sub_world)
        reshard = stages.model_dump(mode="json", by_alias=True, exclude_none=True)
        await api.patch("RefitSession", name, namespace, {"spec": {"nemoReshard": reshard}})
        self._reshard = True
        log.info("RefitSession %s/%s: NeMo's reshard over %d stages", namespace, name, len(stages.stages))
        await self._await_session(name, None, sessions.stages_outcome)
        if self._reshard_info is not None:
            await self._store_reshard_info(name)

    async def _store_reshard_info(self, name: str) -> None:
        api, namespace = self._api()
        info = self._reshard_info
        assert info is not None
        owner = await api.get("RefitSession", name, namespace)
        if owner is None:
            raise errors.RefitFailed(name, f"{sessions.describe(name, None)}; {sessions.RESTART_ADVICE}")
        config_map = f"{name}-reshard-info"
        await api.create(refit_info.config_map(config_map, namespace, info, owner))
        reference = refit_info.reference(config_map, info).model_dump(mode="json", by_alias=True)
        await api.patch("RefitSession", name, namespace, {"spec": {"nemoReshard": {"refitInfo": reference}}})
        self._reshard_stored = True
        await self._await_session(name, info.sha256)

    async def _await_session(
        self,
        name: str,
        info_sha256: str | None,
        judge: Callable[[str, dict[str, Any] | None], tuple[str, str]] | None = None,
    ) -> None:
        """Until the session is Joined (and accepted the info, or ``judge`` says done), bounded by its
        join timeout."""
        api, namespace = self._api()
        deadline = time.monotonic() + self._options.join_timeout_s + 30
        while True:
            found = await api.get("RefitSession", name, namespace)
            if judge is not None:
                state, message = judge(name, found)
            else:
                state, message = sessions.outcome(name, found, info_sha256=info_sha256)
            if state == "done":
                return
            if state == "failed":
                raise errors.RefitFailed(name, message)
            if time.monotonic() > deadline:
                raise errors.RefitFailed(name, f"not joined after {self._options.join_timeout_s} s: {message}")
            await asyncio.sleep(POLL_SECONDS)

    async def _create_refit(self, version: int, modes: async_flags.RefitModes) -> str:
        api, namespace = self._api()
        session = self._require_session()
        if self._info is None and not self._native and not self._reshard:
            raise RuntimeError("call prepare_refit_info(policy.prepare_refit_info()) before the first refit")
        name = f"{self._fleet_name}-v{version}-{secrets.token_hex(3)}"
        await api.create(sessions.refit(name, namespace, self._fleet_name, version, session, modes))
        log.info("Refit %s/%s: version %d over RefitSession %s, %s", namespace, name, version, session, modes)
        return name

    async def _await_refit(self, name: str, session: str, timeout: float) -> None:
        api, namespace = self._api()
        deadline = time.monotonic() + timeout
        while True:
            refit_obj = await api.get("Refit", name, namespace)
            session_obj = await api.get("RefitSession", session, namespace)
            state, message = sessions.refit_outcome(name, refit_obj, session, session_obj)
            if state == "done":
                return
            if state == "failed":
                raise errors.RefitFailed(name, self._with_bucket_hint(message))
            if time.monotonic() > deadline:
                raise errors.RefitFailed(
                    name,
                    self._with_bucket_hint(
                        f"did not finish within {timeout:.0f} s ({message}); {sessions.RESTART_ADVICE}"
                    ),
                )
            await asyncio.sleep(POLL_SECONDS)

    def _with_bucket_hint(self, message: str) -> str:
        """``message`` plus the likely cause of a nemoCollective refit that fails while receiving:
        a bucket target other than the session's (NeMo's packed buckets carry no sizes)."""
        if self._bucket_bytes is None:
            return message
        return f"{message}; {buckets.mismatch_hint(self._bucket_bytes)}"
