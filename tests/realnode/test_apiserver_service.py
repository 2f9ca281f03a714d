"""In-cluster clients reach the API server as on a real cluster: a pod on the real node resolves
``kubernetes.default.svc`` (CoreDNS) to the ``kubernetes`` Service's ClusterIP, connects through
kube-proxy to the endpoint :func:`realnode.start` publishes (the forwarder on the node's IP),
verifies the serving certificate with its ServiceAccount's CA for that name, and is authenticated
by its ServiceAccount token."""

from __future__ import annotations

import json
from typing import Any

import pytest

from megafleet_dev import images, kube, realnode

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(900)]

WAIT = 180
ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"

# What a client library's in-cluster configuration does, by hand with the standard library: the
# address, the answer to a SelfSubjectReview (who the API server says the token belongs to), as
# the termination message (no log access needed).
CLIENT = f"""
import json, socket, ssl, urllib.request
host = "kubernetes.default.svc"
address = socket.gethostbyname(host)
context = ssl.create_default_context(cafile="{ACCOUNT}/ca.crt")
token = open("{ACCOUNT}/token").read().strip()
body = json.dumps({{"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}}).encode()
request = urllib.request.Request(
    f"https://{{host}}/apis/authentication.k8s.io/v1/selfsubjectreviews",
    body,
    {{"Authorization": "Bearer " + token, "Content-Type": "application/json"}},
)
review = json.load(urllib.request.urlopen(request, timeout=30, context=context))
seen = {{"address": address, "user": review["status"]["userInfo"]["username"]}}
open("/dev/termination-log", "w").write(json.dumps(seen))
"""


def client_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "in-cluster-client"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {realnode.REAL_NODE_LABEL: "true"},
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "client",
                    "image": images.reference("operator"),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", CLIENT],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                }
            ],
        },
    }


def test_a_pod_reaches_the_api_server_through_kubernetes_default_svc_with_its_token(
    real_node: realnode.RealNode, kube_admin: kube.Kube
) -> None:
    service = kube_admin.get("/api/v1/namespaces/default/services/kubernetes")
    assert service is not None
    namespace = kube_admin.create_namespace("apisvc")
    try:
        kube_admin.wait(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/default",
            lambda obj: obj is not None,
            timeout=WAIT,
            what="the namespace's default ServiceAccount",
        )
        kube_admin.create(f"/api/v1/namespaces/{namespace}/pods", client_pod())
        done = kube_admin.wait(
            f"/api/v1/namespaces/{namespace}/pods/in-cluster-client",
            lambda pod: (pod or {}).get("status", {}).get("phase") in ("Succeeded", "Failed"),
            timeout=WAIT,
            what="the in-cluster client to finish",
        )
        assert done is not None
        terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
        assert done["status"]["phase"] == "Succeeded", terminated
        seen = json.loads(terminated["message"])
        assert seen["address"] == service["spec"]["clusterIP"]
        assert seen["user"] == f"system:serviceaccount:{namespace}:default"
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
