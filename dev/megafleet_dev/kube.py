"""A small admin client for the local API server: raw JSON objects and watch-based waits.

Used by :mod:`megafleet_dev.cluster` (node creation) and by tests, which assert on plain
Kubernetes JSON. Deliberately independent of the operator's own client code, so a test never
proves the operator right with the operator's own helpers.
"""

from __future__ import annotations

import json
import ssl
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from megafleet.objects import Object

Predicate = Callable[[Object | None], bool]
Events = list[Object]


RETRY_AFTER_SECONDS = 1.0
"""How long to wait before listing again when the API server answers 429 (its ``retryAfterSeconds``)."""


class KubeError(RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body}")
        self.status = status
        self.body = body


class WaitTimeout(TimeoutError):
    """A watched object did not reach the awaited state in time; carries its last seen state."""

    def __init__(self, what: str, timeout: float, last: Object | None) -> None:
        summary = json.dumps(last.get("status"), indent=1)[:2000] if last else "absent"
        super().__init__(f"timed out after {timeout:.0f} s waiting for {what}; last status: {summary}")
        self.last = last


def brief(obj: Object) -> dict[str, Any]:
    """What a timed-out wait shows of one object of a collection: its name, phase, node and
    conditions, without the metadata (managed fields, owners) that would fill the message first."""
    status = obj.get("status") or {}
    return {
        "name": obj.get("metadata", {}).get("name"),
        "phase": status.get("phase"),
        "node": (obj.get("spec") or {}).get("nodeName"),
        "conditions": [
            {key: condition.get(key) for key in ("type", "status", "reason", "message") if condition.get(key)}
            for condition in status.get("conditions") or []
        ],
    }


class Kube:
    """Admin access to one API server: ``get``/``create``/``delete``/``list``/``wait``."""

    def __init__(self, server: str, *, token: str, ca_file: str) -> None:
        self.server = server
        self._http = httpx.Client(
            base_url=server,
            verify=ssl.create_default_context(cafile=ca_file),
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(30.0),
        )

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Kube:
        """Read a token kubeconfig as written by :class:`megafleet_dev.cluster.LocalCluster`."""
        config = yaml.safe_load(path.read_text())
        context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        return cls(cluster["server"], token=user["token"], ca_file=cluster["certificate-authority"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Kube:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain calls ---------------------------------------------------------------------------

    def get(self, path: str) -> Object | None:
        """The object at ``path``, or ``None`` when it does not exist."""
        response = self._http.get(path)
        if response.status_code == 404:
            return None
        return _checked(response, f"GET {path}")

    def list(self, path: str, *, label_selector: str | None = None, field_selector: str | None = None) -> Object:
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        return _checked(self._http.get(path, params=params), f"LIST {path}")

    def create(self, path: str, body: Object) -> Object:
        return _checked(self._http.post(path, json=body), f"POST {path}")

    def patch(self, path: str, body: Object, *, merge: bool = True) -> Object:
        kind = "application/merge-patch+json" if merge else "application/strategic-merge-patch+json"
        return _checked(
            self._http.patch(path, content=json.dumps(body), headers={"Content-Type": kind}), f"PATCH {path}"
        )

    def delete(self, path: str, *, propagation: str = "Background", missing_ok: bool = False) -> Object | None:
        response = self._http.request(
            "DELETE", path, json={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        )
        if response.status_code == 404 and missing_ok:
            return None
        return _checked(response, f"DELETE {path}")

    def create_namespace(self, prefix: str, *, timeout: float = 60) -> str:
        """A fresh ``<prefix>-<random>`` namespace whose default ServiceAccount exists already
        (so pods can be created at once: ServiceAccount admission otherwise races the controller)."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        self.wait(
            f"/api/v1/namespaces/{name}/serviceaccounts/default",
            lambda sa: sa is not None,
            timeout=timeout,
            what=f"the default ServiceAccount in {name}",
        )
        return name

    def install_crd(self, definition: Object, *, timeout: float = 60) -> None:
        """Create a CustomResourceDefinition unless it exists, and wait until it is Established."""
        collection = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        url = f"{collection}/{definition['metadata']['name']}"
        if self.get(url) is None:
            self.create(collection, definition)
        self.wait(
            url,
            lambda obj: (condition(obj, "Established") or {}).get("status") == "True",
            timeout=timeout,
            what=f"CRD {definition['metadata']['name']} established",
        )

    # -- watching ------------------------------------------------------------------------------

    def wait(self, path: str, predicate: Predicate, *, timeout: float, what: str | None = None) -> Object | None:
        """Watch the object at ``path`` until ``predicate`` holds; the predicate sees ``None`` once it is gone.

        Lists first (so the current state counts), then watches from that resourceVersion; a watch
        that ends or expires is resumed from a fresh list. Returns the object that satisfied it.
        """
        collection, _, name = path.rpartition("/")
        description = what or path
        deadline = time.monotonic() + timeout
        last: Object | None = None
        while True:
            try:
                listing = self.list(collection, field_selector=f"metadata.name={name}")
            except KubeError as error:
                # 429 "storage is (re)initializing": the API server rebuilds a resource's watch cache
                # after its CRD changed (the chart installs CRDs) and asks to retry after a second
                if error.status != 429 or time.monotonic() + RETRY_AFTER_SECONDS >= deadline:
                    raise
                time.sleep(RETRY_AFTER_SECONDS)
                continue
            last = listing["items"][0] if listing["items"] else None
            if predicate(last):
                return last
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(description, timeout, last)
            for event_type, obj in self._watch(collection, name, listing["metadata"]["resourceVersion"], remaining):
                last = None if event_type == "DELETED" else obj
                if predicate(last):
                    return last
            if time.monotonic() >= deadline:
                raise WaitTimeout(description, timeout, last)

    def wait_items(
        self,
        collection: str,
        predicate: Callable[[Events], bool],
        *,
        timeout: float,
        field_selector: str | None = None,
        what: str | None = None,
    ) -> Events:
        """Watch a collection until ``predicate`` holds for its items (re-listing after each change)."""
        deadline = time.monotonic() + timeout
        while True:
            listing = self.list(collection, field_selector=field_selector)
            if predicate(listing["items"]):
                return list(listing["items"])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(what or collection, timeout, {"status": [brief(i) for i in listing["items"]]})
            params = {
                "watch": "1",
                "resourceVersion": listing["metadata"]["resourceVersion"],
                "timeoutSeconds": str(max(1, int(remaining))),
            }
            if field_selector:
                params["fieldSelector"] = field_selector
            http_timeout = httpx.Timeout(30.0, read=remaining + 5.0)
            with self._http.stream("GET", collection, params=params, timeout=http_timeout) as response:
                for line in response.iter_lines():
                    if line:
                        break  # something changed: list again

    def history(self, collection: str, *, since: str, window_seconds: int = 2) -> Events:
        """Every watch event of ``collection`` after resourceVersion ``since``, in API-server order
        (the server ends the watch after ``window_seconds`` without further events to wait for)."""
        params = {"watch": "1", "resourceVersion": since, "timeoutSeconds": str(window_seconds)}
        events: Events = []
        with self._http.stream("GET", collection, params=params, timeout=httpx.Timeout(30.0)) as response:
            if response.status_code != 200:
                raise KubeError(response.status_code, response.read().decode(), f"WATCH {collection}")
            for line in response.iter_lines():
                if line:
                    events.append(json.loads(line))
        return events

    def _watch(
        self, collection: str, name: str, resource_version: str, remaining: float
    ) -> Iterator[tuple[str, Object]]:
        params = {
            "watch": "1",
            "fieldSelector": f"metadata.name={name}",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(max(1, int(remaining))),
            "allowWatchBookmarks": "false",
        }
        timeout = httpx.Timeout(30.0, read=remaining + 5.0)
        with self._http.stream("GET", collection, params=params, timeout=timeout) as response:
            if response.status_code != 200:
                return  # e.g. 410 Gone: the caller lists again
            for line in response.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    return
                yield event["type"], event["object"]


def _checked(response: httpx.Response, what: str) -> Object:
    if response.status_code >= 400:
        raise KubeError(response.status_code, response.text, what)
    result: Object = response.json()
    return result


def condition(obj: Object | None, kind: str) -> Object | None:
    """The status condition of type ``kind``, if the object has one."""
    if obj is None:
        return None
    for item in obj.get("status", {}).get("conditions", []) or []:
        if item.get("type") == kind:
            return dict(item)
    return None
