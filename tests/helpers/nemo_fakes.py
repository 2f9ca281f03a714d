"""Stand-ins for the NeMo RL adapter's fast tests (it holds no tests): the API server and the operator
(:class:`FakeOperator`), the fleet client over them (:class:`FakeFleet`) and an OpenAI frontend on
``httpx.MockTransport`` whose answers can be held back and can span a refit (:class:`SpanFrontend`);
:func:`install` makes every adapter (and pickled copy) made afterwards connect to them.

Used by tests/unit/test_nemo_wire.py (``refit_wire="nemo"``) and tests/sdk/test_nemo_in_flight_flags.py
(NeMo RL's async flags on both wires). What the fakes do not do: :class:`FakeOperator` runs no
attempts and sends nothing to engines, it moves a session to its phase (and its NeMo reshard stages
to ``ReshardJoined``) and a Refit from Pending to Running to Succeeded (or Failed) as it is read; its
``status.inFlight`` is the spec's request (the fleet's ``refit.inFlight`` when unset) unless the test
says the engines could not keep. :class:`SpanFrontend` generates token 7 only, with fixed logprobs.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from helpers import kube_fakes
from megafleet import kube
from megafleet.api import v1alpha1
from megafleet.sdk import fleet, generation, nemo, routing
from megafleet.sdk.nemo import clients as nemo_clients

NAMESPACE = "ns"
FLEET = "tiny"
URL = "http://fake-frontend/v1"
LIMIT = 64  # the fleet's maxSequenceLength


def fleet_object(
    replicas: int = 2, tensor: int = 1, bucket_mib: int = 3, kv_cache_mode: str = "persist"
) -> dict[str, Any]:
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": FLEET, "namespace": NAMESPACE, "uid": "fleet-uid", "generation": 1},
        "spec": {
            "model": {"source": "tiny://llama", "maxSequenceLength": LIMIT},
            "replicas": replicas,
            "parallelism": {"tensor": tensor},
            "resources": {"gpusPerNode": 0},
            "engine": {"kvCacheMode": kv_cache_mode},
            "refit": {"bucketSizeMiB": bucket_mib},
        },
        "status": {
            "observedGeneration": 1,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": ""}],
            "refit": {"currentVersion": 4},
        },
    }


def deep_merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


class FakeOperator(kube_fakes.Api):
    """The API server plus the operator's side of sessions and Refits, advanced on every read."""

    def __init__(self, fleet_obj: dict[str, Any]) -> None:
        super().__init__(fleet_obj)
        self.release = threading.Event()  # a Running Refit finishes only once set
        self.release.set()
        self.break_with: tuple[str, str] | None = None  # (reason, message): the next Refit fails, session Broken
        self.session_phase = "Joined"  # what a new session reaches
        self.cannot_keep = False  # the engines drain a Refit that asks for keep (KeepUnavailable)
        self.on_succeeded: Callable[[int], None] | None = None  # told each version the fleet serves
        self.lock = threading.RLock()  # create reads through get

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(obj) for (k, _, _), obj in sorted(self.objects.items()) if k == kind]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return await super().create(obj)

    async def delete(
        self, kind: str, name: str, namespace: str | None = None, *, grace_seconds: int | None = None
    ) -> None:
        with self.lock:
            await super().delete(kind, name, namespace, grace_seconds=grace_seconds)

    async def patch(self, kind: str, name: str, namespace: str | None, patch: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.writes[f"patch {kind}"] += 1
            deep_merge(self.objects[(kind, namespace, name)], patch)
            return copy.deepcopy(self.objects[(kind, namespace, name)])

    async def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        with self.lock:
            self._advance()
            return await super().get(kind, name, namespace)

    async def list(
        self,
        kind: str,
        *,
        namespace: str | None = None,
        labels: kube.Selector | None = None,
        fields: kube.Selector | None = None,
    ) -> list[dict[str, Any]]:
        with self.lock:
            return await super().list(kind, namespace=namespace, labels=labels, fields=fields)

    def _advance(self) -> None:
        for (kind, namespace, _), obj in list(self.objects.items()):
            status = obj.setdefault("status", {})
            if kind == "RefitSession":
                if status.get("phase", "Pending") == "Pending":
                    status["phase"] = self.session_phase
                    status["message"] = "" if self.session_phase == "Joined" else "JoinFailed: pod tiny-s1-p0 refused"
                reshard = obj["spec"].get("nemoReshard")
                reference = obj["spec"].get("refitInfo") or (reshard or {}).get("refitInfo")
                found = {condition["type"] for condition in status.get("conditions", [])}
                if reference and "RefitInfoAccepted" not in found:
                    status.setdefault("conditions", []).append(self._info_condition(namespace, reference))
                if reshard and "ReshardJoined" not in found and status["phase"] == "Joined":
                    joined = {"type": "ReshardJoined", "status": "True", "reason": "AllMembersJoined", "message": ""}
                    status.setdefault("conditions", []).append(joined)
            elif kind == "Refit":
                phase = status.get("phase")
                if phase is None:
                    status["phase"] = "Running"
                elif phase == "Running" and self.release.is_set():
                    self._finish(namespace, obj)

    def _info_condition(self, namespace: str | None, reference: dict[str, Any]) -> dict[str, Any]:
        stored = self.objects.get(("ConfigMap", namespace, reference["configMapRef"]["name"]))
        data = base64.b64decode((stored or {}).get("binaryData", {}).get(reference["configMapRef"]["key"], ""))
        good = hashlib.sha256(data).hexdigest() == reference["sha256"]
        return {"type": "RefitInfoAccepted", "status": "True" if good else "False", "reason": "Checked", "message": ""}

    def _finish(self, namespace: str | None, refit: dict[str, Any]) -> None:
        source = refit["spec"]["source"].get("session")
        session = None if source is None else self.objects[("RefitSession", namespace, source["name"])]
        if self.break_with is not None:
            reason, message = self.break_with
            refit["status"].update(phase="Failed", message=f"{reason}: {message}")
            if session is not None:
                session["status"].update(
                    phase="Broken",
                    message=message,
                    conditions=[{"type": "Broken", "status": "True", "reason": reason, "message": message}],
                )
            return
        fleet_obj = self.objects[("MegatronGeneration", NAMESPACE, FLEET)]
        refit["status"]["phase"] = "Succeeded"
        refit["status"]["inFlight"] = self._in_flight(refit["spec"], fleet_obj["spec"])
        version = refit["spec"]["version"]
        fleet_obj["status"]["refit"]["currentVersion"] = version
        if session is not None:
            session["status"]["lastVersion"] = version
        if self.on_succeeded is not None:
            self.on_succeeded(version)

    def _in_flight(self, spec: dict[str, Any], fleet_spec: dict[str, Any]) -> dict[str, Any]:
        """What the operator reports: the request, and what the engines did with it."""
        requested = spec.get("inFlight") or fleet_spec.get("refit", {}).get("inFlight", v1alpha1.DEFAULT_IN_FLIGHT)
        effective = "drain" if self.cannot_keep and requested == "keep" else requested
        return {
            "requested": requested,
            "effective": effective,
            "kvCacheMode": spec.get("kvCacheMode", fleet_spec["engine"]["kvCacheMode"]),
        }


class SpanFrontend:
    """An OpenAI completions endpoint: token 7 up to ``max_tokens`` (logprob -0.5 each), stamped with
    the fleet's version when the request arrived; while :attr:`hold` is clear, answers wait, and an
    answer released after a refit spans both versions (its first :attr:`before_switch` tokens from
    the old one), as an engine that keeps its sequences through the refit."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.before_switch = 3
        self.hold = threading.Event()
        self.hold.set()
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def refitted(self, version: int) -> None:
        """:attr:`FakeOperator.on_succeeded`: the fleet serves ``version`` from now on."""
        self.version = version

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": FLEET, "max_model_len": LIMIT}]})
        body = json.loads(request.content)
        with self.lock:
            self.bodies.append(body)
        started = self.version
        while not self.hold.is_set():  # an async handler: the adapter's other calls go on meanwhile
            await asyncio.sleep(0.005)
        ended = self.version
        batched = bool(body["prompt"]) and isinstance(body["prompt"][0], list)
        prompts = body["prompt"] if batched else [body["prompt"]]
        tokens = [7] * body["max_tokens"]
        spans = [{"start": 0, "version": started}]
        if ended != started:
            spans.append({"start": min(self.before_switch, len(tokens)), "version": ended})
        choices = [
            {
                "index": index,
                "text": "",
                "token_ids": tokens,
                "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                "finish_reason": "length",
                "weight_version_spans": spans,
            }
            for index in range(len(prompts))
        ]
        return httpx.Response(200, json={"choices": choices, "weight_version": started})


class FakeFleet(fleet.Fleet):
    """The fleet client reading the fake API server, routing to ``frontend`` when given (else to no
    frontend: routing is not what the wire's tests are about). Its :meth:`refit` is the megafleet
    wire's: it records its keyword arguments and makes the Refit the real client makes."""

    def __init__(self, api: FakeOperator, frontend: SpanFrontend | None = None) -> None:
        http = (
            httpx.AsyncClient(transport=httpx.MockTransport(frontend)) if frontend is not None else httpx.AsyncClient()
        )
        super().__init__(FLEET, NAMESPACE, client=api, http=http)
        self.serves = frontend is not None
        self.refits: list[tuple[int, dict[str, Any]]] = []
        """(version, keyword arguments) of every :meth:`refit` asked for."""

    async def wait_ready(self, timeout: float = 0) -> fleet.FleetState:
        state = await self.get()
        if self.serves:
            await self.refresh()
        return state

    async def refresh(self) -> list[routing.Frontend]:
        frontends = [routing.Frontend(0, URL, None)] if self.serves else []
        if self.serves:
            self.router.update(frontends)
        return frontends

    async def refit(self, version: int, **options: Any) -> fleet.RefitResult:
        self.refits.append((version, options))
        names = {"in_flight": "inFlight", "kv_cache_mode": "kvCacheMode", "staging": "staging"}
        source = {"checkpoint": {"path": options["checkpoint"]}} if options.get("checkpoint") else {"rendezvous": {}}
        spec = {"fleetRef": {"name": FLEET}, "version": version, "source": source}
        spec |= {names[key]: value for key, value in options.items() if key in names and value is not None}
        name = f"{FLEET}-v{version}"
        await self.api.create(
            {"apiVersion": v1alpha1.API_VERSION, "kind": "Refit", "metadata": {"name": name, "namespace": NAMESPACE}}
            | {"spec": spec}
        )
        while ((await self.api.get("Refit", name, NAMESPACE)) or {}).get("status", {}).get("phase") != "Succeeded":
            await asyncio.sleep(0.005)
        return fleet.RefitResult(name, version, v1alpha1.RefitObjectStatus(phase="Succeeded"), (0,))


def install(
    monkeypatch: pytest.MonkeyPatch, fleet_obj: dict[str, Any], frontend: SpanFrontend | None = None
) -> FakeOperator:
    """Every adapter (and unpickled copy) made from here connects to a :class:`FakeFleet` over one
    :class:`FakeOperator` (returned), routing to ``frontend`` when given."""
    api = FakeOperator(fleet_obj)
    if frontend is not None:
        api.on_succeeded = frontend.refitted

    async def make_clients(handle: nemo.Handle) -> tuple[fleet.Fleet, generation.Generator, Any]:
        found = FakeFleet(api, frontend)
        return found, found.generator, api

    monkeypatch.setattr(nemo_clients, "make_clients", make_clients)
    return api
