"""The API server's own addresses, for the admission listener's reserve (:mod:`.listeners`).

The API server publishes where it serves in the Endpoints ``default/kubernetes`` (one
address per API server; on EKS its cross-account network interfaces in the cluster's VPC,
through which it also calls webhooks). Nothing a tenant does changes that object, so a
connection from one of these addresses may use the connections the admission listener
keeps in reserve, and is not counted against the per-source limit.

It is only a priority, never a gate: an API server that calls from an address it does not
publish (a second network interface, a NAT) is an ordinary source, limited like any other
(``HYPERPOD_SDC_API_SERVER_ADDRESSES`` names such addresses), and reviews are never refused
for their address. Unreadable (RBAC of an older chart, the API
server down), the addresses last read are kept; none read, the reserve is idle.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

from .errors import ApiError
from .kube import Kube

__all__ = ["ApiServerAddresses", "published_addresses"]

log = logging.getLogger(__name__)


def published_addresses(endpoints: dict[str, Any]) -> frozenset[str]:
    """The addresses an Endpoints object lists, each also as an IPv4-mapped IPv6 address
    (what a dual-stack listener sees as the peer)."""
    return _with_mapped(
        str((address or {}).get("ip") or "")
        for subset in endpoints.get("subsets") or []
        for address in (subset or {}).get("addresses") or []
    )


def _with_mapped(addresses: Iterable[str]) -> frozenset[str]:
    found: set[str] = set()
    for ip in addresses:
        try:
            parsed = ipaddress.ip_address(ip)
        except ValueError:
            continue
        found.add(str(parsed))
        if parsed.version == 4:
            found.add(f"::ffff:{parsed}")
    return frozenset(found)


class ApiServerAddresses:
    """A callable giving the addresses last read; :meth:`refresh` reads them again."""

    def __init__(self, kube: Kube, configured: tuple[str, ...] = ()) -> None:
        self.kube = kube
        self.configured = _with_mapped(configured)
        """``HYPERPOD_SDC_API_SERVER_ADDRESSES``: kept whatever is published."""
        self.addresses: frozenset[str] = self.configured
        self._warned = False

    def __call__(self) -> frozenset[str]:
        return self.addresses

    async def refresh(self) -> None:
        try:
            endpoints = await self.kube.get("v1", "endpoints", "default", "kubernetes")
        except ApiError as exc:
            if not self._warned:
                log.warning(
                    "cannot read the API server's addresses (Endpoints default/kubernetes: "
                    "%s): the admission listener keeps no connections in reserve for it",
                    exc,
                )
                self._warned = True
            return
        found = published_addresses(endpoints) | self.configured
        if found != self.addresses:
            log.info(
                "the API server's addresses (admission reserve): %s",
                ", ".join(sorted(a for a in found if not a.startswith("::ffff:"))) or "none",
            )
        self.addresses = found
