"""``listeners.GuardedSite``'s limits on sites that share one ``Connections`` (the intake's
main port and its verdict port): what one address may hold counts on both together, so a
second port does not double it (docs/operator.md, "Verdicts first")."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path

from aiohttp import web

from sdc_harness.cluster import self_signed_cert
from sdc_operator.listeners import Connections, GuardedSite


def _tls(directory: Path) -> ssl.SSLContext:
    key, cert = self_signed_cert(directory)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(predicate: object, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_handshakes_per_source_count_on_both_ports_together(tmp_path: Path) -> None:
    context = _tls(tmp_path)

    async def main() -> None:
        shared = Connections(max_connections=100)
        sites = []
        for name in ("intake", "verdicts"):
            runner = web.AppRunner(web.Application())
            await runner.setup()
            site = GuardedSite(
                runner, "127.0.0.1", _free_port(), ssl_context=context,
                handshake_seconds=30, handshakes_per_source=2, name=name, connections=shared,
            )  # fmt: skip
            await site.start()
            sites.append((runner, site))
        (_, main_port), (_, verdict_port) = sites
        # TCP connections that never send their ClientHello: handshakes in progress
        held = []
        for site in (main_port, main_port, verdict_port):
            held.append(await asyncio.open_connection("127.0.0.1", site._port))
        await _until(lambda: sum(s.refused for _, s in sites) + shared.open == 3)
        assert shared.handshaking["127.0.0.1"] == 2
        assert (main_port.refused, verdict_port.refused) == (0, 1)
        # the refused one was reset; one handshake done (here: given up) makes room again
        reader, writer = held.pop()
        assert await reader.read() == b""
        writer.close()
        _, first = held.pop(0)
        first.close()
        await _until(lambda: shared.handshaking["127.0.0.1"] == 1)
        held.append(await asyncio.open_connection("127.0.0.1", verdict_port._port))
        await _until(lambda: shared.open == 2)
        assert shared.handshaking["127.0.0.1"] == 2 and verdict_port.refused == 1
        for _, writer in held:
            writer.close()
        await _until(lambda: shared.open == 0 and not shared.handshaking)
        for runner, site in sites:
            await site.stop()
            await runner.cleanup()

    asyncio.run(main())
