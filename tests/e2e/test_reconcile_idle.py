"""A reconcile with nothing to change makes no API writes (run in-process, real API server, real
engine processes through the local runner)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import lightkube
import pytest
import yaml
from lightkube.config.kubeconfig import KubeConfig

from megafleet import agent_client, names, reconcile, settings
from megafleet import kube as operator_kube
from megafleet.reconcile import context
from megafleet_dev import kube, runner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def unwatched_namespace(kube_admin: kube.Kube) -> Iterator[str]:
    """A namespace the session's operator does not watch: this test is the only reconciler."""
    name = kube_admin.create_namespace("idle")
    yield name
    kube_admin.delete(f"/api/v1/namespaces/{name}", missing_ok=True)


def test_second_reconcile_of_a_settled_fleet_writes_nothing(
    crds: None, pod_runner: runner.Runner, kubeconfig: Path, kube_admin: kube.Kube, unwatched_namespace: str
) -> None:
    namespace = unwatched_namespace
    manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    path = f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations/tiny"
    kube_admin.create(path.rsplit("/", 1)[0], manifest)

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        client = lightkube.AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager=names.FIELD_MANAGER)
        api = operator_kube.Api(client)
        runtime = context.Runtime.of(api, agent_client.AgentClient(timeout_seconds=2.0), settings.OperatorSettings())
        try:
            await reconcile.reconcile(runtime, kube_admin.get(path) or {})
            first = dict(api.writes)
            # Reconcile as the operator's timer would until both engines answer Ready.
            while (kube_admin.get(path) or {}).get("status", {}).get("readyReplicas") != 2:
                await asyncio.sleep(0.5)  # stands in for the operator's observation interval
                await reconcile.reconcile(runtime, kube_admin.get(path) or {})
            api.writes.clear()
            await reconcile.reconcile(runtime, kube_admin.get(path) or {})
            return first, dict(api.writes)
        finally:
            await runtime.close()

    first, idle = asyncio.run(asyncio.wait_for(scenario(), timeout=120))

    assert first["create Pod"] == 2 and first["create Service"] == 1  # the first pass did the work
    assert idle == {}
