"""The operator's transport to the API server: its REST paths over one aiohttp session.

Used by :class:`megafleet.kube.Api` (nothing else calls it). The login is the one lightkube reads
from the environment (the pod's service account, else ``$KUBECONFIG`` or ``~/.kube/config``): the
cluster's address and CA, a client certificate, a bearer token or token file (read again every
minute and on a 401, as the kubelet rotates it), or a user name and password. A kubeconfig whose
user logs in through an exec plugin or an auth provider is not handled here
(:func:`from_environment` returns None and :class:`~megafleet.kube.Api` uses lightkube instead).

Why not lightkube for everything: at a thousand pods the operator makes a few thousand requests
in a burst, on a machine whose CPU is the API server's too. Through :class:`megafleet.kube.Api`,
lightkube over httpx spent 0.75-1.0 ms of the operator's CPU per request against 0.19-0.26 ms
here (``bench/api_client.py``, ``bench/results/api-client-cpu2-2026-12-02.json``). aiohttp is
Kopf's own HTTP client, so this adds no dependency.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import User
from lightkube.core import exceptions as lightkube_errors
from lightkube.core import resource as lightkube_resource
from lightkube.core.selector import build_selector
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import ConfigMap, Node, Pod, Secret, Service, ServiceAccount
from lightkube.resources.scheduling_v1 import PriorityClass

from megafleet.api import v1alpha1
from megafleet.objects import Object

__all__ = ["KINDS", "RESOURCES", "ApiError", "Resource", "RestTransport", "Selector", "from_config", "from_environment"]

Selector = dict[str, Any]
"""Labels or fields to select by, in lightkube's notation: a value, or an operator of ``lightkube.operators``."""

TOKEN_REREAD_SECONDS = 60.0
"""A token file is read again this often (and at once on a 401): projected service-account tokens
are rotated by the kubelet."""
PAGE_SIZE = 500
"""Objects per page of a LIST (``limit``/``continue``)."""
TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=60)
WATCH_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=None)
"""A watch stays open until the API server ends it (its own watch timeout) and may be quiet for long."""


class ApiError(Exception):
    """The API server answered a request with an error status."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message or reason or f"HTTP {code}")
        self.code, self.reason, self.message = code, reason, message


MegatronGeneration = create_namespaced_resource(
    v1alpha1.GROUP, v1alpha1.VERSION, "MegatronGeneration", "megatrongenerations"
)
Refit = create_namespaced_resource(v1alpha1.GROUP, v1alpha1.VERSION, "Refit", "refits")
RefitSession = create_namespaced_resource(v1alpha1.GROUP, v1alpha1.VERSION, "RefitSession", "refitsessions")
# NVIDIA's DRA driver's IMEX domain, one per shard spanning nodes (megafleet.compute_domain).
ComputeDomain = create_namespaced_resource("resource.nvidia.com", "v1beta1", "ComputeDomain", "computedomains")
# Kueue's Workload of a shard's pod group (why a shard waits; deleted to end the group: megafleet.reconcile.admission).
Workload = create_namespaced_resource("kueue.x-k8s.io", "v1beta2", "Workload", "workloads")

KINDS: dict[str, Any] = {
    "Pod": Pod,
    "Service": Service,
    "ConfigMap": ConfigMap,
    "Secret": Secret,
    "ServiceAccount": ServiceAccount,
    "PriorityClass": PriorityClass,
    "Node": Node,
    "MegatronGeneration": MegatronGeneration,
    "Refit": Refit,
    "RefitSession": RefitSession,
    "ComputeDomain": ComputeDomain,
    "Workload": Workload,
}
"""The kinds the operator reads and writes, as lightkube's resource classes (the lightkube transport
of :mod:`megafleet.kube` takes them; :data:`RESOURCES` is derived from them)."""


@dataclasses.dataclass(frozen=True)
class Resource:
    """Where the objects of one kind live in the API."""

    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool

    @classmethod
    def of(cls, resource: Any) -> Resource:
        """The paths of a lightkube resource class."""
        info = lightkube_resource.api_info(resource)
        namespaced = issubclass(resource, lightkube_resource.NamespacedResource)
        return cls(info.resource.group, info.resource.version, info.plural, namespaced)

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The collection's path (``name`` None), or the object's, or its subresource's."""
        parts = ["/api/v1" if not self.group else f"/apis/{self.group}/{self.version}"]
        if self.namespaced and namespace is not None:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name is not None:
            parts.append(name)
            if subresource is not None:
                parts.append(subresource)
        return "/".join(parts)


RESOURCES: dict[str, Resource] = {kind: Resource.of(resource) for kind, resource in KINDS.items()}


class _Credentials:
    """The ``Authorization`` header of the login, a token file's read again when due."""

    def __init__(self, user: User) -> None:
        self._token_file = user.token_file
        self._fixed: str | None = None
        if user.token is not None:
            self._fixed = f"Bearer {user.token}"
        elif user.username and user.password:
            pair = base64.b64encode(f"{user.username}:{user.password}".encode()).decode()
            self._fixed = f"Basic {pair}"
        self._read: tuple[float, str] | None = None

    def header(self) -> str | None:
        if self._token_file is None:
            return self._fixed
        if self._read is None or time.monotonic() - self._read[0] > TOKEN_REREAD_SECONDS:
            self.refresh()
        return self._read[1] if self._read is not None else None

    def refresh(self) -> bool:
        """Read the token file again; True when there is one (a 401 is then retried once)."""
        if self._token_file is None:
            return False
        self._read = (time.monotonic(), f"Bearer {Path(self._token_file).read_text().strip()}")
        return True


class RestTransport:
    """Requests to one API server (see the module docstring); the session is made on first use, on
    the running event loop."""

    def __init__(
        self,
        server: str,
        *,
        ssl_context: ssl.SSLContext | None,
        credentials: _Credentials,
        field_manager: str,
        user_agent: str,
        connections: int,
        proxy: str | None = None,
    ) -> None:
        self._server = server.rstrip("/")
        self._proxy = proxy
        self._ssl = ssl_context
        self._credentials = credentials
        self._field_manager = field_manager
        self._user_agent = user_agent
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._connections, ssl=self._ssl if self._ssl is not None else False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=TIMEOUT, trust_env=False)
        return self._session

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"User-Agent": self._user_agent, "Accept": "application/json"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        authorization = self._credentials.header()
        if authorization is not None:
            headers["Authorization"] = authorization
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Object | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """The decoded answer to one request; :class:`ApiError` for an error status."""
        session = self._client()
        data = msgspec.json.encode(body) if body is not None else None
        for attempt in (1, 2):
            headers = self._headers(content_type if data is not None else None)
            async with session.request(
                method, self._server + path, params=params, data=data, headers=headers, proxy=self._proxy
            ) as response:
                content = await response.read()
                if response.status == 401 and attempt == 1 and self._credentials.refresh():
                    continue
                if response.status >= 400:
                    raise _error(response.status, content)
                return msgspec.json.decode(content) if content else None
        raise AssertionError("unreachable")  # pragma: no cover

    async def get(self, kind: str, name: str, namespace: str | None) -> Object:
        found: Object = await self.request("GET", RESOURCES[kind].path(namespace, name))
        return found

    async def list(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> list[Object]:
        """Every object of ``kind`` (in ``namespace``, or all namespaces with None) that the selectors
        choose, page by page."""
        items: list[Object] = []
        params: dict[str, str] = {"limit": str(PAGE_SIZE)}
        if labels:
            params["labelSelector"] = build_selector(labels)
        if fields:
            params["fieldSelector"] = build_selector(fields, for_fields=True)
        resource = RESOURCES[kind]
        while True:
            page = await self.request("GET", resource.path(namespace), params=params)
            for item in page.get("items") or []:  # a list's items carry neither kind nor apiVersion
                item.setdefault("kind", kind)
                item.setdefault("apiVersion", page.get("apiVersion", "v1"))
                items.append(item)
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
            params["continue"] = token

    async def watch(
        self, kind: str, namespace: str | None, *, labels: Selector | None = None, fields: Selector | None = None
    ) -> AsyncGenerator[tuple[str, Object], None]:
        """The objects the selectors choose as they are now (``ADDED``), then every change, without
        end: a stream the server ends (its watch timeout) is started again from the last object's
        resource version, as lightkube's watch does. An ``ERROR`` event (410: that version is gone)
        is raised as :class:`ApiError`."""
        params: dict[str, str] = {"watch": "true"}
        if labels:
            params["labelSelector"] = build_selector(labels)
        if fields:
            params["fieldSelector"] = build_selector(fields, for_fields=True)
        path = RESOURCES[kind].path(namespace)
        while True:
            async with contextlib.aclosing(self._stream(path, params)) as events:
                async for event, obj in events:
                    version = (obj.get("metadata") or {}).get("resourceVersion")
                    if version:
                        params["resourceVersion"] = version
                    yield event, obj

    async def _stream(self, path: str, params: Mapping[str, str]) -> AsyncGenerator[tuple[str, Object], None]:
        """The events of one watch request, until the API server ends it."""
        session = self._client()
        for attempt in (1, 2):
            async with session.request(
                "GET",
                self._server + path,
                params=params,
                headers=self._headers(None),
                proxy=self._proxy,
                timeout=WATCH_TIMEOUT,
            ) as response:
                if response.status >= 400:
                    content = await response.read()
                    if response.status == 401 and attempt == 1 and self._credentials.refresh():
                        continue
                    raise _error(response.status, content)
                pending = b""
                try:
                    async for chunk in response.content.iter_any():  # one event a line; a line may be long
                        pending += chunk
                        if b"\n" not in chunk:
                            continue
                        *lines, pending = pending.split(b"\n")
                        for line in lines:
                            if line.strip():
                                yield _event(line)
                finally:
                    if not response.content.at_eof():
                        _abort(response)
                return

    async def create(self, obj: Object) -> Object:
        metadata = obj["metadata"]
        path = RESOURCES[obj["kind"]].path(metadata.get("namespace"))
        created: Object = await self.request("POST", path, params={"fieldManager": self._field_manager}, body=obj)
        return created

    async def delete(self, kind: str, name: str, namespace: str | None, grace_seconds: int | None) -> None:
        params = {"gracePeriodSeconds": str(grace_seconds)} if grace_seconds is not None else None
        await self.request("DELETE", RESOURCES[kind].path(namespace, name), params=params)

    async def patch(
        self, kind: str, name: str, namespace: str | None, patch: Object, *, subresource: str | None = None
    ) -> Object:
        """A JSON merge patch (lists are replaced whole) of the object or its ``subresource``."""
        patched: Object = await self.request(
            "PATCH",
            RESOURCES[kind].path(namespace, name, subresource),
            params={"fieldManager": self._field_manager},
            body=patch,
            content_type="application/merge-patch+json",
        )
        return patched


def _abort(response: aiohttp.ClientResponse) -> None:
    """Drop the connection of a watch its caller left mid-stream (it can never be reused) at once:
    releasing it would close TLS politely, a round trip the event loop may not live to finish (a
    caller's ``asyncio.run`` ends), leaving its socket open until the garbage collector finds it."""
    connection = response.connection
    if connection is not None and connection.transport is not None:
        connection.transport.abort()


def _event(line: bytes) -> tuple[str, Object]:
    """One line of a watch stream: its event type and object; an ``ERROR`` event is raised."""
    event = msgspec.json.decode(line)
    obj: Object = event.get("object") or {}
    if event.get("type") == "ERROR":
        raise ApiError(int(obj.get("code") or 0), str(obj.get("reason") or ""), str(obj.get("message") or ""))
    return str(event["type"]), obj


def _error(status: int, content: bytes) -> ApiError:
    try:
        body = msgspec.json.decode(content) if content else {}
    except msgspec.DecodeError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    return ApiError(
        status, str(body.get("reason") or ""), str(body.get("message") or content[:200].decode(errors="replace"))
    )


def from_config(config: SingleConfig, *, field_manager: str, user_agent: str, connections: int) -> RestTransport | None:
    """The transport for ``config``'s cluster and user; None for a login it does not handle (an exec
    plugin or an auth provider)."""
    user = config.user or User()
    if user.exec is not None or user.auth_provider is not None:
        return None
    server = config.cluster.server
    ssl_context = (
        client_adapter.verify_cluster(config.cluster, user, config.abs_file) if server.startswith("https") else None
    )
    return RestTransport(
        server,
        proxy=proxy_for(server),
        ssl_context=ssl_context,
        credentials=_Credentials(user),
        field_manager=field_manager,
        user_agent=user_agent,
        connections=connections,
    )


def proxy_for(server: str) -> str | None:
    """The proxy the environment names for ``server`` (``HTTPS_PROXY``/``HTTP_PROXY``, unless
    ``NO_PROXY`` exempts its host), found once: aiohttp's own lookup (``trust_env``) reads the
    environment and ``~/.netrc`` at every request, which cost 0.3 ms of CPU each."""
    parts = urllib.parse.urlsplit(server)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)


def from_environment(*, field_manager: str, user_agent: str, connections: int) -> RestTransport | None:
    """:func:`from_config` for the login lightkube finds (service account, ``$KUBECONFIG``,
    ``~/.kube/config``); None when it finds none, or one handled only by lightkube."""
    try:
        config = KubeConfig.from_env().get()
    except lightkube_errors.ConfigError:
        return None
    if config is None:
        return None
    return from_config(config, field_manager=field_manager, user_agent=user_agent, connections=connections)
