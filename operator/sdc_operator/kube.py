"""The operator's calls to the Kubernetes API: plain REST over aiohttp, objects as dicts.

Each :class:`Kube` is one client with its own connection pool, so the parts of the
operator never queue behind each other: the leader election renews its Lease on one,
containment (suspend, quarantine, resume, remediate) runs on another, the intake's few
calls (TokenReview, a pod the watch has not delivered yet) on a third, the incident
records on a fourth, and the watches (:mod:`.informer`) on their own. No thread pool is
involved, and a response is parsed on the event loop only when it is small (a large one,
a page of a LIST, is parsed in a worker thread).

It knows nothing of incidents' meaning (it imports only errors and names). Objects come
back exactly as the API server sends them (what ``kubectl get -o json``
shows), so the pure modules work on the same dicts in tests and in production. Credentials
come from the official client's loaders (in-cluster ServiceAccount, else the kubeconfig),
re-read through its refresh hook, so a rotated token is picked up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from .errors import ApiError
from .names import FIELD_MANAGER, GROUP, INCIDENT_PLURAL, VERSION
from .times import now_iso

__all__ = [
    "COMPONENT",
    "Endpoint",
    "Kube",
    "is_conflict",
    "is_gone",
    "is_not_found",
    "object_path",
]

log = logging.getLogger(__name__)

COMPONENT = "hyperpod-sdc-operator"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
INCIDENTS = f"{GROUP}/{VERSION}"
_PARSE_IN_THREAD_BYTES = 256 * 1024
"""Responses larger than this (a page of a LIST) are parsed off the event loop."""
_WATCH_LINE_LIMIT = 8 * 1024 * 1024


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status == 404


def is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiError) and exc.status == 409


def is_gone(exc: BaseException) -> bool:
    """A watch or a LIST continue token older than what etcd keeps: list again."""
    return isinstance(exc, ApiError) and exc.status == 410


def object_path(
    api_version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """``/api/v1/namespaces/ns/pods/name`` and the like (core group under ``/api``)."""
    parts = ["/api/v1" if api_version == "v1" else f"/apis/{api_version}"]
    if namespace:
        parts += ["namespaces", quote(namespace, safe="")]
    parts.append(plural)
    if name:
        parts.append(quote(name, safe=""))
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


@dataclass
class Endpoint:
    """Where the API server is and how to prove who we are, from the official client's
    configuration (:meth:`load`)."""

    host: str
    ssl_context: ssl.SSLContext | bool
    configuration: Any = None
    """A ``kubernetes.client.Configuration``: its refresh hook renews the token."""

    @classmethod
    def load(cls, kubeconfig: str | None = None) -> Endpoint:
        """In-cluster credentials where they exist, else the kubeconfig (``kubeconfig``,
        default ``KUBECONFIG``)."""
        from kubernetes import client, config

        try:
            if kubeconfig:
                raise config.ConfigException("a kubeconfig is given")
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"))
        conf = client.Configuration.get_default_copy()
        if conf.verify_ssl:
            context = ssl.create_default_context(cafile=conf.ssl_ca_cert or None)
        else:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if conf.cert_file:
            context.load_cert_chain(conf.cert_file, conf.key_file)
        return cls(conf.host.rstrip("/"), context, conf)

    def headers(self) -> dict[str, str]:
        conf = self.configuration
        if conf is None:
            return {}
        headers = {}
        # auth_settings() runs the client's refresh hook: a rotated token is picked up.
        for setting in conf.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[str(setting["key"]).title()] = str(setting["value"])
        return headers


WARM_SECONDS = 10.0
"""How often a pool kept warm (:meth:`Kube.keep_warm`) asks the API server something: within
the client's keep-alive (aiohttp's 15 s) and the API server's idle timeout (90 s), so that
one connection stays open."""


class Kube:
    """One API client with its own connection pool (``pool_size`` connections)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        name: str,
        pool_size: int = 8,
        timeout_seconds: float = 30.0,
        metrics: Any = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.pool_size = pool_size
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds, connect=10)
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self._warm: asyncio.Task[None] | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.pool_size, ssl=self.endpoint.ssl_context, enable_cleanup_closed=True
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, json_serialize=json.dumps
            )
        return self._session

    def _count(self, verb: str, resource: str, code: int) -> None:
        if self.metrics is not None:
            self.metrics.api_requests.labels(self.name, verb, resource, str(code)).inc()

    async def request(
        self,
        method: str,
        path: str,
        *,
        resource: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call; the JSON answer, or :class:`ApiError` (status 0: unreachable)."""
        headers = self.endpoint.headers()
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        headers["Accept"] = "application/json"
        verb = method.lower()
        if method in ("POST", "PUT", "PATCH"):
            params = {**(params or {}), "fieldManager": FIELD_MANAGER}
        try:
            async with self._http().request(
                method, self.endpoint.host + path, params=params, data=data, headers=headers
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._count(verb, resource, 0)
            raise ApiError(0, f"{method} {path}: {type(exc).__name__}: {exc}") from None
        self._count(verb, resource, status)
        parsed = await _parse(raw) if raw else {}
        if status >= 400:
            message = str(parsed.get("message") or raw[:300].decode("utf-8", "replace"))
            raise ApiError(status, f"{method} {path}: {message}", parsed)
        return parsed

    async def stream(
        self, path: str, *, resource: str, params: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (``watch=1``), one dict per line, until the server ends
        it; raises :class:`ApiError` for an answer that is not a stream."""
        headers = {**self.endpoint.headers(), "Accept": "application/json"}
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10, sock_read=float(params.get("timeoutSeconds", "300")) + 30
        )
        try:
            async with self._http().get(
                self.endpoint.host + path,
                params={**params, "watch": "1"},
                headers=headers,
                timeout=timeout,
            ) as response:
                self._count("watch", resource, response.status)
                if response.status >= 400:
                    raw = await response.read()
                    parsed = await _parse(raw) if raw else {}
                    raise ApiError(
                        response.status, f"watch {path}: {parsed.get('message', '')}", parsed
                    )
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    if len(buffer) > _WATCH_LINE_LIMIT:
                        raise ApiError(0, f"watch {path}: an event over {_WATCH_LINE_LIMIT} bytes")
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._count("watch", resource, 0)
            raise ApiError(0, f"watch {path}: {type(exc).__name__}: {exc}") from None

    def keep_warm(self, every: float = WARM_SECONDS) -> None:
        """(On the loop this client serves.) Keep a connection of the pool open until
        :meth:`close`: ``GET /version`` (the API server's cheapest answer, which every
        client may read) every ``every`` seconds. For the pools whose calls are rare and
        urgent (the engine's): the first call of an incident, after hours without one,
        would otherwise open a connection and wait for its TLS handshake with the API
        server in containment's path (at 2,048 nodes under a heartbeat burst: the
        incident's creation 145 ms, traced, against 48 ms for the next call on the
        connection it opened). A failed ask is not retried before the next."""
        if self._warm is None or self._warm.done():
            self._warm = asyncio.get_running_loop().create_task(self._keep_warm(every))

    async def _keep_warm(self, every: float) -> None:
        while True:
            try:
                await self.request("GET", "/version", resource="version")
            except ApiError as exc:
                log.debug("%s: keeping a connection warm: %s", self.name, exc)
            except Exception:  # the asks go on: a courtesy never ends the pool's warmth
                log.warning("%s: keeping a connection warm failed", self.name, exc_info=True)
            await asyncio.sleep(every)

    async def close(self) -> None:
        if self._warm is not None:
            self._warm.cancel()
            await asyncio.gather(self._warm, return_exceptions=True)
            self._warm = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- generic verbs -------------------------------------------------------------------

    async def get(
        self, api_version: str, plural: str, namespace: str | None, name: str
    ) -> dict[str, Any]:
        return await self.request(
            "GET", object_path(api_version, plural, namespace, name), resource=plural
        )

    async def list_page(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        limit: int = 500,
        continue_token: str = "",
    ) -> dict[str, Any]:
        """One page of a LIST (``items``, ``metadata.continue``, ``resourceVersion``)."""
        params = {"limit": str(limit)}
        if label_selector:
            params["labelSelector"] = label_selector
        if continue_token:
            params["continue"] = continue_token
        return await self.request(
            "GET", object_path(api_version, plural, namespace), resource=plural, params=params
        )

    async def list_all(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
    ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            page = await self.list_page(
                api_version, plural, namespace, label_selector=label_selector, continue_token=token
            )
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    async def create(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        body: dict[str, Any],
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Create ``body``; with ``dry_run``, only what the API server would store (its
        defaults and admission applied), nothing stored."""
        return await self.request(
            "POST",
            object_path(api_version, plural, namespace),
            resource=plural,
            body=body,
            params={"dryRun": "All"} if dry_run else None,
        )

    async def replace(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        body: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """PUT: fails with 409 if the object changed since ``body`` was read (its
        ``metadata.resourceVersion`` is the precondition)."""
        name = body["metadata"]["name"]
        return await self.request(
            "PUT",
            object_path(api_version, plural, namespace, name, subresource),
            resource=f"{plural}/{subresource}" if subresource else plural,
            body=body,
        )

    async def patch(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        content_type: str = MERGE_PATCH,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            object_path(api_version, plural, namespace, name, subresource),
            resource=plural,
            body=patch,
            content_type=content_type,
        )

    async def delete(
        self,
        api_version: str,
        plural: str,
        namespace: str | None,
        name: str,
        *,
        uid: str | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """DELETE with preconditions: nothing is deleted if the object was replaced
        (``uid``) or changed (``resource_version``) since it was read (409)."""
        preconditions = {}
        if uid:
            preconditions["uid"] = uid
        if resource_version:
            preconditions["resourceVersion"] = resource_version
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions}
        return await self.request(
            "DELETE", object_path(api_version, plural, namespace, name), resource=plural, body=body
        )

    # -- what the operator uses ------------------------------------------------------------

    async def token_review(self, token: str, audience: str) -> dict[str, Any]:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        review = await self.create("authentication.k8s.io/v1", "tokenreviews", None, body)
        return dict(review.get("status") or {})

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.get("v1", "pods", namespace, name)

    async def get_node(self, name: str) -> dict[str, Any]:
        return await self.get("v1", "nodes", None, name)

    async def patch_node(
        self, name: str, patch: Any, content_type: str = MERGE_PATCH
    ) -> dict[str, Any]:
        return await self.patch("v1", "nodes", None, name, patch, content_type=content_type)

    async def get_object(
        self, api_version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any]:
        return await self.get(api_version, plural, namespace, name)

    async def list_objects(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        label_selector: str = "",
    ) -> list[dict[str, Any]]:
        return await self.list_all(api_version, plural, namespace, label_selector=label_selector)

    async def patch_object(
        self, api_version: str, plural: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        return await self.patch(api_version, plural, namespace, name, patch)

    async def get_incident(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.get(INCIDENTS, INCIDENT_PLURAL, namespace, name)

    async def list_incidents(
        self, namespace: str | None = None, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        return await self.list_all(
            INCIDENTS, INCIDENT_PLURAL, namespace, label_selector=label_selector
        )

    async def create_incident(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.create(INCIDENTS, INCIDENT_PLURAL, body["metadata"]["namespace"], body)

    async def replace_incident_status(self, incident: dict[str, Any]) -> dict[str, Any]:
        """Write ``incident["status"]``; 409 if the object changed since it was read."""
        return await self.replace(
            INCIDENTS, INCIDENT_PLURAL, incident["metadata"]["namespace"], incident, "status"
        )

    async def delete_incident(self, incident: dict[str, Any]) -> dict[str, Any]:
        meta = incident["metadata"]
        return await self.delete(
            INCIDENTS,
            INCIDENT_PLURAL,
            meta["namespace"],
            meta["name"],
            uid=meta.get("uid"),
            resource_version=meta.get("resourceVersion"),
        )

    async def emit_event(
        self,
        obj: dict[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = True,
        name: str | None = None,
    ) -> dict[str, Any]:
        """A core/v1 Event on ``obj`` (shown by ``kubectl describe``), named ``name``
        (else a random name). Node events go to the ``default`` namespace, as the
        kubelet's do."""
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": name or f"{meta.get('name', 'object')}.{secrets.token_hex(8)}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", "v1"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return await self.create("v1", "events", namespace, body)


async def _parse(raw: bytes) -> dict[str, Any]:
    try:
        if len(raw) > _PARSE_IN_THREAD_BYTES:
            value = await asyncio.to_thread(json.loads, raw)
        else:
            value = json.loads(raw)
    except ValueError:
        return {"message": raw[:300].decode("utf-8", "replace")}
    return value if isinstance(value, dict) else {"items": value}
