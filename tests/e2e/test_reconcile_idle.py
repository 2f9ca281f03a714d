"""A reconcile with nothing to change makes no API writes (run in-process, real API server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import lightkube
import yaml
from lightkube.config.kubeconfig import KubeConfig

from megafleet import kube as operator_kube
from megafleet import names, reconcile
from megafleet_dev import kube

ROOT = Path(__file__).resolve().parents[2]


def install_crds(kube_admin: kube.Kube) -> None:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        url = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"
        if kube_admin.get(url) is None:
            kube_admin.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        kube_admin.wait(url, lambda obj: (kube.condition(obj, "Established") or {}).get("status") == "True", timeout=60)


def test_second_reconcile_of_a_settled_fleet_writes_nothing(
    kubeconfig: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    install_crds(kube_admin)
    manifest = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    path = f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations/tiny"
    kube_admin.create(path.rsplit("/", 1)[0], manifest)

    async def scenario() -> tuple[dict[str, int], dict[str, int]]:
        client = lightkube.AsyncClient(config=KubeConfig.from_file(kubeconfig), field_manager=names.FIELD_MANAGER)
        api = operator_kube.Api(client)
        try:
            await reconcile.reconcile(api, kube_admin.get(path) or {})
            first = dict(api.writes)
            for pod in ("tiny-s0-p0", "tiny-s1-p0"):
                await asyncio.to_thread(
                    kube_admin.wait,
                    f"/api/v1/namespaces/{namespace}/pods/{pod}",
                    lambda p: bool(p and p["status"].get("phase") == "Running"),
                    timeout=60,
                )
            await reconcile.reconcile(api, kube_admin.get(path) or {})  # observes Running pods
            api.writes.clear()
            await reconcile.reconcile(api, kube_admin.get(path) or {})
            return first, dict(api.writes)
        finally:
            await api.close()

    first, idle = asyncio.run(scenario())

    assert first["create Pod"] == 2 and first["create Service"] == 4  # the first pass did the work
    assert idle == {}
    fleet = kube_admin.get(path)
    assert fleet is not None and fleet["status"]["readyReplicas"] == 2
