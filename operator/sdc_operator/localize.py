"""Node -> EC2 instance id: ``spec.providerID``, else the HyperPod node name
(``hyperpod-i-...``), else SageMaker ``ListClusterNodes`` matched on the private DNS name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from .names import HYPERPOD_CLUSTER_LABEL
from .nodes import instance_id_from_node_name, instance_id_from_provider_id

__all__ = ["InstanceResolver", "private_dns_names"]

log = logging.getLogger(__name__)


def private_dns_names(node: dict[str, Any]) -> set[str]:
    """Every name the node may be known by in EC2 (its name, hostname, InternalDNS)."""
    meta = node.get("metadata") or {}
    names = {str(meta.get("name") or "")}
    hostname = (meta.get("labels") or {}).get("kubernetes.io/hostname")
    if hostname:
        names.add(str(hostname))
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") in ("InternalDNS", "Hostname") and address.get("address"):
            names.add(str(address["address"]))
    return {n for n in names if n}


class InstanceResolver:
    def __init__(
        self,
        sagemaker: Callable[[], Any],
        cluster_name: str | None = None,
        cache_seconds: float = 300.0,
    ) -> None:
        """``sagemaker``: builds a boto3 SageMaker client, called at most once, lazily."""
        self._make_client = sagemaker
        self._client: Any = None
        self._cluster_name = cluster_name
        self._cache_seconds = cache_seconds
        self._by_dns: dict[str, tuple[float, dict[str, str]]] = {}

    async def instance_id(self, node: dict[str, Any]) -> tuple[str | None, str]:
        """``(instance id or None, how it was found or why not)``."""
        found = instance_id_from_provider_id((node.get("spec") or {}).get("providerID"))
        if found:
            return found, "spec.providerID"
        name = (node.get("metadata") or {}).get("name")
        found = instance_id_from_node_name(name)
        if found:
            return found, "node name"
        labels = (node.get("metadata") or {}).get("labels") or {}
        cluster = labels.get(HYPERPOD_CLUSTER_LABEL) or self._cluster_name
        if not cluster:
            return None, (
                f"no providerID, not a hyperpod-i-... name, no {HYPERPOD_CLUSTER_LABEL} label "
                "and no HYPERPOD_SDC_CLUSTER_NAME: cannot ask ListClusterNodes"
            )
        try:
            by_dns = await self._cluster_nodes(cluster)
        except Exception as exc:  # boto3 errors are many; the incident records the reason
            log.warning("ListClusterNodes for %s failed: %s", cluster, exc)
            return None, f"ListClusterNodes({cluster}) failed: {exc}"
        for dns in sorted(private_dns_names(node)):
            if dns in by_dns:
                return by_dns[dns], f"ListClusterNodes({cluster})"
        return None, f"no node of cluster {cluster} has private DNS name {name}"

    async def _cluster_nodes(self, cluster: str) -> dict[str, str]:
        now = time.monotonic()
        cached = self._by_dns.get(cluster)
        if cached is not None and cached[0] > now:
            return cached[1]
        by_dns = await asyncio.to_thread(self._list, cluster)
        self._by_dns[cluster] = (now + self._cache_seconds, by_dns)
        return by_dns

    def _list(self, cluster: str) -> dict[str, str]:
        if self._client is None:
            self._client = self._make_client()
        by_dns: dict[str, str] = {}
        for page in self._client.get_paginator("list_cluster_nodes").paginate(ClusterName=cluster):
            for node in page.get("ClusterNodeSummaries") or []:
                dns = node.get("PrivateDnsHostname")
                if dns and node.get("InstanceId"):
                    by_dns[dns] = node["InstanceId"]
                    by_dns[dns.split(".", 1)[0]] = node["InstanceId"]
        return by_dns
