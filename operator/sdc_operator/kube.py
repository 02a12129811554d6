"""The operator's calls to the Kubernetes API, async over the official (blocking) client.

Each call runs in a worker thread; the event loop (kopf's, the intake's) never blocks.
Objects come back as plain dicts, as the API server sends them, so the pure modules work
on exactly what a ``kubectl get -o json`` shows.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from .incidents import now_iso
from .names import GROUP, INCIDENT_PLURAL, VERSION

__all__ = ["ApiException", "Kube", "is_conflict", "is_not_found", "load_config"]

T = TypeVar("T")
COMPONENT = "hyperpod-sdc-operator"
# The client would send a dict body as a JSON patch; every patch here is a merge patch.
MERGE_PATCH = "application/merge-patch+json"


def load_config() -> None:
    """In-cluster credentials where they exist, else the kubeconfig (``KUBECONFIG``)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


def _split(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


class Kube:
    """What the operator reads and writes, and nothing more (the chart's ClusterRole
    grants exactly these verbs)."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.authn = client.AuthenticationV1Api(self.api)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _raw(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Call without the client's model classes: the JSON as the server sent it."""
        response = await self._call(fn, *args, _preload_content=False, **kwargs)
        try:
            return dict(json.loads(response.data))
        finally:
            response.release_conn()

    # -- authentication ------------------------------------------------------------------

    async def token_review(self, token: str, audience: str) -> dict[str, Any]:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        review = await self._raw(self.authn.create_token_review, body)
        return dict(review.get("status") or {})

    # -- pods, nodes ---------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._raw(self.core.read_namespaced_pod, name, namespace)

    async def list_pods(self, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
        pods = await self._raw(
            self.core.list_namespaced_pod, namespace, label_selector=label_selector
        )
        return list(pods.get("items") or [])

    async def get_node(self, name: str) -> dict[str, Any]:
        return await self._raw(self.core.read_node, name)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self._raw(self.core.patch_node, name, patch, _content_type=MERGE_PATCH)

    async def list_nodes(self, label_selector: str = "") -> list[dict[str, Any]]:
        nodes = await self._raw(self.core.list_node, label_selector=label_selector)
        return list(nodes.get("items") or [])

    # -- custom objects (jobs, workloads, incidents) ----------------------------------------

    async def get_object(
        self, api_version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any]:
        group, version = _split(api_version)
        return await self._raw(
            self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
        )

    async def list_objects(
        self,
        api_version: str,
        plural: str,
        namespace: str | None = None,
        label_selector: str = "",
    ) -> list[dict[str, Any]]:
        group, version = _split(api_version)
        if namespace is None:
            found = await self._raw(
                self.custom.list_cluster_custom_object,
                group,
                version,
                plural,
                label_selector=label_selector,
            )
        else:
            found = await self._raw(
                self.custom.list_namespaced_custom_object,
                group,
                version,
                namespace,
                plural,
                label_selector=label_selector,
            )
        return list(found.get("items") or [])

    async def patch_object(
        self, api_version: str, plural: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        group, version = _split(api_version)
        return await self._raw(
            self.custom.patch_namespaced_custom_object,
            group,
            version,
            namespace,
            plural,
            name,
            patch,
            _content_type=MERGE_PATCH,
        )

    async def get_incident(self, namespace: str, name: str) -> dict[str, Any]:
        return await self.get_object(f"{GROUP}/{VERSION}", INCIDENT_PLURAL, namespace, name)

    async def list_incidents(
        self, namespace: str | None = None, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        return await self.list_objects(
            f"{GROUP}/{VERSION}", INCIDENT_PLURAL, namespace, label_selector
        )

    async def create_incident(self, body: dict[str, Any]) -> dict[str, Any]:
        namespace = body["metadata"]["namespace"]
        return await self._raw(
            self.custom.create_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            INCIDENT_PLURAL,
            body,
        )

    async def replace_incident_status(self, incident: dict[str, Any]) -> dict[str, Any]:
        """Write ``incident["status"]``; fails with 409 if the object changed since it was
        read (its ``resourceVersion`` travels with it)."""
        meta = incident["metadata"]
        return await self._raw(
            self.custom.replace_namespaced_custom_object_status,
            GROUP,
            VERSION,
            meta["namespace"],
            INCIDENT_PLURAL,
            meta["name"],
            incident,
        )

    # -- events --------------------------------------------------------------------------

    async def emit_event(
        self, obj: dict[str, Any], reason: str, message: str, *, warning: bool = True
    ) -> None:
        """A core/v1 Event on ``obj`` (shown by ``kubectl describe``). Node events go to
        the ``default`` namespace, as the kubelet's do."""
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = now_iso()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name', 'object')}.{secrets.token_hex(8)}",
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
        await self._call(self.core.create_namespaced_event, namespace, body)

    def close(self) -> None:
        self.api.close()
