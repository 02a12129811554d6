"""One listener per audience, each on its own port (docs/operator.md, "Threat model").

=============  =========================================  ==============================
listener       paths                                      who may reach it (chart)
=============  =========================================  ==============================
intake         ``POST /v1/reports``                       the tenants' namespaces
admission      ``POST /v1/admission/...``                 the API server
metrics        ``/metrics``, ``/healthz``, ``/readyz``    monitoring, the kubelet's probes
=============  =========================================  ==============================

A path is served on its own listener only: the tenants' port answers 404 to the admission
webhook and to ``/metrics`` (which names every opted-in job of every namespace).

Each listener bounds what its connections may cost before it spends anything on them:

- at most ``max_connections`` open at once, and ``connections_per_source`` from one client
  address; a connection past either is reset as it is accepted, before its TLS handshake
  (the agent retries after its back-off), so memory is bounded by the number of
  connections, whoever opens them (docs/operator.md, "Memory");
- ``reserved`` of those connections only for the addresses ``reserved_for`` names (the
  admission listener's: the API server's own, which no per-source limit counts): other
  addresses together may hold ``max_connections - reserved``, so no number of them can
  shut the API server out;
- its TLS handshakes: one address may have at most ``handshakes_per_source`` in progress
  on the sites that share its :class:`Connections` (the intake's two ports together), and a
  handshake not complete after ``handshake_seconds`` is closed;
- a TLS read buffer of :data:`TLS_READ_BUFFER` bytes per connection, not asyncio's 256 KiB
  (CPython 3.11 and 3.12 allocate and zero one such buffer for every TLS connection).

A site can be held (:meth:`GuardedSite.hold`): its connections are not read (the kernel
keeps what arrives) until it is let go. :class:`Hold` holds the intake's main port while
the verdict port has a connection open, for at most a second at a time.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from asyncio import sslproto
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

from aiohttp import web

__all__ = ["CONNECTION_BYTES", "TLS_READ_BUFFER", "Connections", "GuardedSite", "Hold"]

log = logging.getLogger(__name__)

TLS_READ_BUFFER = 16 * 1024 + 512
"""Bytes read from a TLS socket at once: one TLS record (at most 16 KiB of plaintext and
its overhead). asyncio's default, 256 KiB, made each open TLS connection cost about 0.3 MiB."""

CONNECTION_BYTES = 96 * 1024
"""What one open connection may cost the operator, TLS and HTTP state together, between
requests: measured 55 KiB with CPython 3.11 and OpenSSL 3 (295 KiB with asyncio's own
buffer); the memory bound in docs/operator.md counts this figure per connection."""


class Connections:
    """The open connections one or more sites count together, globally and per client
    address, with their limits (the two report listeners share one: what an agent holds on
    both counts once against ``max_connections``, so the memory bound does not grow with
    the second port). Thread-safe: the sites may serve on different threads' loops."""

    def __init__(
        self,
        max_connections: int = 4608,
        connections_per_source: int | None = None,
        reserved: int = 0,
        reserved_for: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.max_connections = max_connections
        self.connections_per_source = connections_per_source
        self.reserved = reserved
        self.reserved_for = reserved_for
        self._lock = threading.Lock()
        self.connected: Counter[str] = Counter()
        """Open connections (handshaking or not), by client address."""
        self.open = 0
        """Open connections."""
        self.open_unreserved = 0
        """Open connections from addresses :attr:`reserved_for` does not name."""
        self.peak = 0
        """The most connections that were open at once."""
        self.handshaking: Counter[str] = Counter()
        """TLS handshakes in progress, by client address, on every site counted here."""

    def take(self, source: str, handshakes_per_source: int | None = None) -> bool | None:
        """Count a new connection from ``source``, and with ``handshakes_per_source`` its
        TLS handshake (until :meth:`handshake_done`): whether it is one of the reserved
        addresses', or ``None`` (not counted) where a limit refuses it."""
        per_source = self.connections_per_source
        reserved = self.reserved > 0 and source in self.reserved_for()
        with self._lock:
            if (
                self.open >= self.max_connections
                or (
                    handshakes_per_source is not None
                    and self.handshaking[source] >= handshakes_per_source
                )
                or (
                    not reserved
                    and (
                        self.open_unreserved >= self.max_connections - self.reserved
                        or (per_source is not None and self.connected[source] >= per_source)
                    )
                )
            ):
                return None
            self.open += 1
            self.open_unreserved += not reserved
            self.peak = max(self.peak, self.open)
            self.connected[source] += 1
            if handshakes_per_source is not None:
                self.handshaking[source] += 1
        return reserved

    def handshake_done(self, source: str) -> None:
        with self._lock:
            self.handshaking[source] -= 1
            if self.handshaking[source] <= 0:
                del self.handshaking[source]

    def give_back(self, source: str, reserved: bool) -> None:
        with self._lock:
            self.open -= 1
            self.open_unreserved -= not reserved
            self.connected[source] -= 1
            if self.connected[source] <= 0:
                del self.connected[source]


class GuardedSite(web.BaseSite):
    """A TCP site like :class:`aiohttp.web.TCPSite` whose connections are counted and
    limited, globally and per client address, as they are accepted; with TLS, its
    handshakes are limited per address and in time. Without TLS it is a plain TCP site
    with the same connection limits."""

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
        connections: Connections,
        most_open: int | None = None,
        backlog: int = 4096,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._tls = host, port, ssl_context
        self._handshake_seconds = handshake_seconds
        self._handshakes_per_source = handshakes_per_source
        self.connections = connections
        """Its connections and their limits (shared with another site, or its own)."""
        self.most_open = most_open
        """At most this many of them open on this site at once (``None``: the shared limits
        only)."""
        self._label = name
        self._securing: set[_SSLProtocol] = set()
        self._live: set[_SSLProtocol | _Counted] = set()
        self._held = False
        self.busy: Callable[[bool], None] | None = None
        """Called (on this site's loop) with true when its first connection opens, false
        when its last one closes."""
        self.overflowed: Callable[[], None] | None = None
        """Called (on this site's loop) when a connection is reset for ``most_open``."""
        self.refused = 0
        """Connections reset as they were accepted: too many open, in all or from their
        address, or too many handshakes in progress from their address."""

    @property
    def name(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._host}:{self._port} ({self._label})"

    def hold(self, held: bool) -> None:
        """(On this site's loop.) Read none of its connections, new ones included, until
        ``hold(False)``: what the clients send waits in the kernel's buffers."""
        if held == self._held:
            return
        self._held = held
        for live in list(self._live):
            live.hold(held)

    def _opened(self, live: _SSLProtocol | _Counted) -> None:
        self._live.add(live)
        if self._held:
            live.hold(True)
        if len(self._live) == 1 and self.busy is not None:
            self.busy(True)

    def _gone(self, live: _SSLProtocol | _Counted) -> None:
        self._live.discard(live)
        if not self._live and self.busy is not None:
            self.busy(False)

    async def stop(self) -> None:
        for pending in list(self._securing):  # handshakes no runner knows of yet
            pending.abort_handshake()
        await super().stop()

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Accept(self), self._host, self._port, backlog=self._backlog, reuse_address=True
        )

    def _accept(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        full = self.most_open is not None and len(self._live) >= self.most_open
        if full and self.overflowed is not None:
            self.overflowed()
        handshakes = self._handshakes_per_source if self._tls is not None else None
        reserved = None if full else self.connections.take(source, handshakes)
        if reserved is None:
            self.refused += 1
            transport.abort()
            return
        server = self._runner.server
        assert server is not None
        app_protocol = server()
        if self._tls is None:
            counted = _Counted(self, source, reserved, app_protocol, transport)
            transport.set_protocol(counted)
            app_protocol.connection_made(transport)
            self._opened(counted)
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        waiter.add_done_callback(lambda f: self._handshake_done(source, f))
        secured = _SSLProtocol(
            self,
            source,
            reserved,
            loop,
            app_protocol,
            self._tls,
            waiter,
            server_side=True,
            call_connection_made=True,
            ssl_handshake_timeout=self._handshake_seconds,
        )
        self._securing.add(secured)
        waiter.add_done_callback(lambda _: self._securing.discard(secured))
        transport.set_protocol(secured)
        secured.connection_made(transport)
        self._opened(secured)

    def _handshake_done(self, source: str, waiter: asyncio.Future[Any]) -> None:
        self.connections.handshake_done(source)
        if not waiter.cancelled() and (exc := waiter.exception()) is not None:
            log.debug("%s: a TLS handshake from %s failed: %s", self._label, source, exc)

    def _closed(self, source: str, reserved: bool) -> None:
        self.connections.give_back(source, reserved)


class _Accept(asyncio.Protocol):
    """Holds a new connection until :class:`GuardedSite` has decided what to do with it."""

    def __init__(self, site: GuardedSite) -> None:
        self.site = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.site._accept(transport)


class _SSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS layer with a read buffer of :data:`TLS_READ_BUFFER` bytes, which tells
    its site when the connection closes."""

    max_size = TLS_READ_BUFFER

    def __init__(
        self, site: GuardedSite, source: str, reserved: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._site, self._source, self._reserved = site, source, reserved

    def abort_handshake(self) -> None:
        transport: Any = self._transport
        if transport is not None:
            transport.abort()

    def hold(self, held: bool) -> None:
        _hold(self._transport, held)

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            self._site._closed(self._source, self._reserved)
            self._site._gone(self)


class _Counted(asyncio.Protocol):
    """A plain connection's protocol, passed through, which tells its site when the
    connection closes."""

    def __init__(
        self, site: GuardedSite, source: str, reserved: bool, inner: Any, transport: Any
    ) -> None:
        self._site, self._source, self._reserved, self._inner = site, source, reserved, inner
        self._transport = transport

    def hold(self, held: bool) -> None:
        _hold(self._transport, held)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._site._closed(self._source, self._reserved)
            self._site._gone(self)


def _hold(transport: Any, held: bool) -> None:
    """Stop or resume reading the socket under ``transport`` (TLS records are then not
    read, decrypted or answered either)."""
    if transport is None or transport.is_closing():
        return
    if held:
        transport.pause_reading()
    else:
        transport.resume_reading()


class Hold:
    """Holds ``site`` (:meth:`GuardedSite.hold`, on ``loop``) while :meth:`busy` says so,
    from any thread, for at most ``most`` seconds at a time and then lets it go for at
    least ``gap`` seconds: the intake's main port is not read while the verdict port has a
    connection open, so the verdicts' thread does not share the process (the GIL) with a
    burst of heartbeats being read and shed. Every hold, however short, is followed by
    ``gap`` seconds of reading (``gap >= most``): no client of the verdict port, not even
    one that opens and closes connections in turn, keeps the main port from being read for
    more than half of the time. Once the verdict port
    is full (:meth:`overflowed`: its agents then send on the main port), the site is not
    held for ``quiet`` seconds."""

    def __init__(
        self,
        site: GuardedSite,
        loop: asyncio.AbstractEventLoop,
        most: float = 1.0,
        gap: float = 1.0,
        quiet: float = 5.0,
    ) -> None:
        self._site, self._loop, self._most, self._gap = site, loop, most, gap
        self._quiet = quiet
        self._told = -1e9  # (monotonic) when overflowed() last told the loop
        self._wanted = False
        self._since: float | None = None  # held since (the loop's time)
        self._free_until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.holds = 0
        """Times the site was held."""

    def busy(self, wanted: bool) -> None:
        """(Any thread.) Whether the site should be held now."""
        self._loop.call_soon_threadsafe(self._want, wanted)

    def overflowed(self) -> None:
        """(Any thread.) The verdict port refused a connection for being full: its agent
        sends on the main port, which is read now and for ``quiet`` seconds (told at most
        every tenth of ``quiet``: a storm's resets are many)."""
        now = time.monotonic()
        if now - self._told >= self._quiet / 10:
            self._told = now
            self._loop.call_soon_threadsafe(self._overflow)

    def _overflow(self) -> None:
        if self._since is not None:
            self._release()
        until = self._loop.time() + self._quiet
        if until > self._free_until:
            self._free_until = until
            self._loop.call_at(until, self._apply)

    def _want(self, wanted: bool) -> None:
        self._wanted = wanted
        self._apply()

    def _apply(self) -> None:
        now = self._loop.time()
        if self._wanted and self._since is None and now >= self._free_until:
            self._since = now
            self.holds += 1
            self._site.hold(True)
            self._timer = self._loop.call_later(self._most, self._expire)
        elif not self._wanted and self._since is not None:
            self._release()

    def _release(self) -> None:
        """Let the site go, and read it for at least ``gap`` seconds before the next hold
        (a hold ended early by its connection closing too)."""
        self._site.hold(False)
        self._since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        until = self._loop.time() + self._gap
        if until > self._free_until:
            self._free_until = until
            self._loop.call_at(until, self._apply)

    def _expire(self) -> None:
        self._timer = None
        if self._since is not None:
            self._release()
