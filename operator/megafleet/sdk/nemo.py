"""NeMo RL's ``GenerationInterface`` over a megafleet fleet: the generation side of a GRPO-style loop
whose engines run as a MegatronGeneration on Kubernetes. docs/nemo-rl.md is the user's guide.

Called by the RL training loop on its driver (NeMo RL's GRPO through :func:`nemo_factory`, or any
script), and, pickled, inside NeMo RL's async trajectory collector (a Ray actor).

Invariants:

* Surface: every public method and property of NeMo RL's ``GenerationInterface`` (main and the
  development line) and of its ``MegatronGeneration`` (main and the seed), same parameters (a union
  where they differ). Methods NeMo RL hands to ``ray.get`` return Ray object refs when Ray runs in
  this process, else ``list[bool]``; Ray is never imported here. What a fleet cannot do raises
  ``NotImplementedError`` saying what to use instead; nothing is silently accepted.
* Generation follows NeMo RL's ``interfaces.py`` shapes; input is checked first (right padding,
  lengths) naming the sample; ``max_new_tokens`` is clamped to the fleet's ``maxSequenceLength`` as
  vLLM does (``truncated``); a non-empty ``bad_words`` is refused, ``ignore_eos`` honoured.
* Refits: the operator decides the membership; ``update_weights_from_collective`` creates a Refit and
  sends with :class:`~megafleet_protocol.refit.sender.WeightSender` from this process (the one seam for
  NeMo RL's own wire is :meth:`MegafleetGeneration._rendezvous_refit`). The version a refit targets is
  ``max(current + 1, set_rollout_weight_version)``, chosen once per refit whatever NeMo's call order.
* Threads and pickling: clients run on an event loop on a daemon thread made on first use, so
  ``generate_async`` works from many event loops and threads at once; a pickled copy keeps only the
  configuration (:class:`Handle`) and reconnects on first use; the trainer's weights never travel.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from megafleet.api import v1alpha1
from megafleet.sdk import errors, fleet, generation, routing
from megafleet.sdk import weights as weight_senders
from megafleet_protocol import vocabulary

__all__ = ["CollectiveSenderSpec", "Handle", "MegafleetGeneration", "nemo_factory", "pack_outputs"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Outputs = dict[str, torch.Tensor]
ObjectRefs = list[Any]
"""``list[ray.ObjectRef]`` (each resolving to ``True``) when Ray is initialised here, else ``list[bool]``."""
ObjectRef = Any
"""One ``ray.ObjectRef`` when Ray is initialised here, else a ``bool``."""
RefitPayloadMode = Literal["hf_export", "logical_weights"]
"""NeMo RL's names for what a refit carries; megafleet's sender carries Hugging Face tensors."""
SUPPORTED_REFIT_BACKENDS = ("gloo", "nccl")
"""``refit_backend`` values of ``init_collective`` the fleet's transfer speaks."""


@dataclasses.dataclass(frozen=True)
class CollectiveSenderSpec:
    """NeMo RL's ``CollectiveSenderSpec``: how the trainer's own broadcast should send. Megafleet's
    refits are sent by this adapter, so nothing here constrains them (``None`` = the trainer's defaults)."""

    nccl_peer: str = "nemo"
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None


@dataclasses.dataclass(frozen=True)
class Handle:
    """Everything a :class:`MegafleetGeneration` needs to reconnect: what pickling keeps."""

    fleet_name: str
    namespace: str | None
    config: dict[str, Any]
    kubeconfig: str | None
    addressing: routing.Addressing
    api_key: str | None
    backend: vocabulary.CollectiveBackend
    frontends: tuple[str, ...] | None
    model: str | None
    ready_timeout_s: float
    kv_cache_mode: vocabulary.KvCacheMode | None
    max_sequence_length: int | None


class _Loop:
    """An event loop on a daemon thread; the adapter's synchronous methods run coroutines there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="megafleet-sdk", daemon=True)
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.submit(work).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


@dataclasses.dataclass
class _Clients:
    """What :meth:`MegafleetGeneration._connect` makes on first use."""

    loop: _Loop
    fleet: fleet.Fleet | None
    generator: generation.Generator


class MegafleetGeneration:
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
    ) -> None:
        _refuse_unsupported_config(config or {})
        self._handle = Handle(
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
        )
        self._weights = weights
        self._backend: vocabulary.CollectiveBackend = backend
        self._kv_cache_mode = kv_cache_mode
        self._connecting = threading.Lock()
        self._clients: _Clients | None = None
        self._prepared = False
        self._closed = False
        self._rendezvous: v1alpha1.RendezvousSource | None = None
        self._sender: weight_senders.Sender | None = None  # kept open across refits
        self._refit_info: set[str] | None = None
        self._trainer_version: int | None = None  # set_rollout_weight_version
        self._refit_target: int | None = None  # chosen by suspend_for_refit, kept until resume_after_refit
        self._metrics = _Metrics()
        self.weight_version: int | None = None
        """The weight version the fleet serves, as far as this adapter knows."""
        self.weight_synchronizer: Any = None
        """NeMo RL reads it (``getattr(..., "weight_synchronizer", None)``); refits go through this object."""
        self.dp_openai_server_base_urls: list[str | None] = list(self._handle.frontends or ())
        """The fleet's OpenAI base URLs (``.../v1``), one per routable shard; filled by
        :meth:`prepare_for_generation` when the API server is used."""
        self.cfg: dict[str, Any] = _nemo_cfg(self._handle.config, backend, kv_cache_mode, max_sequence_length)
        """NeMo RL's generation config as NeMo RL reads it from a MegatronGeneration: ``backend`` is
        ``megatron`` (the async rollout path), not colocated, ``mcore_generation_config`` filled in."""

    # -- pickling: only the configuration travels ------------------------------------------------

    def __reduce__(self) -> tuple[Callable[[Handle], MegafleetGeneration], tuple[Handle]]:
        return _from_handle, (self._handle,)

    @property
    def handle(self) -> Handle:
        """The configuration this adapter reconnects from (what pickling keeps)."""
        return self._handle

    @property
    def connected(self) -> bool:
        """Whether the clients (event loop, HTTP, API server) exist yet; they are made on first use."""
        return self._clients is not None

    # -- NeMo RL's class-level hooks ---------------------------------------------------------------

    @classmethod
    def validate_settings(cls, master_config: Mapping[str, Any]) -> None:
        """Refuse a NeMo RL master config the fleet cannot serve: colocated inference, fleet health.

        Raises:
            NotImplementedError: ``policy.generation.colocated.enabled`` or
                ``async_rl.generation_fleet_health.enabled`` is set.
        """
        policy = master_config.get("policy") or {}
        _refuse_unsupported_config(policy.get("generation") or {})
        health = ((master_config.get("async_rl") or {}).get("generation_fleet_health")) or {}
        if health.get("enabled"):
            raise NotImplementedError(
                "async_rl.generation_fleet_health.enabled=true is not supported for MegafleetGeneration: "
                "the operator watches the fleet's shards and refits only live ones; unset it"
            )

    @staticmethod
    def effective_megatron_cfg(config: Mapping[str, Any]) -> dict[str, Any]:
        """The policy's ``megatron_cfg`` as given: the fleet's own parallelism is in its spec."""
        return dict(config.get("megatron_cfg") or {})

    @classmethod
    def nvlink_domain_span(cls, config: Mapping[str, Any]) -> int:
        """1: the fleet runs on its own nodes and adds no NVLink domain to the trainer's placement."""
        return 1

    @classmethod
    def init_cluster_placement_groups(cls, cluster: Any, config: Mapping[str, Any]) -> None:
        """Nothing to place: the fleet's pods are placed by Kubernetes, not in NeMo RL's cluster."""

    @staticmethod
    def frontend_ranks(cluster: Any, config: Mapping[str, Any]) -> list[int]:
        """No rank of NeMo RL's cluster hosts a frontend (``[]``): the fleet's frontends are in
        :attr:`dp_openai_server_base_urls`."""
        return []

    @classmethod
    def reserve_http_server_addresses(
        cls, cluster: Any, config: Mapping[str, Any]
    ) -> tuple[list[str], dict[int, int], list[Any]]:
        """Not needed: the operator reserves the fleet's endpoints (``status.endpoints``, the
        ``<fleet>-endpoints`` ConfigMap).

        Raises:
            NotImplementedError: always; read :attr:`dp_openai_server_base_urls` after
                :meth:`prepare_for_generation` instead.
        """
        raise NotImplementedError(
            "MegafleetGeneration reserves no ports in NeMo RL's cluster: the operator publishes the fleet's "
            "frontend URLs; read dp_openai_server_base_urls after prepare_for_generation()"
        )

    @classmethod
    def verify_served_addresses(cls, served_urls: list[str | None], reserved_urls: list[str]) -> None:
        """Check that the servers came up at the pre-published addresses.

        Raises:
            RuntimeError: the sets of URLs differ.
        """
        served = sorted(url for url in served_urls if url)
        if served != sorted(reserved_urls):
            raise RuntimeError(
                "the fleet's frontends serve at different addresses than the ones pre-published: "
                f"reserved {sorted(reserved_urls)}, serving {served}"
            )

    # -- properties NeMo RL reads ----------------------------------------------------------------

    @property
    def requires_kv_scale_sync(self) -> bool:
        """False: refits carry no FP8 KV scales."""
        return False

    @property
    def uses_native_refit(self) -> bool:
        """False: refits go through megafleet's Refit objects, not megatron-core's reshard."""
        return False

    @property
    def worker_group(self) -> Any:
        """Not available: the fleet has no Ray worker group (its shards are pods).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet has no Ray worker group: its shards are pods; read the fleet's status "
            "(megafleet.sdk.fleet.Fleet.get) for shards and their phases"
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Idempotent wake: the first call waits until the fleet is Ready (raises
        :class:`~megafleet.sdk.errors.FleetNotReady` with the condition's reason otherwise) and reads
        its weight version, KV cache mode and length limit. ``tags`` (``weights``, ``kv_cache``) need
        nothing: the fleet never sleeps."""
        clients = self._connect()
        if clients.fleet is not None and not self._prepared:
            state = clients.loop.run(clients.fleet.wait_ready(self._handle.ready_timeout_s))
            self._observe(state)
            self.dp_openai_server_base_urls = [frontend.url for frontend in clients.generator.router.frontends]
        elif clients.fleet is not None and not clients.generator.router.frontends:
            clients.loop.run(clients.fleet.refresh())
        self._prepared = True
        return True

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
        """Whether no KV computed with old weights is reused after a refit: true exactly when the
        fleet's ``engine.kvCacheMode`` is ``recompute`` (``persist`` and ``offload`` keep prefix caches
        across a refit). Unknown (fixed frontends without ``kv_cache_mode``) counts as False."""
        mode = self._kv_cache_mode
        if mode is None and self._handle.frontends is None:
            clients = self._connect()
            assert clients.fleet is not None
            self._observe(clients.loop.run(clients.fleet.get()))
            mode = self._kv_cache_mode
        return mode == "recompute"

    def shutdown(self) -> bool:
        """Close the clients and the event loop; repeated calls are safe. The fleet keeps running."""
        if self._closed:
            return True
        self._closed = True
        self._close_sender()
        clients, self._clients = self._clients, None
        if clients is None:
            return True
        closing = clients.fleet.aclose() if clients.fleet is not None else clients.generator.aclose()
        try:
            clients.loop.run(closing)
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
        self._metrics.clear()

    def get_logger_metrics(self) -> dict[str, Any]:
        """Counters since :meth:`clear_logger_metrics`: requests, generated tokens, truncated answers."""
        return self._metrics.logger()

    def drain_latest_logger_metrics(self) -> dict[str, Any]:
        """:meth:`get_logger_metrics` (nothing is buffered elsewhere)."""
        return self.get_logger_metrics()

    def snapshot_step_metrics(self) -> None:
        """Start a step: :meth:`get_step_metrics` reports what happens from here."""
        self._metrics.snapshot()

    def get_step_metrics(self) -> dict[str, float]:
        """Counters since :meth:`snapshot_step_metrics` (since creation without one)."""
        return self._metrics.step()

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
        prompts = _prompts(input_ids, input_lengths)
        answers = clients.loop.run(self._answers(clients, prompts, samplings))
        self._metrics.add(answers)
        return _like(data, pack_outputs(input_ids, input_lengths, answers, self._pad_token_id))

    async def generate_async(self, data: Mapping[str, Any], greedy: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """``(index, single-sample output)`` for every sample, as each answer arrives; usable from any
        event loop on any thread, many at once."""
        input_ids, input_lengths, samplings = self._requests(data, greedy)
        clients = self._connect()
        prompts = _prompts(input_ids, input_lengths)
        fitted = await asyncio.wrap_future(clients.loop.submit(self._fit(clients, prompts, samplings)))

        async def indexed(index: int, pending: concurrent.futures.Future[generation.Answer]) -> Any:
            return index, await asyncio.wrap_future(pending)

        pending = [clients.loop.submit(clients.generator.complete(p, s)) for p, s in zip(prompts, fitted, strict=True)]
        for done in asyncio.as_completed([indexed(index, future) for index, future in enumerate(pending)]):
            index, answer = await done
            self._metrics.add([answer])
            one = slice(index, index + 1)
            yield index, _like(data, pack_outputs(input_ids[one], input_lengths[one], [answer], self._pad_token_id))

    async def _answers(
        self, clients: _Clients, prompts: list[list[int]], samplings: list[generation.Sampling]
    ) -> list[generation.Answer]:
        fitted = await self._fit(clients, prompts, samplings)
        return list(
            await asyncio.gather(*(clients.generator.complete(p, s) for p, s in zip(prompts, fitted, strict=True)))
        )

    async def _fit(
        self, clients: _Clients, prompts: list[list[int]], samplings: list[generation.Sampling]
    ) -> list[generation.Sampling]:
        """Route, then clamp every sample's ``max_tokens`` to its room; refuse (naming the sample) a
        prompt that leaves none, before any request is sent."""
        if clients.fleet is not None and not clients.generator.router.frontends:
            await clients.fleet.refresh()
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
        check_right_padding(input_ids, input_lengths, self._pad_token_id)
        per_sample = data.get("stop_strings")
        samplings = [
            self._sampling(greedy, per_sample[i] if per_sample is not None else None) for i in range(input_ids.shape[0])
        ]
        return input_ids, input_lengths, samplings

    def _sampling(self, greedy: bool, sample_stops: Iterable[str] | None) -> generation.Sampling:
        cfg = self.cfg
        _refuse_unsupported_config(cfg)
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
        )

    @property
    def _pad_token_id(self) -> int:
        return int(self.cfg.get("_pad_token_id", 0))

    # -- refit -----------------------------------------------------------------------------------

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int, refit_backend: str | None = None
    ) -> ObjectRefs:
        """Record the trainer's rendezvous for the following refits: ``ip`` and the base ``port`` of
        its store (each attempt uses the next port) and ``train_world_size``. ``world_size`` is only
        what the caller expects: the operator sets the membership from the live shards.
        ``refit_backend`` (MegatronGeneration's) picks the transfer backend, ``gloo`` or ``nccl``.

        Raises:
            NotImplementedError: another ``refit_backend`` (``nccl_m2n``, ``nvshmem``).
        """
        if refit_backend is not None:
            if refit_backend not in SUPPORTED_REFIT_BACKENDS:
                raise NotImplementedError(
                    f"refit_backend={refit_backend!r} is not supported by megafleet: its refits send over "
                    f"{' or '.join(SUPPORTED_REFIT_BACKENDS)}; set mcore_generation_config.refit_backend to one"
                )
            self._backend = "nccl" if refit_backend == "nccl" else "gloo"
        self._close_sender()  # another rendezvous: the next refit opens a new session
        self._rendezvous = v1alpha1.RendezvousSource(address=ip, port=port, trainer_world_size=train_world_size)
        log.info("refits rendezvous at %s:%d (the caller expects a world of %d)", ip, port, world_size)
        return _refs([True])

    def rebuild_collective(self, membership: Any, ip: str, port: int) -> ObjectRefs:
        """A new rendezvous for the following refits (``membership.train_world_size`` trainer ranks);
        which shards join is the operator's choice (the live ones), whatever ``membership`` lists."""
        train_world_size = int(getattr(membership, "train_world_size", 1))
        world_size = int(getattr(membership, "world_size", train_world_size))
        return self.init_collective(ip, port, world_size, train_world_size=train_world_size)

    def set_refit_membership(self, membership: Any) -> None:
        """Not available: the operator decides a refit's membership from the live shards.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "MegafleetGeneration takes no refit membership from the trainer: the operator refits the live "
            "shards and retries without a dead one; call update_weights_from_collective() as usual"
        )

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any] | None) -> None:
        """Remember the names of the tensors every refit must send (NeMo RL's state-dict info);
        ``None`` (MegatronGeneration's call) checks nothing."""
        self._refit_info = None if state_dict_info is None else set(state_dict_info)

    def set_rollout_weight_version(self, version: int) -> None:
        """The trainer's name for the next weights: a later refit targets it when it is larger than
        the fleet's current version + 1 (versions never go backwards)."""
        self._trainer_version = version if self._trainer_version is None else max(self._trainer_version, version)

    def suspend_for_refit(self) -> None:
        """Start a refit (MegatronWeightSynchronizer's order): choose its target version now. The fleet
        suspends its engines itself while the Refit runs."""
        self._refit_target = self._next_version()

    def resume_after_refit(self) -> None:
        """End the refit :meth:`suspend_for_refit` started; the fleet resumes its engines itself."""
        self._refit_target = None

    def pause_generation_for_refit(self, *, clear_cache: bool) -> bool:
        """False: the fleet pauses itself inside each Refit (nothing is paused by this call)."""
        return False

    def resume_generation_after_refit(self) -> bool:
        """False: see :meth:`pause_generation_for_refit`."""
        return False

    def get_collective_sender_spec(self) -> CollectiveSenderSpec:
        """The trainer's own broadcast is not used (this adapter sends): NeMo RL's defaults."""
        return CollectiveSenderSpec()

    def get_inference_world_size(self) -> int | None:
        """``None``: the receiving ranks are the live shards the operator picks per refit."""
        return None

    def get_refit_payload_mode(self) -> RefitPayloadMode:
        """``hf_export``: refits carry the trainer's Hugging Face-named tensors."""
        return "hf_export"

    def update_weights_from_collective(
        self,
        refit_timeout_s: float | None = None,
        *,
        weights: weight_senders.NamedTensors | None = None,
        version: int | None = None,
    ) -> ObjectRefs:
        """Refit the fleet to ``version`` (default: the target of this refit, see the module
        docstring) with the trainer's tensors.

        Creates a Refit (rendezvous source from :meth:`init_collective`), sends the weights for each
        attempt, waits until it succeeded and routes to its member shards.

        Raises:
            RefitFailed: the Refit failed (after the operator's retry) or did not finish in
                ``refit_timeout_s``; nothing is routed differently.
        """
        if self._rendezvous is None:
            raise RuntimeError("call init_collective(ip, port, world_size, train_world_size=...) before refitting")
        named = weights or self._weights
        if named is None:
            raise ValueError("no weights: pass weights= here or to MegafleetGeneration(...)")
        self._check_names(named)
        target = self._target() if version is None else version
        self._rendezvous_refit(target, named, _bound(refit_timeout_s))
        return _refs([True])

    def _rendezvous_refit(self, target: int, named: weight_senders.NamedTensors, timeout: float) -> None:
        """The refit wire: megafleet's Refit + this process's WeightSender. (NeMo RL's own trainer
        broadcast, receiving on the engines, would be chosen here instead.)"""
        if self._sender is None:
            self._sender = weight_senders.sender(named, backend=self._backend, keep_open=True)
        send = self._sender
        send.weights = named
        rendezvous = self._rendezvous
        self._refit(target, lambda live: live.refit(target, rendezvous=rendezvous, send=send, timeout=timeout))

    def update_weights_from_checkpoint(
        self, path: str, *, version: int | None = None, refit_timeout_s: float | None = None
    ) -> bool:
        """Refit the fleet from a checkpoint every shard loads by itself (a Refit with a checkpoint source)."""
        target = self._target() if version is None else version
        timeout = _bound(refit_timeout_s)
        self._refit(target, lambda live: live.refit(target, checkpoint=path, timeout=timeout))
        return True

    def shard_liveness_ref(self, shard_idx: int) -> ObjectRef:
        """Whether shard ``shard_idx`` is Ready (from the fleet's status; with fixed frontends,
        whether it has one), as one Ray ref or a bool."""
        clients = self._connect()
        if clients.fleet is None:
            return _refs([0 <= shard_idx < len(self._handle.frontends or ())])[0]
        state = clients.loop.run(clients.fleet.get())
        alive = any(shard.index == shard_idx and shard.phase == "Ready" for shard in state.status.shards)
        return _refs([alive])[0]

    # -- what a fleet cannot do ------------------------------------------------------------------

    def update_weights_via_ipc_zmq(self) -> ObjectRefs:
        """Not available: CUDA IPC needs the engines in the trainer's processes (colocated).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet runs in its own pods: CUDA IPC (colocated) refits cannot reach it; "
            "use init_collective + update_weights_from_collective"
        )

    def preinit_nvshmem_collective(self) -> ObjectRefs:
        """Not available: megafleet refits send over gloo or nccl.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "refit_backend='nvshmem' is not supported by megafleet; use 'nccl' (GPU engines) or 'gloo'"
        )

    def init_nccl_reshard_comm_group(
        self, *, pp_ips: list[str], pp_ports: list[int], pp_size: int, train_ranks_per_stage: int, sub_world_size: int
    ) -> ObjectRefs:
        """Not available: see :meth:`nccl_reshard_refit`."""
        raise _no_reshard()

    def rebuild_nccl_reshard_comm_group(
        self,
        membership: Any,
        *,
        pp_ips: list[str],
        pp_ports: list[int],
        pp_size: int,
        train_ranks_per_stage: int,
        sub_world_size: int,
    ) -> ObjectRefs:
        """Not available: see :meth:`nccl_reshard_refit`."""
        raise _no_reshard()

    def prepare_nccl_reshard_refit_info(self, refit_info: dict[str, Any]) -> None:
        """Not available: see :meth:`nccl_reshard_refit`."""
        raise _no_reshard()

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> ObjectRefs:
        """Not available: megafleet refits send full Hugging Face tensors to every shard, which
        re-shards them itself; NCCL M-to-N resharding from pipeline stages is not implemented.

        Raises:
            NotImplementedError: always.
        """
        raise _no_reshard()

    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        """Not available: the operator watches the fleet's shards itself.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "async_rl.generation_fleet_health.enabled=true is not supported for the MegafleetGeneration generation "
            "backend: the operator watches the shards and refits only live ones"
        )

    def pause_generation(self, mode: str) -> None:
        """Not available: clients cannot pause a fleet; the fleet pauses itself during each Refit.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "a megafleet fleet is not paused by its clients: it suspends itself during each Refit; "
            "stop sending requests instead"
        )

    def continue_generation(self) -> None:
        """Not available: see :meth:`pause_generation`."""
        raise NotImplementedError("a megafleet fleet is not paused by its clients: there is nothing to continue")

    def pause_generation_for_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: generation-prefix checkpointing.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("generation-prefix checkpointing is not supported for MegafleetGeneration")

    def resume_generation_after_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: see :meth:`pause_generation_for_checkpoint`."""
        raise NotImplementedError("generation-prefix checkpointing is not supported for MegafleetGeneration")

    def resume_generation_after_cut(self, *, timeout_s: float | None = None) -> bool:
        """Not available: generation-prefix buffer swapping.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("generation-prefix buffer swapping is not supported for MegafleetGeneration")

    def finish_generation_checkpoint(self, *, timeout_s: float | None = None) -> bool:
        """Not available: see :meth:`resume_generation_after_cut`."""
        raise NotImplementedError("generation-prefix buffer swapping is not supported for MegafleetGeneration")

    def setup_token_capture(self, dp_cfg: Any, staging_partition: str, *, capture_media: bool = False) -> None:
        """Not available: the fleet's frontends capture no tokens for NeMo RL's data plane.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "token capture is not supported for MegafleetGeneration: every answer already carries its "
            "token ids, logprobs and weight version"
        )

    # -- internals -------------------------------------------------------------------------------

    def _connect(self) -> _Clients:
        """The clients, made on first use (also in an unpickled copy); thread-safe."""
        clients = self._clients
        if clients is not None:
            return clients
        with self._connecting:
            if self._clients is None:
                if self._closed:
                    raise errors.FleetError(f"MegafleetGeneration of fleet {self._handle.fleet_name} was shut down")
                loop = _Loop()
                found, generator = loop.run(_make_clients(self._handle))
                self._clients = _Clients(loop, found, generator)
            return self._clients

    def _observe(self, state: fleet.FleetState) -> None:
        """Take the fleet's weight version, KV cache mode and length limit from one observed state."""
        refit_state = state.status.refit
        current = refit_state.current_version if refit_state is not None else None
        self.weight_version = current if current is not None else state.status.weight_version
        if state.spec is not None:
            self._kv_cache_mode = state.spec.engine.kv_cache_mode
            self.cfg["mcore_generation_config"]["kv_cache_management_mode"] = self._kv_cache_mode
            self.cfg["mcore_generation_config"]["max_model_len"] = state.spec.model.max_sequence_length

    def _refit(self, version: int, start: Callable[[fleet.Fleet], Coroutine[Any, Any, fleet.RefitResult]]) -> None:
        clients = self._connect()
        if clients.fleet is None:
            raise errors.FleetError("refits need the API server: this adapter was made with fixed frontends")
        result: fleet.RefitResult = clients.loop.run(start(clients.fleet))
        self.weight_version = version
        log.info("refit %s: version %d on shards %s", result.name, version, list(result.members))

    def _target(self) -> int:
        """The version this refit sends: the one :meth:`suspend_for_refit` chose, else a new one."""
        return self._refit_target if self._refit_target is not None else self._next_version()

    def _next_version(self) -> int:
        """``max(fleet's current version + 1, trainer's named version, last one sent here + 1)``."""
        clients = self._connect()
        if clients.fleet is not None:
            self._observe(clients.loop.run(clients.fleet.get()))
        candidates = [0 if self.weight_version is None else self.weight_version + 1]
        if self._trainer_version is not None:
            candidates.append(self._trainer_version)
        return max(candidates)

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _check_names(self, named: weight_senders.NamedTensors) -> None:
        if self._refit_info is None:
            return
        sent = {name for name, _ in named()}
        if sent != self._refit_info:
            missing, extra = sorted(self._refit_info - sent), sorted(sent - self._refit_info)
            raise ValueError(f"the weights differ from prepare_refit_info: missing {missing[:5]}, extra {extra[:5]}")


def nemo_factory(fleet_name: str, namespace: str | None = None, **options: Any) -> Callable[..., MegafleetGeneration]:
    """A stand-in for NeMo RL's ``MegatronGeneration``/``VllmGeneration`` constructors (GRPO's
    ``setup`` builds the backend by name): called with their keyword arguments, it returns a
    :class:`MegafleetGeneration` of ``fleet_name`` with ``config["generation"]`` (or ``config``
    itself when it has no ``generation`` key). ``options`` go to :class:`MegafleetGeneration`.

    Raises (when called):
        NotImplementedError: a colocated setup (``policy=`` given): the fleet has its own GPUs.
    """

    def build(
        config: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        cluster: Any = None,
        policy: Any = None,
        name_prefix: str = "megafleet_generation",
        processor: Any = None,
        weights_path: str | None = None,
        skip_weight_load: bool = False,
        reserved_http_server_ports: dict[int, int] | None = None,
    ) -> MegafleetGeneration:
        if policy is not None:
            raise NotImplementedError(
                "colocated generation is not supported by megafleet: set policy.generation.colocated.enabled=false"
            )
        generation_cfg = dict((config or {}).get("generation", config or {}))
        if tokenizer is not None and "_pad_token_id" not in generation_cfg:
            generation_cfg["_pad_token_id"] = tokenizer.pad_token_id
        return MegafleetGeneration(fleet_name, namespace, config=generation_cfg, **options)

    return build


def check_right_padding(input_ids: torch.Tensor, input_lengths: torch.Tensor, pad_token_id: int) -> None:
    """Refuse input NeMo RL's ``verify_right_padding`` refuses, with its wording naming the sample,
    plus lengths below 1 (nothing to continue from).

    Raises:
        ValueError: the first problem found.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"Expected 2D tensor for padding check, got shape {tuple(input_ids.shape)}")
    batch, width = input_ids.shape
    if input_lengths.dim() != 1 or input_lengths.shape[0] != batch:
        raise ValueError(
            f"Mismatch between tensor batch size ({batch}) and lengths tensor size "
            f"({input_lengths.shape[0] if input_lengths.dim() else tuple(input_lengths.shape)})"
        )
    for index in range(batch):
        length = int(input_lengths[index])
        if length < 1:
            raise ValueError(f"Length {length} at index {index}: a prompt needs at least one token")
        if length > width:
            raise ValueError(f"Length {length} at index {index} exceeds tensor sequence dimension {width}")
        after = (input_ids[index, length:] != pad_token_id).nonzero().flatten()
        if after.numel():
            positions = [length + int(offset) for offset in after]
            raise ValueError(f"Non-padding values found after specified length at index {index}: positions {positions}")


class _Metrics:
    """Thread-safe generation counters for NeMo RL's logger and step metrics."""

    NAMES = ("requests", "generated_tokens", "truncated")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = dict.fromkeys(self.NAMES, 0)
        self._logger = dict.fromkeys(self.NAMES, 0)
        self._step = dict.fromkeys(self.NAMES, 0)

    def add(self, answers: Sequence[generation.Answer]) -> None:
        with self._lock:
            self._total["requests"] += len(answers)
            self._total["generated_tokens"] += sum(len(answer.token_ids) for answer in answers)
            self._total["truncated"] += sum(answer.finish_reason == "length" for answer in answers)

    def clear(self) -> None:
        with self._lock:
            self._logger = dict(self._total)

    def snapshot(self) -> None:
        with self._lock:
            self._step = dict(self._total)

    def logger(self) -> dict[str, Any]:
        with self._lock:
            return {f"megafleet/{name}": self._total[name] - self._logger[name] for name in self.NAMES}

    def step(self) -> dict[str, float]:
        with self._lock:
            return {f"megafleet/{name}": float(self._total[name] - self._step[name]) for name in self.NAMES}


def _from_handle(handle: Handle) -> MegafleetGeneration:
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
    )


async def _make_clients(handle: Handle) -> tuple[fleet.Fleet | None, generation.Generator]:
    """The fleet client (or a generator over fixed frontends), made on the adapter's loop (its HTTP
    clients belong to that loop)."""
    if handle.frontends is not None:
        fixed = [routing.Frontend(index, url, None) for index, url in enumerate(handle.frontends)]
        generator = generation.Generator(
            routing.Router(fixed),
            model=handle.model or handle.fleet_name,
            api_key=handle.api_key,
            max_sequence_length=handle.max_sequence_length,
        )
        return None, generator
    found = fleet.Fleet(
        handle.fleet_name,
        handle.namespace,
        kubeconfig=handle.kubeconfig,
        addressing=handle.addressing,
        api_key=handle.api_key,
    )
    return found, found.generator


def _nemo_cfg(
    config: Mapping[str, Any],
    backend: vocabulary.CollectiveBackend,
    kv_cache_mode: vocabulary.KvCacheMode | None,
    max_sequence_length: int | None,
) -> dict[str, Any]:
    cfg = dict(config)
    if cfg.get("backend") not in (None, "megatron"):
        log.info("MegafleetGeneration reads as backend 'megatron' (was %r): NeMo RL's async path", cfg["backend"])
    cfg["backend"] = "megatron"
    cfg["colocated"] = {**(cfg.get("colocated") or {}), "enabled": False}
    cfg["mcore_generation_config"] = {
        **(cfg.get("mcore_generation_config") or {}),
        "refit_backend": backend,
        "kv_cache_management_mode": kv_cache_mode,
        "expose_http_server": True,
        "max_model_len": max_sequence_length,
    }
    return cfg


def _refuse_unsupported_config(config: Mapping[str, Any]) -> None:
    if config.get("bad_words"):
        raise NotImplementedError(
            "policy.generation.bad_words is not supported by megafleet's engines (they cannot ban token "
            "sequences); remove bad_words from the generation config"
        )
    if (config.get("colocated") or {}).get("enabled"):
        raise NotImplementedError(
            "colocated generation is not supported by megafleet: the fleet has its own GPUs; "
            "set policy.generation.colocated.enabled=false"
        )


def _no_reshard() -> NotImplementedError:
    return NotImplementedError(
        "refit_transport='nccl_reshard' (NCCL M-to-N resharding) is not supported by megafleet: every shard "
        "receives full tensors and re-shards them itself; use init_collective + update_weights_from_collective"
    )


def _refs(values: list[bool]) -> list[Any]:
    """``values`` as Ray object refs when Ray is initialised in this process, else as they are.
    Ray is looked up, never imported: a process that did not import it has no Ray to use."""
    ray: Any = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return [ray.put(value) for value in values]
    return list(values)


def _bound(refit_timeout_s: float | None) -> float:
    return fleet.DEFAULT_REFIT_TIMEOUT_SECONDS if refit_timeout_s is None else refit_timeout_s


def _prompts(input_ids: torch.Tensor, input_lengths: torch.Tensor) -> list[list[int]]:
    return [[int(t) for t in input_ids[i, : int(input_lengths[i])].tolist()] for i in range(input_ids.shape[0])]


def _like(data: Mapping[str, Any], outputs: Outputs) -> Any:
    """``outputs`` as the caller's mapping type (NeMo RL's ``BatchedDataDict`` is a ``UserDict``)."""
    kind = type(data)
    if kind not in (dict, collections.UserDict) and issubclass(kind, dict | collections.UserDict):
        return kind(outputs)
    return outputs


def pack_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, answers: Sequence[generation.Answer], pad_token_id: int
) -> Outputs:
    """NeMo RL's generation outputs from one answer per sample (see the module docstring for shapes)."""
    batch, padded_input = input_ids.shape
    generated = [answer.token_ids for answer in answers]
    total = padded_input + max((len(tokens) for tokens in generated), default=0)
    output_ids = torch.full((batch, total), pad_token_id, dtype=input_ids.dtype)
    logprobs = torch.zeros((batch, total), dtype=torch.float32)
    for i, (answer, tokens) in enumerate(zip(answers, generated, strict=True)):
        length = int(input_lengths[i])
        output_ids[i, :length] = input_ids[i, :length]
        output_ids[i, length : length + len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
        if answer.logprobs is not None:
            logprobs[i, length : length + len(answer.logprobs)] = torch.tensor(answer.logprobs, dtype=torch.float32)
    generation_lengths = torch.tensor([len(tokens) for tokens in generated], dtype=torch.long)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": generation_lengths,
        "unpadded_sequence_lengths": input_lengths.to(torch.long).cpu() + generation_lengths,
        "truncated": torch.tensor([answer.finish_reason == "length" for answer in answers], dtype=torch.bool),
        "weight_versions": torch.tensor(
            [-1 if answer.weight_version is None else answer.weight_version for answer in answers], dtype=torch.long
        ),
    }
