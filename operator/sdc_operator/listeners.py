"""One listener per audience, each on its own port (docs/operator.md, "Threat model").

=============  =========================================  ==============================
listener       paths                                      who may reach it (chart)
=============  =========================================  ==============================
intake         ``POST /v1/reports``                       the tenants' namespaces
admission      ``POST /v1/admission/...``                 the API server
metrics        ``/metrics``, ``/healthz``, ``/readyz``    monitoring, the kubelet's probes
=============  =========================================  ==============================

A path is served on its own listener only: the tenants' port answers 404 to the admission
webhook and to ``/metrics`` (which names every opted-in job of every namespace). Each
listener does its own TLS handshakes, so a client that opens connections and never
finishes one is closed after ``tls_handshake_timeout_seconds``, and one address may have at
most ``handshakes_per_source`` handshakes in progress on a listener (more are closed
unanswered): no one source can hold the handshakes of everyone else.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from typing import Any

from aiohttp import web

__all__ = ["GuardedSite"]

log = logging.getLogger(__name__)


class GuardedSite(web.BaseSite):
    """A TCP site like :class:`aiohttp.web.TCPSite`, whose TLS handshakes are limited per
    client address and in time. Without TLS it is a plain TCP site."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        handshake_seconds: float,
        handshakes_per_source: int,
        name: str,
        backlog: int = 4096,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._tls = host, port, ssl_context
        self._handshake_seconds = handshake_seconds
        self._per_source = handshakes_per_source
        self._label = name
        self.handshaking: Counter[str] = Counter()
        """Handshakes in progress, by client address."""
        self.refused = 0
        """Connections closed because their address had too many handshakes in progress."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._host}:{self._port} ({self._label})"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        factory: Any = server if self._tls is None else (lambda: _Handshake(self))
        self._server = await loop.create_server(
            factory, self._host, self._port, backlog=self._backlog, reuse_address=True
        )

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await super().stop()

    def _accept(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        if self.handshaking[source] >= self._per_source:
            self.refused += 1
            transport.abort()
            return
        transport.pause_reading()  # the TLS layer takes the connection over before reading
        self.handshaking[source] += 1
        task = asyncio.get_running_loop().create_task(self._handshake(transport, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handshake(self, transport: asyncio.Transport, source: str) -> None:
        server = self._runner.server
        assert server is not None and self._tls is not None
        protocol = server()
        try:
            secured = await asyncio.get_running_loop().start_tls(
                transport,
                protocol,
                self._tls,
                server_side=True,
                ssl_handshake_timeout=self._handshake_seconds,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError) as exc:
            log.debug("%s: a TLS handshake from %s failed: %s", self._label, source, exc)
            transport.abort()
            return
        finally:
            self.handshaking[source] -= 1
            if self.handshaking[source] <= 0:
                del self.handshaking[source]
        if secured is None:  # the connection went away during the handshake
            return
        protocol.connection_made(secured)


class _Handshake(asyncio.Protocol):
    """Holds a new connection until :class:`GuardedSite` has started its TLS handshake."""

    def __init__(self, site: GuardedSite) -> None:
        self.site = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.site._accept(transport)
