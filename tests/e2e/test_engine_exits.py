"""Why an engine cannot run reaches the fleet, against the real control plane and real engines:
a setting the engine refuses in ``spec.engine.env`` is InvalidSpec naming the variable before any
pod exists; one only the kubelet can resolve (``$(NAME)``) starts pods whose engines exit, and
their termination message becomes the shard's lastError, the Degraded condition (never "AsDesired"
while no shard is ready after restarts) and the restart Events."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from megafleet.objects import Object
from megafleet_dev import kube

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120
REFUSED = "MEGAFLEET_FUSED_KERNELS must be one of rope-swiglu, off, gemv, all, got 'rm -rf /'"


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def tiny(env: list[dict[str, Any]]) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["replicas"] = 1
    manifest["spec"]["engine"]["env"] = env
    return manifest


def condition_is(kind: str, status: str) -> Callable[[Object | None], bool]:
    return lambda obj: (kube.condition(obj, kind) or {}).get("status") == status


def test_a_setting_the_engine_refuses_is_invalid_spec_naming_it(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    kube_admin.create(fleets(namespace), tiny([{"name": "MEGAFLEET_REFIT_WAIT_SECONDS", "value": "-5"}]))

    fleet = kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("InvalidSpec", "True"), timeout=WAIT)

    message = (kube.condition(fleet, "InvalidSpec") or {})["message"]
    assert message == "spec.engine.env[0]: MEGAFLEET_REFIT_WAIT_SECONDS must be at least 0, got -5"
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []
    events = kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/events", bool, field_selector="reason=InvalidSpec", timeout=WAIT
    )
    assert events[0]["type"] == "Warning" and "MEGAFLEET_REFIT_WAIT_SECONDS" in events[0]["message"]


def test_an_engine_that_exits_at_start_says_why_in_the_shard_the_events_and_degraded(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    """The operator cannot see through ``$(KERNELS)`` (the kubelet expands it): the fleet is admitted,
    and its engine exits with the reason in its termination message."""
    env = [{"name": "KERNELS", "value": "rm -rf /"}, {"name": "MEGAFLEET_FUSED_KERNELS", "value": "$(KERNELS)"}]
    kube_admin.create(fleets(namespace), tiny(env))

    def says_why(obj: Object | None) -> bool:
        shards = (obj or {}).get("status", {}).get("shards") or [{}]
        degraded = kube.condition(obj, "Degraded") or {}
        return REFUSED in str(shards[0].get("lastError")) and degraded.get("status") == "True"

    fleet = kube_admin.wait(f"{fleets(namespace)}/tiny", says_why, timeout=WAIT, what="the engine's reason in status")

    assert fleet is not None and fleet["status"]["readyReplicas"] == 0
    degraded = kube.condition(fleet, "Degraded") or {}
    assert degraded["reason"] == "ShardsFailing" and REFUSED in degraded["message"]
    assert (kube.condition(fleet, "InvalidSpec") or {}).get("status") == "False"
    events = kube_admin.wait_items(
        f"/api/v1/namespaces/{namespace}/events",
        lambda items: any(REFUSED in item["message"] for item in items),
        field_selector="reason=ShardRestarting",
        timeout=WAIT,
    )
    assert all(item["type"] == "Warning" for item in events)
