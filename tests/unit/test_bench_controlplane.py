"""The control-plane benchmark's audit-log reading (bench/controlplane.py): its timeline
shows the API server's own ClusterIP records (IPAddress creates) of the measured window beside the
systems' writes, so where a ClusterIP Service create's time goes is visible."""

from __future__ import annotations

import datetime
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench" / "controlplane.py"
START = datetime.datetime(2026, 12, 2, 8, 0, tzinfo=datetime.UTC)


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_controlplane", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(
    at: float, took: float, verb: str, resource: str, *, namespace: str | None, agent: str, code: int = 201
) -> dict[str, Any]:
    received = START + datetime.timedelta(seconds=at)
    answered = received + datetime.timedelta(seconds=took)
    ref: dict[str, Any] = {"resource": resource, "name": f"{resource}-{at}"}
    if namespace is not None:
        ref["namespace"] = namespace
    return {
        "verb": verb,
        "userAgent": agent,
        "objectRef": ref,
        "responseStatus": {"code": code},
        "requestReceivedTimestamp": received.isoformat().replace("+00:00", "Z"),
        "stageTimestamp": answered.isoformat().replace("+00:00", "Z"),
    }


def test_the_timeline_shows_the_api_servers_clusterip_records_of_the_window_only(tmp_path: Path) -> None:
    bench = _bench()
    apiserver = "kube-apiserver/v1.36.3 (linux/amd64)"
    events = [
        _event(1.0, 0.2, "create", "services", namespace="ns", agent="python-httpx2/2.16.2"),
        _event(1.1, 0.05, "create", "ipaddresses", namespace=None, agent=apiserver),
        _event(2.0, 0.3, "create", "services", namespace="ns", agent="python-httpx2/2.16.2"),
        _event(2.1, 0.07, "create", "ipaddresses", namespace=None, agent=apiserver),
        _event(2.2, 0.01, "create", "ipaddresses", namespace=None, agent=apiserver, code=409),  # refused: not counted
        _event(50.0, 0.01, "create", "ipaddresses", namespace=None, agent=apiserver),  # after the window
        _event(3.0, 0.01, "delete", "ipaddresses", namespace=None, agent=apiserver),  # a release, not an allocation
        _event(3.0, 0.02, "create", "services", namespace="other", agent="python-httpx2/2.16.2"),  # another namespace
    ]
    log = tmp_path / "audit.log"
    log.write_text("".join(json.dumps(event) + "\n" for event in events))

    table = bench.timeline(log, 0, "ns", "operator", START.timestamp(), 10.0)

    assert table["operator create services"]["count"] == 2
    allocations = table["apiserver create ipaddresses"]
    assert allocations["count"] == 2
    assert allocations["first_s"] == 1.1 and allocations["last_s"] == 2.1
    assert allocations["max_ms"] == 70.0
    assert set(table) == {"operator create services", "apiserver create ipaddresses"}


def test_lws_runs_megafleets_engine_pods_without_megafleets_pinning_and_agent() -> None:
    bench = _bench()
    for variant, size in (("tp8", 1), ("tp16", 2)):
        lws = bench.lws_object("g0", variant)["spec"]["leaderWorkerTemplate"]
        assert lws["size"] == size
        pod = lws["workerTemplate"]["spec"]
        container = pod["containers"][0]
        assert container["command"] == ["megafleet-engine"] and container["readinessProbe"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert {"MEGAFLEET_TENSOR_PARALLEL", "MEGAFLEET_MODEL_SOURCE"} <= {e["name"] for e in container["env"]}
        assert "affinity" not in pod and "hostname" not in pod  # placement is the scheduler's
        assert all("agent" not in volume["name"] for volume in pod["volumes"])
        assert all("agent" not in mount["name"] for mount in container["volumeMounts"])
    minimal = bench.lws_object("g0", "tp8", "minimal")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    assert set(minimal["containers"][0]) == {"name", "image", "resources"}
