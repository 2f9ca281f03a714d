"""Shared by the refit end-to-end tests: the tiny fleet manifest, API paths, a trainer model that
refits a fleet through a Refit object, and what a frontend serves."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import openai
import torch
import yaml

from megafleet.objects import Object
from megafleet_dev import kube
from megafleet_engine.models import tiny
from megafleet_protocol import ports
from megafleet_protocol.refit import sender as sdk

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120
TRAINER_SOURCE = "tiny://llama?seed=7"  # the engines' architecture, other weights
TRAINER_ADDRESS = "127.0.9.2"
PROMPT = [1, 40, 41, 42, 43]


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def refits(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/refits"


REFIT_ENDED = ("Succeeded", "Failed")
DRAIN_IN_PLACE: dict[str, Any] = {"inFlight": "drain", "staging": "off"}
"""``spec.refit`` of a fleet whose refits suspend the engines (drain) and write the live weights
while they are suspended, as every refit did before keep and staging became the defaults: named by
the tests of a suspended engine (its agent ``suspended`` while the weights travel, requests held at
its gate, answers that never span two versions)."""


def refit_manifest(fleet: str, version: int, *, port: int | None = None, checkpoint: str | None = None) -> Object:
    """The Refit ``<fleet>-v<version>`` of the refit tests: from a one-rank trainer's rendezvous
    on :data:`TRAINER_ADDRESS` at ``port``, or from a ``checkpoint`` path (exactly one of them)."""
    if (port is None) == (checkpoint is None):
        raise ValueError("a Refit has exactly one source: a rendezvous port or a checkpoint path")
    source: dict[str, Any] = (
        {"rendezvous": {"address": TRAINER_ADDRESS, "port": port, "trainerWorldSize": 1}}
        if port is not None
        else {"checkpoint": {"path": checkpoint}}
    )
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "Refit",
        "metadata": {"name": f"{fleet}-v{version}"},
        "spec": {"fleetRef": {"name": fleet}, "version": version, "source": source},
    }


def create_refit(
    client: kube.Kube,
    namespace: str,
    fleet: str,
    version: int,
    *,
    port: int | None = None,
    checkpoint: str | None = None,
) -> str:
    """Create :func:`refit_manifest`'s Refit in ``namespace``; returns its API path."""
    manifest = refit_manifest(fleet, version, port=port, checkpoint=checkpoint)
    client.create(refits(namespace), manifest)
    return f"{refits(namespace)}/{manifest['metadata']['name']}"


def refit_ended(obj: Object | None) -> bool:
    return (obj or {}).get("status", {}).get("phase") in REFIT_ENDED


def tiny_fleet(**spec: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"].update(spec)
    return manifest


def ready(obj: Object | None) -> bool:
    return (kube.condition(obj, "Ready") or {}).get("status") == "True"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((TRAINER_ADDRESS, 0))
        return int(probe.getsockname()[1])


class TrainerModel:
    def __init__(self) -> None:
        self.model, _ = tiny.build_tiny(TRAINER_SOURCE)

    def greedy(self, max_new_tokens: int) -> list[int]:
        inputs = torch.tensor([PROMPT])
        with torch.inference_mode():
            output = self.model.generate(
                inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=max_new_tokens
            )
        return [int(token) for token in output[0, len(PROMPT) :]]

    def refit(self, kube_admin: kube.Kube, namespace: str, fleet: str, version: int) -> Object:
        """Create the Refit, learn the membership from its status, send, and wait for the outcome."""
        port = free_port()
        path = create_refit(kube_admin, namespace, fleet, version, port=port)
        running = kube_admin.wait(
            path,
            lambda r: (r or {}).get("status", {}).get("phase") == "Running",
            timeout=WAIT,
            what="the operator to publish the membership",
        )
        assert running is not None
        membership = running["status"]["membership"]
        attempt = running["status"]["attempts"]
        sender = sdk.WeightSender(
            ports.attempt_port(port, attempt), membership["worldSize"], address=TRAINER_ADDRESS, timeout_seconds=60
        )
        failure: list[BaseException] = []

        def send() -> None:
            try:
                sender.init()
                weights = [(n, p.detach()) for n, p in self.model.named_parameters()]
                sender.send(weights, bucket_size_mib=1, version=version)
            except BaseException as error:  # handed to the test thread
                failure.append(error)
            finally:
                sender.close()

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        done = kube_admin.wait(path, refit_ended, timeout=WAIT, what="the refit to finish")
        thread.join(timeout=WAIT)
        assert not failure, failure
        assert done is not None
        return done


def served(kube_admin: kube.Kube, namespace: str, pod: str) -> tuple[list[int], str]:
    found = kube_admin.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    assert found is not None
    url = f"http://{found['status']['podIP']}:8000/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
        )
    completion = raw.parse()
    ids = (completion.choices[0].model_extra or {})["token_ids"]
    return [int(token) for token in ids], raw.headers["X-Megafleet-Weight-Version"]
