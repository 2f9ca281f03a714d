"""The adapter: NeMo RL's ``GenerationInterface`` and ``MegatronGeneration`` over a megafleet fleet.

:class:`MegafleetGeneration` is the call surface; it keeps the version rule and the connection and
delegates the rest: refits to a :class:`~megafleet.sdk.nemo.refit_wires.Wire`, batches to
:mod:`~megafleet.sdk.nemo.batching`, what a fleet refuses to :class:`~megafleet.sdk.nemo.unsupported.Unsupported`,
the configuration pickling keeps to :class:`~megafleet.sdk.nemo.clients.Handle`.
Called by NeMo RL's GRPO on its driver (through :func:`~megafleet.sdk.nemo.factory.nemo_factory`) and,
pickled, inside its async trajectory collector (a Ray actor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megafleet import kube
from megafleet.sdk import errors, fleet, generation, routing
from megafleet.sdk import weights as weight_senders
from megafleet.sdk.nemo import async_flags as async_flags_
from megafleet.sdk.nemo import (
    batching,
    class_hooks,
    generation_counters,
    kv_invalidation,
    membership,
    refit_wire_choice,
    refit_wires,
    refs,
    reshard,
    unsupported,
    versions,
)
from megafleet.sdk.nemo import clients as connection
from megafleet.sdk.nemo import config as config_
from megafleet_protocol import vocabulary

__all__ = ["MegafleetGeneration"]

log = logging.getLogger(__name__)


class MegafleetGeneration(
    class_hooks.ClassHooks, membership.MembershipHooks, reshard.ReshardHooks, unsupported.Unsupported
):
    """NeMo RL's ``GenerationInterface`` backed by a MegatronGeneration fleet.

    Args:
        fleet_name: the fleet's name (also the model name when ``model`` is not given).
        namespace: the fleet's namespace; default: the kubeconfig's or the pod's.
        config: NeMo RL's ``policy.generation`` config; read: ``max_new_tokens``, ``temperature``,
            ``top_p``, ``top_k``, ``stop_token_ids``, ``stop_strings``, ``_pad_token_id``,
            ``ignore_eos``, ``bad_words`` (must be empty).
        weights: the trainer's tensors (HF names, full tensors), called per refit attempt, e.g.
            ``model.named_parameters``; can also be given to each refit. Not pickled.
        kubeconfig: a kubeconfig file; default: ``$KUBECONFIG``, ``~/.kube/config`` or in-cluster.
        addressing: how frontends are reached (:data:`megafleet.sdk.routing.Addressing`).
        api_key: the frontends' API key, when the fleet sets ``frontend.apiKeySecret``.
        backend: the refit transfer backend, ``gloo`` (CPU engines) or ``nccl`` (GPU engines).
        frontends: fixed frontend base URLs (e.g. from the ``<fleet>-endpoints`` ConfigMap) instead of
            the API server; generation only: refits need the API server.
        model: the served model name, when it is not the fleet's name (``frontends`` only; with the
            API server it is read from the fleet's spec).
        ready_timeout_s: bound of waiting for the fleet to be Ready.
        kv_cache_mode: the fleet's ``engine.kvCacheMode`` with fixed ``frontends`` (the API server's
            spec is used otherwise); unknown counts as not recomputing.
        max_sequence_length: the fleet's ``model.maxSequenceLength`` with fixed ``frontends``; default:
            the frontends' ``/v1/models``.
        refit_wire: how refits travel (:mod:`megafleet.sdk.nemo.refit_wires`): ``nemo`` (NeMo RL's own
            trainer broadcast over a RefitSession; the default without ``weights`` and ``frontends``)
            or ``megafleet`` (this process sends ``weights``; the default otherwise).
        trainer_bucket_bytes: ``nemo``: the trainer's exact packed-bucket target (bytes).
        trainer_gpu_memory_bytes: ``nemo``: a trainer GPU's ``total_memory``, from which NeMo RL computes
            the target (``NRL_REFIT_BUFFER_MEMORY_RATIO``, default 0.02, capped at 5 GiB); see
            :mod:`megafleet.sdk.nemo.buckets` for the order.
        join_timeout_s: ``nemo``: how long the fleet may take to join NeMo's world (the session's
            ``joinTimeoutSeconds``; NeMo's store waits 300 s).
        async_flags: NeMo RL's async flags (:mod:`megafleet.sdk.nemo.async_flags`; ``nemo_factory``
            reads them from its ``master_config``): the in-flight modes of every Refit this adapter makes.

    Raises:
        NotImplementedError: ``config`` has a non-empty ``bad_words`` or asks for colocated inference.
    """

    def __init__(
        self,
        fleet_name: str,
        namespace: str | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        weights: weight_senders.NamedTensors | None = None,
        kubeconfig: str | Path | None = None,
        addressing: routing.Addressing = "service",
        api_key: str | None = None,
        backend: vocabulary.CollectiveBackend = "gloo",
        frontends: Sequence[str] | None = None,
        model: str | None = None,
        ready_timeout_s: float = fleet.DEFAULT_READY_TIMEOUT_SECONDS,
        kv_cache_mode: vocabulary.KvCacheMode | None = None,
        max_sequence_length: int | None = None,
        refit_wire: connection.RefitWire | None = None,
        trainer_bucket_bytes: int | None = None,
        trainer_gpu_memory_bytes: int | None = None,
        join_timeout_s: int = 240,
        async_flags: async_flags_.AsyncFlags | None = None,
    ) -> None:
        config_.refuse_unsupported_config(config or {})
        if refit_wire not in (None, "nemo", "megafleet"):
            raise ValueError(f"refit_wire must be 'nemo' or 'megafleet', not {refit_wire!r}")
        self._handle = connection.Handle(
            fleet_name=fleet_name,
            namespace=namespace,
            config=dict(config or {}),
            kubeconfig=None if kubeconfig is None else str(kubeconfig),
            addressing=addressing,
            api_key=api_key,
            backend=backend,
            frontends=None if frontends is None else tuple(url.rstrip("/") for url in frontends),
            model=model,
            ready_timeout_s=ready_timeout_s,
            kv_cache_mode=kv_cache_mode,
            max_sequence_length=max_sequence_length,
            refit_wire=refit_wire or ("megafleet" if weights is not None or frontends is not None else "nemo"),
            trainer_bucket_bytes=trainer_bucket_bytes,
            trainer_gpu_memory_bytes=trainer_gpu_memory_bytes,
            join_timeout_s=join_timeout_s,
            async_flags=async_flags,
        )
        self._kv_cache_mode = kv_cache_mode
        self._connecting = threading.Lock()
        self._clients: connection.Clients | None = None
        self._prepared = False
        self._closed = False
        self._wire: refit_wires.Wire = refit_wire_choice.choose(self._handle, self._connect, weights)
        self._trainer_version: int | None = None  # set_rollout_weight_version
        self._refit_target: int | None = None  # chosen by suspend_for_refit, kept until resume_after_refit
        self._counters = generation_counters.Counters()
        self.weight_version: int | None = None
        """The weight version the fleet serves, as far as this adapter knows."""
        self.weight_synchronizer: Any = None
        """NeMo RL reads it (``getattr(..., "weight_synchronizer", None)``) and sets it for its
        synchronizers; ``None``: GRPO calls this object's refit methods itself (vLLM's legacy order)."""
        self.dp_openai_server_base_urls: list[str | None] = list(self._handle.frontends or ())
        """The fleet's OpenAI base URLs (``.../v1``), one per routable shard; filled by
        :meth:`prepare_for_generation` when the API server is used."""
        self.cfg: dict[str, Any] = config_.nemo_cfg(self._handle.config, backend, kv_cache_mode, max_sequence_length)
        """NeMo RL's generation config as NeMo RL reads it from a MegatronGeneration: ``backend`` is
        ``megatron`` (the async rollout path), not colocated, ``mcore_generation_config`` filled in."""

    # -- pickling: only the configuration travels ------------------------------------------------

    def __reduce__(self) -> tuple[Callable[[connection.Handle], MegafleetGeneration], tuple[connection.Handle]]:
        return _from_handle, (self._handle,)

    @property
    def handle(self) -> connection.Handle:
        """The configuration this adapter reconnects from (what pickling keeps)."""
        return self._handle

    @property
    def connected(self) -> bool:
        """Whether the clients (event loop, HTTP, API server) exist yet; they are made on first use."""
        return self._clients is not None

    # -- properties NeMo RL reads ----------------------------------------------------------------

    @property
    def requires_kv_scale_sync(self) -> bool:
        """False: refits carry no FP8 KV scales."""
        return False

    @property
    def uses_native_refit(self) -> bool:
        """False: refits go through megafleet's Refit objects, not megatron-core's reshard."""
        return False

    # -- lifecycle -------------------------------------------------------------------------------

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Idempotent wake: the first call waits until the fleet is Ready (raises
        :class:`~megafleet.sdk.errors.FleetNotReady` with the condition's reason otherwise) and reads
        its weight version, KV cache mode and length limit. With ``tags`` (``weights``, ``kv_cache``:
        the Megatron synchronizer's calls inside a refit) it does nothing: the fleet never sleeps."""
        if kwargs.get("tags"):
            return True
        clients = self._connect()
        if clients.fleet is not None and not self._prepared:
            state = clients.loop.run(clients.fleet.wait_ready(self._handle.ready_timeout_s))
            self._observe(state)
            self.dp_openai_server_base_urls = [frontend.url for frontend in clients.generator.router.frontends]
        elif clients.fleet is not None and not clients.generator.router.frontends:
            clients.loop.run(clients.fleet.refresh())
        self._prepared = True
        return True

    def load_and_start(self) -> None:
        """``VllmGeneration``'s second half of a deferred start (GRPO with NeMo Gym): the fleet already
        serves, so this is :meth:`prepare_for_generation` (the frontends end up in
        :attr:`dp_openai_server_base_urls`)."""
        self.prepare_for_generation()

    def finish_generation(self, *args: Any, release_gpu: bool = True, **kwargs: Any) -> bool:
        """Nothing to release: the fleet runs in its own pods and keeps serving (non-colocated)."""
        return True

    def blocks_training(self) -> bool:
        """False: the fleet has its own GPUs, so training never waits for generation to sleep."""
        return False

    def wake_carries_weight_updates(self) -> bool:
        """False: waking the fleet (there is nothing to wake) never carries weights."""
        return False

    def invalidate_kv_cache(self) -> bool:
        """Whether no KV computed with old weights serves after the last refit, from the status of the
        fleet's last Succeeded Refit (:mod:`megafleet.sdk.nemo.kv_invalidation`): true when the
        sequences running at it were drained or aborted, or kept with ``kvCacheMode: recompute``.
        Without such a Refit or its in-flight report, and with fixed frontends: true exactly when the
        fleet's ``engine.kvCacheMode`` is ``recompute`` (unknown counts as False)."""
        mode = self._kv_cache_mode
        if self._handle.frontends is None:
            clients = self._connect()
            assert clients.fleet is not None
            api, namespace = clients.api, clients.fleet.namespace
            answer = None if api is None else clients.loop.run(self._last_refit_answer(api, namespace))
            if answer is not None:
                return answer
            if mode is None:
                self._observe(clients.loop.run(clients.fleet.get()))
                mode = self._kv_cache_mode
        return mode == "recompute"

    def shutdown(self) -> bool:
        """Delete this adapter's RefitSession (``refit_wire="nemo"``), close the clients and the event
        loop; repeated calls are safe. The fleet keeps running."""
        if self._closed:
            return True
        self._closed = True
        try:
            self._wire.close()  # refit_wire="nemo": deletes the RefitSession this adapter made
        finally:
            clients, self._clients = self._clients, None
            if clients is not None:
                try:
                    clients.loop.run(clients.aclose())
                finally:
                    clients.loop.close()
        return True

    def start_gpu_profiling(self) -> None:
        """Nothing to profile in this process: the engines run in the fleet's pods."""

    def stop_gpu_profiling(self) -> None:
        """See :meth:`start_gpu_profiling`."""

    # -- metrics ---------------------------------------------------------------------------------

    def clear_logger_metrics(self) -> None:
        """Restart the counters :meth:`get_logger_metrics` reports."""
        self._counters.clear()

    def get_logger_metrics(self) -> dict[str, Any]:
        """Counters since :meth:`clear_logger_metrics`: requests, generated tokens, truncated answers,
        samples spanning a refit and their tokens older than the sample's latest version
        (:mod:`~megafleet.sdk.nemo.generation_counters`)."""
        return self._counters.logger()

    def drain_latest_logger_metrics(self) -> dict[str, Any]:
        """:meth:`get_logger_metrics` (nothing is buffered elsewhere)."""
        return self.get_logger_metrics()

    def snapshot_step_metrics(self) -> None:
        """Start a step: :meth:`get_step_metrics` reports what happens from here."""
        self._counters.snapshot()

    def get_step_metrics(self) -> dict[str, float]:
        """Counters since :meth:`snapshot_step_metrics` (since creation without one)."""
        return self._counters.step()

    # -- generation ------------------------------------------------------------------------------

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> Any:
        """Generate for every sample of ``data`` (``input_ids``, ``input_lengths``, optional
        ``stop_strings``); returns NeMo RL's output keys, as ``type(data)`` when it is a dict type.

        Raises:
            ValueError: bad input (see :func:`check_right_padding`) or a prompt that leaves no room
                under the length limit; nothing was sent.
        """
        input_ids, input_lengths, samplings = self._requests(data, greedy)
        clients = self._connect()
        prompts = batching.prompts(input_ids, input_lengths)
        answers = clients.loop.run(self._answers(clients, prompts, samplings))
        self._counters.add(answers)
        return batching.like(data, batching.pack_outputs(input_ids, input_lengths, answers, self._pad_token_id))

    async def generate_async(self, data: Mapping[str, Any], greedy: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """``(index, single-sample output)`` for every sample, as each batched request's answers
        arrive; usable from any event loop on any thread, many at once."""
        input_ids, input_lengths, samplings = self._requests(data, greedy)
        clients = self._connect()
        prompts = batching.prompts(input_ids, input_lengths)
        fitted = await asyncio.wrap_future(clients.loop.submit(self._fit(clients, prompts, samplings)))

        async def answered(
            members: list[int], pending: concurrent.futures.Future[list[generation.Answer]]
        ) -> list[tuple[int, generation.Answer]]:
            got: list[generation.Answer] = await asyncio.wrap_future(pending)
            return list(zip(members, got, strict=True))

        requests = clients.generator.batch_requests(prompts, fitted)
        waiting = [answered(members, clients.loop.submit(request)) for members, request in requests]
        for done in asyncio.as_completed(waiting):
            for index, answer in await done:
                self._counters.add([answer])
                one = slice(index, index + 1)
                packed = batching.pack_outputs(input_ids[one], input_lengths[one], [answer], self._pad_token_id)
                yield index, batching.like(data, packed)

    async def _answers(
        self, clients: connection.Clients, prompts: list[list[int]], samplings: list[generation.Sampling]
    ) -> list[generation.Answer]:
        """Every sample's answer, in order, from batched requests (per shard and chunk: a prompt's samples,
        and the turns of one conversation, go to one shard; :mod:`megafleet.sdk.affinity`)."""
        return await clients.generator.complete_fitted(prompts, await self._fit(clients, prompts, samplings))

    async def _fit(
        self, clients: connection.Clients, prompts: list[list[int]], samplings: list[generation.Sampling]
    ) -> list[generation.Sampling]:
        """Route, then clamp every sample's ``max_tokens`` to its room; refuse (naming the sample) a
        prompt that leaves none, before any request is sent."""
        if clients.fleet is not None:
            await clients.fleet.ensure_routed()  # a scale's shards come and go in every copy
        fitted = []
        for index, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            try:
                fitted.append(await clients.generator.fit(len(prompt), sampling))
            except errors.PromptTooLong as error:
                raise errors.PromptTooLong(error.length, error.limit, what=f"the prompt at index {index}") from None
        return fitted

    def _requests(
        self, data: Mapping[str, Any], greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[generation.Sampling]]:
        if "input_ids" not in data or "input_lengths" not in data:
            raise ValueError(f"generation needs input_ids and input_lengths; got keys {sorted(data.keys())}")
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        batching.check_right_padding(input_ids, input_lengths, self._pad_token_id)
        per_sample = data.get("stop_strings")
        samplings = [
            self._sampling(greedy, per_sample[i] if per_sample is not None else None) for i in range(input_ids.shape[0])
        ]
        return input_ids, input_lengths, samplings

    def _sampling(self, greedy: bool, sample_stops: Iterable[str] | None) -> generation.Sampling:
        cfg = self.cfg
        config_.refuse_unsupported_config(cfg)
        stops = tuple(cfg.get("stop_strings") or ()) + tuple(sample_stops or ())
        return generation.Sampling(
            max_tokens=cfg.get("max_new_tokens"),
            temperature=0.0 if greedy else float(cfg.get("temperature", 1.0)),
            top_p=1.0 if greedy else float(cfg.get("top_p") or 1.0),
            top_k=0 if greedy else int(cfg.get("top_k") or 0),
            stop=tuple(dict.fromkeys(stops)),
            stop_token_ids=tuple(cfg.get("stop_token_ids") or ()),
            ignore_eos=bool(cfg.get("ignore_eos", False)),
            logprobs=True,
            text=bool(stops),  # token ids only, unless stop strings need the engine to make text
        )

    @property
    def _pad_token_id(self) -> int:
        return int(self.cfg.get("_pad_token_id", 0))

    # -- refit -----------------------------------------------------------------------------------

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, refit_backend: str | None = None
    ) -> refs.ObjectRefs:
        """The trainer's ``init_collective`` (``ip`` and ``port`` of its store, ``world_size`` ranks of
        which ``train_world_size`` are the trainer's); what it does depends on the refit wire
        (:mod:`megafleet.sdk.nemo.refit_wires`). ``refit_backend`` (the Megatron synchronizer's) picks the
        transfer backend, ``gloo`` or ``nccl``.

        Raises:
            NotImplementedError: another ``refit_backend`` (``nccl_m2n``, ``nvshmem``).
        """
        if refit_backend is not None and refit_backend not in config_.SUPPORTED_REFIT_BACKENDS:
            raise NotImplementedError(
                f"refit_backend={refit_backend!r} is not supported by megafleet: its refits send over "
                f"{' or '.join(config_.SUPPORTED_REFIT_BACKENDS)}; set mcore_generation_config.refit_backend to one"
            )
        self._wire.init_collective(ip, port, world_size, train_world_size, refit_backend)
        return refs.object_refs([True])

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any] | None) -> None:
        """The trainer's tensor list (NeMo RL's state-dict info, ``{name: (shape, dtype)}`` in its
        order); ``None`` (MegatronGeneration's call) checks nothing."""
        self._wire.prepare_refit_info(state_dict_info)

    def set_rollout_weight_version(self, version: int) -> None:
        """The trainer's name for the next weights: a later refit targets it when it is larger than
        the fleet's current version + 1 (versions never go backwards)."""
        self._trainer_version = version if self._trainer_version is None else max(self._trainer_version, version)

    def suspend_for_refit(self) -> None:
        """Start a refit (MegatronWeightSynchronizer's order): choose its target version now. The fleet
        suspends its engines itself while the Refit runs."""
        self._refit_target = self._next_version()
        self._wire.begin(self._refit_target, self._refit_modes())

    def resume_after_refit(self) -> None:
        """End the refit :meth:`suspend_for_refit` started; the fleet resumes its engines itself."""
        self._refit_target = None
        self._wire.end()

    def pause_generation_for_refit(self, *, clear_cache: bool) -> bool:
        """False: the fleet pauses itself inside each Refit (nothing is paused by this call)."""
        return False

    def resume_generation_after_refit(self) -> bool:
        """False: see :meth:`pause_generation_for_refit`."""
        return False

    def get_collective_sender_spec(self) -> refit_wires.CollectiveSenderSpec:
        """How the trainer's own broadcast should send (NeMo RL's defaults when this adapter sends)."""
        return self._wire.sender_spec()

    def get_inference_world_size(self) -> int | None:
        """The fleet's ranks in NeMo RL's world, when the refit wire knows them (else ``None``)."""
        return self._wire.inference_world_size()

    def get_refit_payload_mode(self) -> config_.RefitPayloadMode:
        """``hf_export``: refits carry the trainer's Hugging Face-named tensors."""
        return "hf_export"

    def update_weights_from_collective(
        self,
        refit_timeout_s: float | None = None,
        *,
        weights: weight_senders.NamedTensors | None = None,
        version: int | None = None,
    ) -> refs.ObjectRefs:
        """Refit the fleet to ``version`` (default: the target of this refit, see
        :mod:`megafleet.sdk.nemo.versions`) and return once it serves it.

        Raises:
            RefitFailed: the refit failed or did not finish in ``refit_timeout_s``; nothing is
                routed differently.
        """
        target = self._target() if version is None else version
        self._wire.update(target, _bound(refit_timeout_s), weights, self._refit_modes())
        self.weight_version = target
        self.sync_fleet_health()
        return refs.object_refs([True])

    def update_weights_from_checkpoint(
        self, path: str, *, version: int | None = None, refit_timeout_s: float | None = None
    ) -> bool:
        """Refit the fleet from a checkpoint every shard loads by itself (a Refit with a checkpoint source)."""
        target = self._target() if version is None else version
        timeout = _bound(refit_timeout_s)
        options = self._refit_modes().fleet_options()
        self._refit(target, lambda live: live.refit(target, checkpoint=path, timeout=timeout, **options))
        return True

    def shard_liveness_ref(self, shard_idx: int) -> refs.ObjectRef:
        """Whether shard ``shard_idx`` is Ready (from the fleet's status; with fixed frontends,
        whether it has one), as one Ray ref or a bool."""
        clients = self._connect()
        if clients.fleet is None:
            return refs.object_refs([0 <= shard_idx < len(self._handle.frontends or ())])[0]
        state = clients.loop.run(clients.fleet.get())
        alive = any(shard.index == shard_idx and shard.phase == "Ready" for shard in state.status.shards)
        return refs.object_refs([alive])[0]

    # -- internals -------------------------------------------------------------------------------

    def fleet_status(self) -> dict[str, Any]:
        """The fleet's ``status`` as the API server has it now (``{}`` with fixed frontends)."""
        clients = self._connect()
        if clients.fleet is None:
            return {}
        state = clients.loop.run(clients.fleet.get())
        return state.status.model_dump(mode="json", by_alias=True)

    def _connect(self) -> connection.Clients:
        """The clients, made on first use (also in an unpickled copy); thread-safe."""
        clients = self._clients
        if clients is not None:
            return clients
        with self._connecting:
            if self._clients is None:
                if self._closed:
                    raise errors.FleetError(f"MegafleetGeneration of fleet {self._handle.fleet_name} was shut down")
                loop = connection.Loop()
                found, generator, api = loop.run(connection.make_clients(self._handle))
                self._clients = connection.Clients(loop, found, generator, api)
            return self._clients

    def _observe(self, state: fleet.FleetState) -> None:
        """Take the fleet's weight version, KV cache mode and length limit from one observed state."""
        refit_state = state.status.refit
        current = refit_state.current_version if refit_state is not None else None
        self.weight_version = current if current is not None else state.status.weight_version
        if state.spec is not None:
            self._kv_cache_mode = state.spec.engine.kv_cache_mode
            mode = config_.kv_cache_management_mode(self._handle.config, self._kv_cache_mode)
            self.cfg["mcore_generation_config"]["kv_cache_management_mode"] = mode
            self.cfg["mcore_generation_config"]["max_model_len"] = state.spec.model.max_sequence_length

    def _refit(self, version: int, start: Callable[[fleet.Fleet], Coroutine[Any, Any, fleet.RefitResult]]) -> None:
        clients = self._connect()
        if clients.fleet is None:
            raise errors.FleetError("refits need the API server: this adapter was made with fixed frontends")
        result: fleet.RefitResult = clients.loop.run(start(clients.fleet))
        self.weight_version = version
        log.info("refit %s: version %d on shards %s", result.name, version, list(result.members))

    async def _last_refit_answer(self, api: kube.Api, namespace: str) -> bool | None:
        """:func:`~megafleet.sdk.nemo.kv_invalidation.answer` for the fleet's last Succeeded Refit."""
        last = kv_invalidation.last_refit(await api.list("Refit", namespace=namespace), self._handle.fleet_name)
        answer = None if last is None else kv_invalidation.answer(last)
        if last is not None:
            log.info("invalidate_kv_cache: %s after Refit %s", answer, last["metadata"]["name"])
        return answer

    def _refit_modes(self) -> async_flags_.RefitModes:
        """The in-flight modes of this refit's Refit, from NeMo RL's async flags: the factory's
        ``master_config``, else ``validate_settings``', else the generation config's KV mode."""
        flags = async_flags_.resolve(
            self._handle.async_flags,
            self.validated_flags(),
            async_flags_.from_generation_config(self._handle.config),
        )
        modes = async_flags_.modes_for(flags)
        log.info("refit modes %s from %s", modes, flags.source)
        return modes

    def _target(self) -> int:
        """The version this refit sends: the one :meth:`suspend_for_refit` chose, else a new one."""
        return self._refit_target if self._refit_target is not None else self._next_version()

    def _next_version(self) -> int:
        """The version rule (:func:`megafleet.sdk.nemo.versions.next_version`) on the fleet's current version."""
        clients = self._connect()
        if clients.fleet is not None:
            self._observe(clients.loop.run(clients.fleet.get()))
        return versions.next_version(self.weight_version, self._trainer_version)


def _from_handle(handle: connection.Handle) -> MegafleetGeneration:
    """Unpickling: a new adapter from the configuration; it connects on first use."""
    return MegafleetGeneration(
        handle.fleet_name,
        handle.namespace,
        config=handle.config,
        kubeconfig=handle.kubeconfig,
        addressing=handle.addressing,
        api_key=handle.api_key,
        backend=handle.backend,
        frontends=handle.frontends,
        model=handle.model,
        ready_timeout_s=handle.ready_timeout_s,
        kv_cache_mode=handle.kv_cache_mode,
        max_sequence_length=handle.max_sequence_length,
        refit_wire=handle.refit_wire,
        trainer_bucket_bytes=handle.trainer_bucket_bytes,
        trainer_gpu_memory_bytes=handle.trainer_gpu_memory_bytes,
        join_timeout_s=handle.join_timeout_s,
        async_flags=handle.async_flags,
    )


def _bound(refit_timeout_s: float | None) -> float:
    return fleet.DEFAULT_REFIT_TIMEOUT_SECONDS if refit_timeout_s is None else refit_timeout_s
