"""The RL job's client of one MegatronGeneration fleet: find it, wait until it is Ready, route
generation over its frontends, and refit it through Refit objects.

Called by the RL job (directly, or through the NeMo RL adapter :mod:`megafleet.sdk.nemo`). It talks to
the API server through :class:`megafleet.kube.Api`, the operator's own client, over lightkube (a
kubeconfig, ``$KUBECONFIG``, or the pod's service account; exec-plugin logins too) and reads status
through the operator's own typed models (:mod:`megafleet.api.v1alpha1`)::

    async with Fleet("tiny", "rl-team-a") as fleet:
        await fleet.wait_ready(timeout=600)            # the Ready condition, through a watch
        answers = await fleet.complete_batch(prompts, Sampling(max_tokens=64, temperature=0))
        send = weights.sender(lambda: model.named_parameters(), keep_open=True)  # the trainer's WeightSender
        result = await fleet.refit(
            1, rendezvous=v1alpha1.RendezvousSource(address=pod_ip, port=29600), send=send
        )
        answers = await fleet.complete_batch(prompts)  # every answer now says weight_version 1
        ...  # later refits with the same send keep its store and transfer group; send.close() at the end

Routing (:mod:`megafleet.sdk.routing`): only shards that are ``Ready`` at the fleet's current weight
version take requests; ``Stale`` shards and shards still starting or loading get none, and the
members of a running refit keep theirs (their engines hold requests until the new version serves).
After a successful refit the client routes to the Refit's member shards at once, and so does any
other client that reads the fleet's status (the operator marks them Ready in the patch that ends it).

A refit (docs/refit-protocol.md): :meth:`Fleet.refit` creates the Refit, watches its status, and for every
attempt the operator starts (``Running`` with ``status.attempts`` and ``status.membership``) calls
``send`` on a thread with that attempt's port (:func:`megafleet_protocol.ports.attempt_port`) and world
size; a failed attempt is retried by the operator once with the live shards on the next port. A
checkpoint refit needs no ``send``. Attempt 1 of every Refit naming the same base port gets the same
port, so a ``send`` that keeps its sender open (:class:`megafleet.sdk.weights.Sender`, ``keep_open``)
reuses its store and transfer group from Refit to Refit while the membership size stays the same.
Never imports kopf, torch or ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType

import httpx
import lightkube
import pydantic
from lightkube.config.kubeconfig import KubeConfig

from megafleet import kube, names
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.sdk import errors, generation, routing
from megafleet_protocol import ports, vocabulary

__all__ = ["FIELD_MANAGER", "Attempt", "Fleet", "FleetState", "RefitResult", "SendFn"]

log = logging.getLogger(__name__)

FIELD_MANAGER = "megafleet-sdk"
"""Field manager of the objects the SDK writes (Refits)."""
DEFAULT_READY_TIMEOUT_SECONDS = 600.0
"""Waiting for a fleet: engines load their checkpoints first, which takes minutes for large models."""
ROUTES_MAX_AGE_SECONDS = 2.0
"""How long a client routes from the fleet's status it read last before a request reads it again: the
shards a scale adds take requests, and those it removes stop taking them, within this of the status
saying so in every client of the fleet, not only in the one that refits it (an RL job's rollout
workers hold copies of the NeMo adapter that never refit). A refit's end settles the new version and
its shards in one status write, so a read never finds a fleet between the two."""
DEFAULT_REFIT_TIMEOUT_SECONDS = 900.0
"""Waiting for a Refit: up to two attempts of the fleet's ``refit.timeoutSeconds`` (300 s by default)."""


@dataclasses.dataclass(frozen=True)
class FleetState:
    """One observed state of the fleet."""

    name: str
    namespace: str
    generation: int
    spec: v1alpha1.MegatronGenerationSpec | None  # None when it does not parse (the fleet is InvalidSpec)
    status: v1alpha1.MegatronGenerationStatus

    @property
    def model(self) -> str:
        """The model name the frontends serve."""
        served = self.spec.model.served_name if self.spec is not None else None
        return served or self.name

    def condition(self, kind: str) -> v1alpha1.Condition | None:
        return next((c for c in self.status.conditions if c.type == kind), None)

    @property
    def ready(self) -> bool:
        """Ready=True, computed from the current spec."""
        ready = self.condition("Ready")
        return ready is not None and ready.status == "True" and self.status.observed_generation == self.generation

    @property
    def invalid(self) -> v1alpha1.Condition | None:
        invalid = self.condition("InvalidSpec")
        return invalid if invalid is not None and invalid.status == "True" else None


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a rendezvous Refit, as the trainer's sender needs it."""

    refit: str  # the Refit's name
    version: int
    attempt: int  # 1, 2
    address: str  # where the trainer's store listens (the Refit's rendezvous address)
    port: int  # this attempt's rendezvous port
    world_size: int  # trainer ranks + every member shard's ranks
    trainer_world_size: int
    transport: vocabulary.Transport  # the fleet's spec.refit.transport
    bucket_size_mib: int  # the fleet's spec.refit.bucketSizeMiB
    superseded: threading.Event = dataclasses.field(default_factory=threading.Event, compare=False)
    """Set once this attempt is given up (the operator started a newer one, or the Refit ended):
    a sender still blocked on a peer should abort (:meth:`~megafleet_protocol.refit.sender.WeightSender.abort`)."""


SendFn = Callable[[Attempt], object]
"""The trainer side of one attempt; runs on its own thread and blocks until the weights are sent,
giving up when ``attempt.superseded`` is set (:func:`megafleet.sdk.weights.sender` builds one on
:class:`~megafleet_protocol.refit.sender.WeightSender`)."""


@dataclasses.dataclass(frozen=True)
class RefitResult:
    """A Refit that succeeded."""

    name: str
    version: int
    status: v1alpha1.RefitObjectStatus
    members: tuple[int, ...]  # shard indexes that received the version

    @property
    def in_flight(self) -> v1alpha1.InFlightStatus | None:
        """What the refit did with the sequences in flight (mode asked and run, counts summed over
        the member shards); None from an operator that does not report it."""
        return self.status.in_flight

    @property
    def staging(self) -> v1alpha1.StagingStatus | None:
        """Whether the members received into their staging copy while serving, or in place."""
        return self.status.staging

    @property
    def pause(self) -> v1alpha1.PauseStatus | None:
        """How long the refit kept the member shards from generating (median, longest, per shard);
        None when no member reported it."""
        return self.status.pause

    @property
    def commit(self) -> v1alpha1.CommitStatus | None:
        """Who let the staged version go live and, for the operator, when it decided; None under
        ``commit: local``."""
        return self.status.commit


class Fleet:
    """Client of one MegatronGeneration.

    Args:
        name: the fleet's name.
        namespace: its namespace; default: the kubeconfig context's (or the pod's) namespace.
        kubeconfig: a kubeconfig file; default: ``$KUBECONFIG``, ``~/.kube/config`` or in-cluster.
        client: a lightkube ``AsyncClient``, or a :class:`megafleet.kube.Api` (then give the
            namespace), to use instead (closed by its owner).
        addressing: how frontends are reached (:data:`megafleet.sdk.routing.Addressing`).
        api_key: the frontends' API key, when the fleet sets ``frontend.apiKeySecret``.
        http: an ``httpx.AsyncClient`` for generation (closed by its owner).
    """

    def __init__(
        self,
        name: str,
        namespace: str | None = None,
        *,
        kubeconfig: str | Path | None = None,
        client: lightkube.AsyncClient | kube.Api | None = None,
        addressing: routing.Addressing = "service",
        api_key: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.name = name
        self._owns_client = client is None
        if client is None:
            config = KubeConfig.from_file(kubeconfig) if kubeconfig is not None else None
            client = lightkube.AsyncClient(config=config, namespace=namespace, field_manager=FIELD_MANAGER)
        # the API server's one client: the NeMo RL adapter's RefitSessions and ConfigMaps go through it too
        if isinstance(client, kube.Api):
            if namespace is None:
                raise ValueError("a Fleet over a megafleet.kube.Api needs its namespace")
            self.namespace: str = namespace
            self.api = client
        else:
            self.namespace = namespace or client.namespace
            self.api = kube.Api(client)
        self.addressing = addressing
        self.router = routing.Router()
        self._routed_at = float("-inf")
        self.generator = generation.Generator(self.router, model=name, api_key=api_key, http=http)

    async def aclose(self) -> None:
        await self.generator.aclose()
        if self._owns_client:
            await self.api.close()

    async def __aenter__(self) -> Fleet:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- the fleet -------------------------------------------------------------------------------

    async def get(self) -> FleetState:
        """The fleet as it is now.

        Raises:
            FleetNotFound: there is no such fleet.
        """
        found = await self.api.get("MegatronGeneration", self.name, self.namespace)
        if found is None:
            raise errors.FleetNotFound(f"fleet {self.namespace}/{self.name} does not exist")
        return self._state(found)

    async def wait_ready(self, timeout: float = DEFAULT_READY_TIMEOUT_SECONDS) -> FleetState:
        """Watch the fleet until its Ready condition is True for its current spec, then route to it.

        Raises:
            FleetNotFound: there is no such fleet, or it was deleted while waiting.
            FleetNotReady: the fleet is InvalidSpec (at once), or not Ready after ``timeout`` seconds;
                the error names the condition's reason and message and every shard's trouble.
        """
        state = await self.get()
        try:
            async with asyncio.timeout(timeout):
                async for obj in self._objects("MegatronGeneration", self.name):
                    if obj is None:
                        raise errors.FleetNotFound(f"fleet {self.namespace}/{self.name} was deleted")
                    state = self._state(obj)
                    invalid = state.invalid
                    if invalid is not None:
                        raise errors.FleetNotReady(self.name, invalid.reason, invalid.message)
                    if state.ready:
                        break
        except TimeoutError:
            raise _not_ready(state, f"still not Ready after {timeout:.0f} s") from None
        await self._route(state)
        return state

    async def frontends(self, state: FleetState | None = None) -> list[routing.Frontend]:
        """The frontends that may take requests now (Ready shards at the current weight version)."""
        state = state or await self.get()
        return routing.select(await self._urls(state), routing.routable(state.status))

    async def refresh(self) -> list[routing.Frontend]:
        """Route from the fleet's current status; returns the frontends now used."""
        return await self._route(await self.get())

    # -- generation ------------------------------------------------------------------------------

    async def complete(
        self, prompt: generation.Prompt, sampling: generation.Sampling = generation.DEFAULT_SAMPLING
    ) -> generation.Answer:
        """One completion (text or token-id prompt) on the shard the router places it on (:mod:`.affinity`)."""
        await self.ensure_routed()
        return await self.generator.complete(prompt, sampling)

    async def chat(
        self, messages: Sequence[generation.Message], sampling: generation.Sampling = generation.DEFAULT_SAMPLING
    ) -> generation.Answer:
        """One chat completion on the shard the router places the conversation on (:mod:`.affinity`)."""
        await self.ensure_routed()
        return await self.generator.chat(messages, sampling)

    async def complete_batch(
        self, prompts: Sequence[generation.Prompt], sampling: generation.Sampling = generation.DEFAULT_SAMPLING
    ) -> list[generation.Answer]:
        """Every prompt at once, spread over all routable frontends (each prompt's samples on one shard);
        answers in prompt order."""
        await self.ensure_routed()
        return await self.generator.complete_batch(prompts, sampling)

    async def chat_batch(
        self,
        conversations: Sequence[Sequence[generation.Message]],
        sampling: generation.Sampling = generation.DEFAULT_SAMPLING,
    ) -> list[generation.Answer]:
        """Every conversation at once as batched requests (the engine's ``/v1/chat/completions/batch``:
        one per routable frontend at least), spread over all of them; answers in order."""
        await self.ensure_routed()
        return await self.generator.chat_batch(conversations, sampling)

    # -- refits ----------------------------------------------------------------------------------

    async def refit(
        self,
        version: int,
        *,
        rendezvous: v1alpha1.RendezvousSource | None = None,
        checkpoint: str | None = None,
        send: SendFn | None = None,
        timeout: float = DEFAULT_REFIT_TIMEOUT_SECONDS,
        in_flight: vocabulary.InFlightMode | None = None,
        kv_cache_mode: vocabulary.KvCacheMode | None = None,
        staging: vocabulary.StagingMode | None = None,
        commit: vocabulary.CommitMode | None = None,
    ) -> RefitResult:
        """Create a Refit to ``version`` and see it through; afterwards route to its member shards.

        Args:
            version: the weight version the fleet serves afterwards.
            rendezvous: the trainer's store (address, base port, trainer world size); needs ``send``.
            checkpoint: a path every shard loads by itself (instead of ``rendezvous``).
            send: the trainer side of each attempt, called on a thread (see :class:`Attempt`).
            timeout: bound of the whole refit, retry included.
            in_flight: the sequences in flight: ``drain``, ``abort`` or ``keep`` (the Refit's
                ``inFlight``); None: the fleet's ``refit.inFlight``. An engine that cannot keep
                drains, and :attr:`RefitResult.in_flight` says why.
            kv_cache_mode: the KV cache of kept sequences: ``persist``, ``recompute`` or ``offload``
                (megatron); None: the fleet's ``engine.kvCacheMode``.
            staging: ``off``, ``auto`` or ``required`` (the Refit's ``staging``); None: the fleet's.
            commit: who lets the staged version go live: ``local``, ``trainer`` (this process's sender
                commits once every receiver staged) or ``operator`` (the Refit's ``commit``); None: the
                fleet's ``refit.commit``. Under ``trainer`` and ``operator`` no shard switches before
                every member staged and verified.

        Raises:
            RefitFailed: the Refit ended Failed, was deleted, or did not finish in time; the message
                carries its status message and what the trainer's sender raised, if anything.
        """
        if (rendezvous is None) == (checkpoint is None):
            raise ValueError("give exactly one of rendezvous and checkpoint")
        if rendezvous is not None and send is None:
            raise ValueError("a rendezvous refit needs send, the trainer's side (megafleet.sdk.weights.sender)")
        state = await self.get()
        source = v1alpha1.RefitSourceSpec(
            rendezvous=rendezvous, checkpoint=None if checkpoint is None else v1alpha1.CheckpointSource(path=checkpoint)
        )
        spec = v1alpha1.RefitObjectSpec(
            fleet_ref=v1alpha1.FleetRef(name=self.name),
            version=version,
            source=source,
            in_flight=in_flight,
            kv_cache_mode=kv_cache_mode,
            staging=staging,
            commit=commit,
        )
        created = await self.api.create(
            {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": "Refit",
                "metadata": {"generateName": f"{self.name}-v{version}-", "namespace": self.namespace},
                "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
            }
        )
        name = created["metadata"]["name"]
        log.info("refit %s/%s: version %d of fleet %s", self.namespace, name, version, self.name)
        senders: dict[int, tuple[Attempt, asyncio.Future[None]]] = {}
        try:
            status = await self._follow(name, spec, state, send, senders, timeout)
            if status.phase != "Succeeded":
                failures = _sender_failures(senders)
                raise errors.RefitFailed(
                    name, status.message + (f"; the trainer's sender: {failures}" if failures else ""), status
                )
            if senders:
                await _last_sender(name, status, senders, timeout)
        finally:
            for attempt, _ in senders.values():
                attempt.superseded.set()  # a sender still waiting for a peer gives up now
        members = tuple(offset.shard for offset in (status.membership.rank_offsets if status.membership else []))
        self.router.update(routing.select(await self._urls(await self.get()), dict.fromkeys(members, version)))
        return RefitResult(name, version, status, members)

    async def _follow(
        self,
        name: str,
        spec: v1alpha1.RefitObjectSpec,
        state: FleetState,
        send: SendFn | None,
        senders: dict[int, tuple[Attempt, asyncio.Future[None]]],
        timeout: float,
    ) -> v1alpha1.RefitObjectStatus:
        """Watch the Refit until it finishes; start ``send`` for every attempt the operator runs."""
        status: v1alpha1.RefitObjectStatus | None = None
        rendezvous = spec.source.rendezvous
        refit_spec = state.spec.refit if state.spec is not None else v1alpha1.RefitSpec()
        try:
            async with asyncio.timeout(timeout):
                async for obj in self._objects("Refit", name):
                    if obj is None:
                        raise errors.RefitFailed(name, "the Refit was deleted", status)
                    status = v1alpha1.RefitObjectStatus.model_validate(obj.get("status") or {})
                    attempt = status.attempts
                    running = status.phase == "Running" and status.membership is not None
                    if rendezvous is not None and send is not None and running and attempt not in senders:
                        assert status.membership is not None
                        for older, _ in senders.values():
                            older.superseded.set()
                        senders[attempt] = _start(
                            send,
                            Attempt(
                                refit=name,
                                version=spec.version,
                                attempt=attempt,
                                address=rendezvous.address,
                                port=ports.attempt_port(rendezvous.port, attempt),
                                world_size=status.membership.world_size,
                                trainer_world_size=status.membership.trainer_world_size,
                                transport=refit_spec.transport,
                                bucket_size_mib=refit_spec.bucket_size_mi_b,
                            ),
                        )
                    if status.phase in ("Succeeded", "Failed"):
                        return status
        except TimeoutError:
            where = f"phase {status.phase}: {status.message}" if status is not None else "no status written"
            failures = _sender_failures(senders)
            raise errors.RefitFailed(
                name,
                f"did not finish within {timeout:.0f} s ({where})"
                + (f"; the trainer's sender: {failures}" if failures else ""),
                status,
            ) from None
        raise errors.RefitFailed(name, "the watch ended", status)  # a watch only ends by an error

    # -- plumbing --------------------------------------------------------------------------------

    def _state(self, obj: Object) -> FleetState:
        metadata = obj.get("metadata") or {}
        try:
            spec: v1alpha1.MegatronGenerationSpec | None = v1alpha1.MegatronGenerationSpec.model_validate(
                obj.get("spec") or {}
            )
        except pydantic.ValidationError:
            spec = None
        state = FleetState(
            name=metadata.get("name", self.name),
            namespace=metadata.get("namespace", self.namespace),
            generation=int(metadata.get("generation") or 0),
            spec=spec,
            status=v1alpha1.MegatronGenerationStatus.model_validate(obj.get("status") or {}),
        )
        self.generator.model = state.model
        if spec is not None:  # token prompts are clamped to it (generation.Generator.fit)
            self.generator.max_sequence_length = spec.model.max_sequence_length
        return state

    async def _objects(self, kind: str, name: str) -> AsyncIterator[Object | None]:
        """The object now (the watch's first event), then after every change; ``None`` once deleted."""
        watch = self.api.watch(kind, namespace=self.namespace, fields={"metadata.name": name})
        try:
            async for event, obj in watch:
                yield None if event == "DELETED" else obj
        finally:
            with contextlib.suppress(Exception):
                await watch.aclose()

    async def _urls(self, state: FleetState) -> dict[int, str]:
        if self.addressing != "pod":
            return routing.endpoint_urls(state.status, self.addressing)
        pods = await self.api.list("Pod", namespace=self.namespace, labels={names.LABEL_FLEET: self.name})
        ips = {
            pod["metadata"]["name"]: pod["status"]["podIP"] for pod in pods if (pod.get("status") or {}).get("podIP")
        }
        port = state.spec.frontend.port if state.spec is not None else v1alpha1.FrontendSpec().port
        return routing.pod_urls(state.status, ips, port)

    async def _route(self, state: FleetState) -> list[routing.Frontend]:
        frontends = await self.frontends(state)
        self.router.update(frontends)
        self._routed_at = time.monotonic()
        return frontends

    async def ensure_routed(self) -> None:
        """Route from the fleet's status when nothing is routed yet, or when the routes are older than
        :data:`ROUTES_MAX_AGE_SECONDS` (one refresh at a time: meanwhile, and if reading the status
        fails, requests go by the routes there are)."""
        if not self.router.frontends:
            await self.refresh()
            return
        if time.monotonic() - self._routed_at < ROUTES_MAX_AGE_SECONDS:
            return
        self._routed_at = time.monotonic()
        try:
            await self.refresh()
        except (kube.ApiError, errors.FleetNotFound, httpx.HTTPError) as error:
            log.warning("fleet %s/%s: kept its routes; reading its status failed: %s", self.namespace, self.name, error)


def _not_ready(state: FleetState, detail: str) -> errors.FleetNotReady:
    ready = state.condition("Ready")
    troubles = [
        f"shard {shard.index}: {shard.phase}" + (f" ({shard.last_error})" if shard.last_error else "")
        for shard in state.status.shards
        if shard.phase != "Ready"
    ]
    if troubles:
        detail = f"{detail}; {'; '.join(troubles)}"
    return errors.FleetNotReady(
        state.name, ready.reason if ready is not None else "", ready.message if ready is not None else "", detail=detail
    )


def _start(send: SendFn, attempt: Attempt) -> tuple[Attempt, asyncio.Future[None]]:
    """Run ``send(attempt)`` on a daemon thread (an abandoned attempt ends by its own deadline)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def run() -> None:
        outcome: BaseException | None = None
        try:
            send(attempt)
        except BaseException as error:  # handed to the event loop
            outcome = error
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=f"refit-{attempt.refit}-attempt-{attempt.attempt}", daemon=True).start()
    return attempt, future


async def _last_sender(
    name: str,
    status: v1alpha1.RefitObjectStatus,
    senders: dict[int, tuple[Attempt, asyncio.Future[None]]],
    timeout: float,
) -> None:
    """The succeeded attempt's sender returns once every receiver acknowledged; it must not have failed."""
    last = senders[max(senders)][1]
    await asyncio.wait({last}, timeout=timeout)
    if not last.done() or last.exception() is not None:
        what = _sender_failures(senders) or "it is still running"
        raise errors.RefitFailed(name, f"the fleet took the version but the trainer's sender: {what}", status)


def _sender_failures(senders: dict[int, tuple[Attempt, asyncio.Future[None]]]) -> str:
    failed = [
        f"attempt {attempt}: {type(future.exception()).__name__}: {future.exception()}"
        for attempt, (_, future) in sorted(senders.items())
        if future.done() and future.exception() is not None
    ]
    return "; ".join(failed)
