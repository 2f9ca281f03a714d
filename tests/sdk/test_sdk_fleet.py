"""The fleet client's side of the API server, over the tests' in-memory transport: finding a fleet,
waiting for Ready through a watch (and the errors that name why not), routing by pod IPs, and a
checkpoint refit followed through its Refit object. The same client against the real control plane:
tests/e2e/test_sdk.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from helpers import kube_fakes
from megafleet import names
from megafleet.sdk import errors, fleet

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
NS = "rl"
READY = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}


def tiny(**status: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"]["namespace"] = NS
    manifest["status"] = status
    return manifest


def serving(version: int = 0) -> dict[str, Any]:
    """A Ready status: both shards serve ``version`` behind their reserved endpoints."""
    return {
        "observedGeneration": 1,
        "conditions": [READY],
        "endpoints": [
            {
                "shard": i,
                "url": f"http://10.96.0.{10 + i}:8000/v1",
                "dnsURL": f"http://tiny-s{i}.rl.svc:8000/v1",
                "service": f"tiny-s{i}",
            }
            for i in (0, 1)
        ],
        "shards": [{"index": i, "phase": "Ready", "pods": [f"tiny-s{i}-p0"], "weightVersion": version} for i in (0, 1)],
        "refit": {"currentVersion": version},
    }


async def watching(api: kube_fakes.Api, kind: str) -> None:
    """Until the client's watch of ``kind`` started (it then sees every later change)."""
    while not api.reads[f"watch {kind}"]:
        await asyncio.sleep(0)


def run(api: kube_fakes.Api, scenario: Callable[[fleet.Fleet], Awaitable[T]], **options: Any) -> T:
    async def main() -> T:
        async with fleet.Fleet("tiny", NS, client=api, **options) as client:
            return await scenario(client)

    return asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_missing_fleet_is_not_found() -> None:
    with pytest.raises(errors.FleetNotFound, match="rl/tiny does not exist"):
        run(kube_fakes.Api(), lambda client: client.get())


def test_wait_ready_follows_the_watch_until_ready_then_routes_to_the_ready_shards() -> None:
    api = kube_fakes.Api(tiny(conditions=[{"type": "Ready", "status": "False", "reason": "ShardsNotReady"}]))

    async def scenario(client: fleet.Fleet) -> tuple[fleet.FleetState, list[str]]:
        waiting = asyncio.create_task(client.wait_ready(timeout=10))
        await watching(api, "MegatronGeneration")
        assert not waiting.done()  # not Ready yet
        await api.patch_status("MegatronGeneration", "tiny", NS, serving())
        state = await waiting
        return state, [frontend.url for frontend in client.router.frontends]

    state, urls = run(api, scenario)
    assert state.ready and state.status.refit is not None and state.status.refit.current_version == 0
    assert urls == ["http://10.96.0.10:8000/v1", "http://10.96.0.11:8000/v1"]
    assert api.reads["watch MegatronGeneration"] == 1


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_wait_ready_names_why_a_fleet_is_not_ready() -> None:
    invalid = {"type": "InvalidSpec", "status": "True", "reason": "NoSuchBackend", "message": "engine.backend"}
    with pytest.raises(errors.FleetNotReady, match="NoSuchBackend") as raised:
        run(kube_fakes.Api(tiny(conditions=[invalid])), lambda client: client.wait_ready(timeout=10))
    assert raised.value.reason == "NoSuchBackend"

    stuck = tiny(
        conditions=[{"type": "Ready", "status": "False", "reason": "ShardsNotReady", "message": "0 of 2"}],
        shards=[{"index": 0, "phase": "Ready"}, {"index": 1, "phase": "Failed", "lastError": "image pull"}],
    )
    with pytest.raises(errors.FleetNotReady, match=r"still not Ready after 0 s; shard 1: Failed \(image pull\)"):
        run(kube_fakes.Api(stuck), lambda client: client.wait_ready(timeout=0.2))


def test_a_fleet_deleted_while_waiting_is_not_found() -> None:
    api = kube_fakes.Api(tiny())

    async def scenario(client: fleet.Fleet) -> fleet.FleetState:
        waiting = asyncio.create_task(client.wait_ready(timeout=10))
        await watching(api, "MegatronGeneration")
        await api.delete("MegatronGeneration", "tiny", NS)
        return await waiting

    with pytest.raises(errors.FleetNotFound, match="was deleted"):
        run(api, scenario)


def test_pod_addressing_routes_to_the_pods_ips() -> None:
    pods = [
        {
            "kind": "Pod",
            "metadata": {"name": f"tiny-s{i}-p0", "namespace": NS, "labels": {names.LABEL_FLEET: "tiny"}},
            "spec": {},
            "status": {"podIP": f"127.0.0.{20 + i}"},
        }
        for i in (0, 1)
    ]
    api = kube_fakes.Api(tiny(**serving()), *pods)
    frontends = run(api, lambda client: client.refresh(), addressing="pod")
    assert [(f.shard, f.url) for f in frontends] == [(0, "http://127.0.0.20:8000/v1"), (1, "http://127.0.0.21:8000/v1")]


def test_routes_older_than_their_max_age_follow_a_scale_out_and_in_and_survive_a_failed_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client that never refits (an RL job's rollout workers) still routes to the shards a scale adds
    and stops routing to those it removes, within ``ROUTES_MAX_AGE_SECONDS``; a failed read keeps the
    routes there are."""
    one = serving(version=1)
    one["shards"][1] = {"index": 1, "phase": "Stale", "pods": ["tiny-s1-p0"]}  # a scale-out's new shard
    api = kube_fakes.Api(tiny(**one))

    async def scenario(client: fleet.Fleet) -> list[list[int]]:
        seen = []
        await client.ensure_routed()  # nothing routed yet: read at once
        seen.append([frontend.shard for frontend in client.router.frontends])
        await api.patch_status("MegatronGeneration", "tiny", NS, serving(version=1))  # shard 1 caught up
        monkeypatch.setattr(fleet, "ROUTES_MAX_AGE_SECONDS", 60.0)
        await client.ensure_routed()  # young routes: not read again
        seen.append([frontend.shard for frontend in client.router.frontends])
        monkeypatch.setattr(fleet, "ROUTES_MAX_AGE_SECONDS", 0.0)
        await client.ensure_routed()
        seen.append([frontend.shard for frontend in client.router.frontends])
        scaled_in = serving(version=1)
        scaled_in["shards"] = scaled_in["shards"][:1]
        await api.patch_status("MegatronGeneration", "tiny", NS, scaled_in)
        await client.ensure_routed()
        seen.append([frontend.shard for frontend in client.router.frontends])
        await api.delete("MegatronGeneration", "tiny", NS)
        await client.ensure_routed()  # the read fails: the routes stay
        seen.append([frontend.shard for frontend in client.router.frontends])
        return seen

    assert run(api, scenario) == [[0], [0], [0, 1], [0], [0]]


def test_a_checkpoint_refit_is_followed_through_its_refit_object_then_routed() -> None:
    api = kube_fakes.Api(tiny(**serving()))

    async def operator() -> None:
        """What the operator does with the Refit: run it over both shards, then end it."""
        async for event, obj in api.watch("Refit", namespace=NS):
            if event != "ADDED":
                continue
            name = obj["metadata"]["name"]
            membership = {"worldSize": 2, "trainerWorldSize": 1, "rankOffsets": [{"shard": 0, "offset": 1}]}
            await api.patch_status("Refit", name, NS, {"phase": "Running", "attempts": 1, "membership": membership})
            await api.patch_status("Refit", name, NS, {"phase": "Succeeded", "message": "version 1"})
            await api.patch_status("MegatronGeneration", "tiny", NS, serving(1))
            return

    async def scenario(client: fleet.Fleet) -> tuple[fleet.RefitResult, list[tuple[int, int | None]]]:
        acting = asyncio.create_task(operator())
        result = await client.refit(1, checkpoint="/ckpt/v1", timeout=10)
        await acting
        return result, [(frontend.shard, frontend.weight_version) for frontend in client.router.frontends]

    result, routed = run(api, scenario)
    assert routed == [(0, 1)]  # the Refit's members, at once
    assert result.name == "tiny-v1-00001" and result.version == 1 and result.members == (0,)
    refit = api.objects[("Refit", NS, result.name)]
    assert refit["spec"] == {"fleetRef": {"name": "tiny"}, "version": 1, "source": {"checkpoint": {"path": "/ckpt/v1"}}}
    assert api.writes["create Refit"] == 1


def test_a_refits_overrides_go_into_its_spec_and_its_result_says_what_ran() -> None:
    """``Fleet.refit(..., in_flight=, kv_cache_mode=, staging=, commit=)`` set the Refit's overrides (the
    NeMo adapter's async-GRPO flags arrive this way); the result carries the status's report of them."""
    api = kube_fakes.Api(tiny(**serving()))
    report = {
        "inFlight": {"requested": "keep", "effective": "keep", "kvCacheMode": "recompute", "kept": 8},
        "staging": {"requested": "auto", "effective": "staged", "bytes": 4096},
        "pause": {
            "stallP50Milliseconds": 11,
            "stallMaxMilliseconds": 13,
            "gateClosedMaxMilliseconds": 13,
            "recomputeMaxMilliseconds": 4,
            "shards": [{"shard": 0, "stallMilliseconds": 11}],
        },
        "commit": {"requested": "operator", "mode": "operator", "decidedTime": "2026-01-01T00:00:05Z"},
    }

    async def operator() -> None:
        async for event, obj in api.watch("Refit", namespace=NS):
            if event != "ADDED":
                continue
            name = obj["metadata"]["name"]
            membership = {"worldSize": 2, "trainerWorldSize": 1, "rankOffsets": [{"shard": 0, "offset": 1}]}
            await api.patch_status("Refit", name, NS, {"phase": "Running", "attempts": 1, "membership": membership})
            await api.patch_status("Refit", name, NS, {"phase": "Succeeded", "message": "version 1", **report})
            await api.patch_status("MegatronGeneration", "tiny", NS, serving(1))
            return

    async def scenario(client: fleet.Fleet) -> fleet.RefitResult:
        acting = asyncio.create_task(operator())
        result = await client.refit(
            1,
            checkpoint="/ckpt/v1",
            timeout=10,
            in_flight="keep",
            kv_cache_mode="recompute",
            staging="auto",
            commit="operator",
        )
        await acting
        return result

    result = run(api, scenario)
    spec = api.objects[("Refit", NS, result.name)]["spec"]
    assert (spec["inFlight"], spec["kvCacheMode"], spec["staging"]) == ("keep", "recompute", "auto")
    assert spec["commit"] == "operator"
    assert result.commit is not None and result.commit.decided_time == "2026-01-01T00:00:05Z"
    assert result.in_flight is not None and (result.in_flight.effective, result.in_flight.kept) == ("keep", 8)
    assert result.staging is not None and result.staging.effective == "staged"
    assert result.pause is not None and (result.pause.stall_max_milliseconds, result.pause.shards[0].shard) == (13, 0)


def test_a_fleet_over_an_api_needs_its_namespace() -> None:
    with pytest.raises(ValueError, match="needs its namespace"):
        fleet.Fleet("tiny", client=kube_fakes.Api())
