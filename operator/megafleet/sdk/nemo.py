"""NeMo RL's ``GenerationInterface`` over a megafleet fleet: a drop-in for the generation side of a
GRPO-style loop whose engines run as a MegatronGeneration on Kubernetes.

Called by the RL training loop on its driver (NeMo RL's single controller, or any script)::

    generation = MegafleetGeneration("tiny", "rl-team-a", config=master_config["policy"]["generation"],
                                     weights=policy_model.named_parameters)
    generation.prepare_for_generation()                  # waits until the fleet is Ready
    out = generation.generate(batch, greedy=False)       # BatchedDataDict in, NeMo's output keys out
    generation.init_collective(pod_ip, 29600, world_size, train_world_size=1)
    generation.update_weights_from_collective()           # a Refit object + the trainer's WeightSender
    generation.shutdown()

Semantics follow NeMo RL (``nemo_rl/models/generation/interfaces.py``, its vLLM worker's ``generate``):
``generate`` takes right-padded ``input_ids`` [B, L] and ``input_lengths`` [B] (optional per-sample
``stop_strings``) and returns ``output_ids`` [B, L + G] (each prompt, its generated tokens, then
``_pad_token_id``), ``logprobs`` [B, L + G] float32 (zeros on the prompt and padding),
``generation_lengths`` and ``unpadded_sequence_lengths`` [B]; G is the longest generation of the
batch. Two extra keys: ``truncated`` [B] (stopped by the length limit) and ``weight_versions`` [B]
(the weight version each answer carried; -1 for none). Every prompt is one request, spread over the
fleet's Ready, non-stale frontends (:mod:`megafleet.sdk.routing`).

Refit differs from NeMo RL in one way: the operator, not the trainer, decides the communicator's
membership (the live shards), so the trainer side is driven here. ``init_collective`` only records
the trainer's rendezvous (address, base port, trainer world size); ``update_weights_from_collective``
creates a Refit and, for each attempt the operator runs, sends the weights with
:class:`~megafleet_protocol.refit.sender.WeightSender` from this process (do not also call the policy's own
``init_collective``/``broadcast_weights_for_collective``). As in NeMo RL the collective is set up
once and reused: the sender stays open between refits (:class:`megafleet.sdk.weights.Sender` with
``keep_open``), so every refit whose first attempt has the same port and membership size keeps the
store and the transfer group; a retry, a new membership size or a new ``init_collective`` opens a new
one, and ``shutdown`` closes it. Calls block and return plain values
(``True``, ``[]``) instead of Ray futures; nothing here imports ray.

The async client runs on an event loop on a daemon thread, so these synchronous methods also work
from inside another event loop (an async Ray actor); ``generate_async`` is an async generator of
``(index, single-sample output)`` in completion order, as NeMo RL's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from megafleet.api import v1alpha1
from megafleet.sdk import errors, fleet, generation, routing
from megafleet.sdk import weights as weight_senders
from megafleet_protocol import vocabulary

__all__ = ["MegafleetGeneration", "pack_outputs"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Outputs = dict[str, torch.Tensor]


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


class MegafleetGeneration:
    """NeMo RL's ``GenerationInterface`` backed by a MegatronGeneration fleet.

    Args:
        fleet: the fleet's name (also the model name when ``model`` is not given).
        namespace: the fleet's namespace; default: the kubeconfig's or the pod's.
        config: NeMo RL's ``policy.generation`` config; read: ``max_new_tokens``, ``temperature``,
            ``top_p``, ``top_k``, ``stop_token_ids``, ``stop_strings``, ``_pad_token_id``.
        weights: the trainer's tensors (HF names, full tensors), called per refit attempt, e.g.
            ``model.named_parameters``; can also be given to each refit.
        kubeconfig: a kubeconfig file; default: ``$KUBECONFIG``, ``~/.kube/config`` or in-cluster.
        addressing: how frontends are reached (:data:`megafleet.sdk.routing.Addressing`).
        api_key: the frontends' API key, when the fleet sets ``frontend.apiKeySecret``.
        backend: the refit transfer backend, ``gloo`` (CPU engines) or ``nccl`` (GPU engines).
        frontends: fixed frontend base URLs (e.g. from the ``<fleet>-endpoints`` ConfigMap) instead of
            the API server; generation only: refits need the API server.
        model: the served model name, when it is not the fleet's name (``frontends`` only; with the
            API server it is read from the fleet's spec).
        ready_timeout_s: bound of waiting for the fleet to be Ready.
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
    ) -> None:
        self.cfg: dict[str, Any] = dict(config or {})
        self._weights = weights
        self._backend = backend
        self._ready_timeout_s = ready_timeout_s
        self._loop = _Loop()
        self._fleet: fleet.Fleet | None = None
        self._prepared = False
        self._closed = False
        self._rendezvous: v1alpha1.RendezvousSource | None = None
        self._sender: weight_senders.Sender | None = None  # kept open across refits
        self._refit_info: set[str] | None = None
        self.weight_version: int | None = None
        """The weight version the fleet serves, as far as this adapter knows."""
        if frontends is not None:
            fixed = [routing.Frontend(index, url.rstrip("/"), None) for index, url in enumerate(frontends)]
            self._generator = generation.Generator(routing.Router(fixed), model=model or fleet_name, api_key=api_key)
        else:
            self._fleet = self._loop.run(_make_fleet(fleet_name, namespace, kubeconfig, addressing, api_key))
            self._generator = self._fleet.generator

    # -- lifecycle -------------------------------------------------------------------------------

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Idempotent wake: the first call waits until the fleet is Ready (raises
        :class:`~megafleet.sdk.errors.FleetNotReady` with the condition's reason otherwise)."""
        if self._fleet is not None and not self._prepared:
            state = self._loop.run(self._fleet.wait_ready(self._ready_timeout_s))
            refit_state = state.status.refit
            current = refit_state.current_version if refit_state is not None else None
            self.weight_version = current if current is not None else state.status.weight_version
        elif self._fleet is not None and not self._generator.router.frontends:
            self._loop.run(self._fleet.refresh())
        self._prepared = True
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to release: the fleet runs in its own pods and keeps serving (non-colocated)."""
        return True

    def invalidate_kv_cache(self) -> bool:
        """Nothing to do here: every engine drops or keeps its KV cache across a refit as the fleet's
        ``engine.kvCacheMode`` says (``recompute`` drops it)."""
        return True

    def shutdown(self) -> bool:
        """Close the clients and the event loop; repeated calls are safe. The fleet keeps running."""
        if self._closed:
            return True
        self._closed = True
        self._close_sender()
        closing = self._fleet.aclose() if self._fleet is not None else self._generator.aclose()
        try:
            self._loop.run(closing)
        finally:
            self._loop.close()
        return True

    # -- generation ------------------------------------------------------------------------------

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> Any:
        """Generate for every sample of ``data`` (``input_ids``, ``input_lengths``, optional
        ``stop_strings``); returns NeMo RL's output keys, as ``type(data)`` when it is a dict type."""
        input_ids, input_lengths, samplings = self._requests(data, greedy)
        prompts = _prompts(input_ids, input_lengths)
        answers = self._loop.run(self._answers(prompts, samplings))
        return _like(data, pack_outputs(input_ids, input_lengths, answers, self._pad_token_id))

    async def generate_async(self, data: Mapping[str, Any], greedy: bool = False) -> AsyncIterator[tuple[int, Any]]:
        """``(index, single-sample output)`` for every sample, as each answer arrives."""
        input_ids, input_lengths, samplings = self._requests(data, greedy)
        prompts = _prompts(input_ids, input_lengths)

        async def indexed(index: int, pending: concurrent.futures.Future[generation.Answer]) -> Any:
            return index, await asyncio.wrap_future(pending)

        await asyncio.wrap_future(self._loop.submit(self._ensure_frontends()))
        pending = [self._loop.submit(self._generator.complete(p, s)) for p, s in zip(prompts, samplings, strict=True)]
        for done in asyncio.as_completed([indexed(index, future) for index, future in enumerate(pending)]):
            index, answer = await done
            one = slice(index, index + 1)
            yield index, _like(data, pack_outputs(input_ids[one], input_lengths[one], [answer], self._pad_token_id))

    async def _answers(self, prompts: list[list[int]], samplings: list[generation.Sampling]) -> list[generation.Answer]:
        await self._ensure_frontends()
        return list(
            await asyncio.gather(*(self._generator.complete(p, s) for p, s in zip(prompts, samplings, strict=True)))
        )

    async def _ensure_frontends(self) -> None:
        if self._fleet is not None and not self._generator.router.frontends:
            await self._fleet.refresh()

    def _requests(
        self, data: Mapping[str, Any], greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[generation.Sampling]]:
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        if input_ids.dim() != 2 or input_lengths.shape != (input_ids.shape[0],):
            raise ValueError(
                f"input_ids must be [B, L] and input_lengths [B]; got {tuple(input_ids.shape)} and "
                f"{tuple(input_lengths.shape)}"
            )
        per_sample = data.get("stop_strings")
        samplings = [
            self._sampling(greedy, per_sample[i] if per_sample is not None else None) for i in range(input_ids.shape[0])
        ]
        return input_ids, input_lengths, samplings

    def _sampling(self, greedy: bool, sample_stops: Iterable[str] | None) -> generation.Sampling:
        cfg = self.cfg
        stops = tuple(cfg.get("stop_strings") or ()) + tuple(sample_stops or ())
        return generation.Sampling(
            max_tokens=cfg.get("max_new_tokens"),
            temperature=0.0 if greedy else float(cfg.get("temperature", 1.0)),
            top_p=1.0 if greedy else float(cfg.get("top_p") or 1.0),
            top_k=0 if greedy else int(cfg.get("top_k") or 0),
            stop=tuple(dict.fromkeys(stops)),
            stop_token_ids=tuple(cfg.get("stop_token_ids") or ()),
            logprobs=True,
        )

    @property
    def _pad_token_id(self) -> int:
        return int(self.cfg.get("_pad_token_id", 0))

    # -- refit -----------------------------------------------------------------------------------

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int = 1) -> list[Any]:
        """Record the trainer's rendezvous for the following refits: ``ip`` and the base ``port`` of
        its store (each attempt uses the next port) and ``train_world_size``. ``world_size`` is only
        what the caller expects: the operator sets the membership from the live shards."""
        self._close_sender()  # another rendezvous: the next refit opens a new session
        self._rendezvous = v1alpha1.RendezvousSource(address=ip, port=port, trainer_world_size=train_world_size)
        log.info("refits rendezvous at %s:%d (the caller expects a world of %d)", ip, port, world_size)
        return []

    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> None:
        """Remember the names of the tensors every refit must send (NeMo RL's state-dict info)."""
        self._refit_info = set(state_dict_info)

    def update_weights_from_collective(
        self,
        refit_timeout_s: float | None = None,
        *,
        weights: weight_senders.NamedTensors | None = None,
        version: int | None = None,
    ) -> bool:
        """Refit the fleet to ``version`` (default: the next one) with the trainer's tensors.

        Creates a Refit (rendezvous source from :meth:`init_collective`), sends the weights for each
        attempt, waits until it succeeded and routes to its member shards; returns ``True``.

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
        target = self._next_version() if version is None else version
        if self._sender is None:
            self._sender = weight_senders.sender(named, backend=self._backend, keep_open=True)
        send = self._sender
        send.weights = named
        rendezvous, timeout = self._rendezvous, _bound(refit_timeout_s)
        self._refit(target, lambda live: live.refit(target, rendezvous=rendezvous, send=send, timeout=timeout))
        return True

    def update_weights_from_checkpoint(
        self, path: str, *, version: int | None = None, refit_timeout_s: float | None = None
    ) -> bool:
        """Refit the fleet from a checkpoint every shard loads by itself (a Refit with a checkpoint source)."""
        target = self._next_version() if version is None else version
        timeout = _bound(refit_timeout_s)
        self._refit(target, lambda live: live.refit(target, checkpoint=path, timeout=timeout))
        return True

    def update_weights_via_ipc_zmq(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Not available: CUDA IPC needs the engines in the trainer's processes, and a fleet runs in its
        own pods. Use :meth:`update_weights_from_collective` (or a checkpoint)."""
        raise NotImplementedError(
            "a megafleet fleet runs in its own pods: CUDA IPC refits cannot reach it; "
            "use init_collective + update_weights_from_collective"
        )

    def _refit(self, version: int, start: Callable[[fleet.Fleet], Coroutine[Any, Any, fleet.RefitResult]]) -> None:
        if self._fleet is None:
            raise errors.FleetError("refits need the API server: this adapter was made with fixed frontends")
        result: fleet.RefitResult = self._loop.run(start(self._fleet))
        self.weight_version = version
        log.info("refit %s: version %d on shards %s", result.name, version, list(result.members))

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def _next_version(self) -> int:
        return 0 if self.weight_version is None else self.weight_version + 1

    def _check_names(self, named: weight_senders.NamedTensors) -> None:
        if self._refit_info is None:
            return
        sent = {name for name, _ in named()}
        if sent != self._refit_info:
            missing, extra = sorted(self._refit_info - sent), sorted(sent - self._refit_info)
            raise ValueError(f"the weights differ from prepare_refit_info: missing {missing[:5]}, extra {extra[:5]}")


async def _make_fleet(
    name: str,
    namespace: str | None,
    kubeconfig: str | Path | None,
    addressing: routing.Addressing,
    api_key: str | None,
) -> fleet.Fleet:
    """The fleet client, made on the adapter's loop (its HTTP clients belong to that loop)."""
    return fleet.Fleet(name, namespace, kubeconfig=kubeconfig, addressing=addressing, api_key=api_key)


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
