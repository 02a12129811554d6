"""A pool kept warm (:meth:`sdc_operator.kube.Kube.keep_warm`) keeps a connection to the API
server open through a quiet longer than the server keeps an idle connection, so the next
call (an incident's first, in containment's path) opens none. Against a real HTTP server on
loopback that closes a connection idle for 1.5 s; without the warmth the same call opens a
second connection, which shows the test can fail."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from sdc_operator.kube import Endpoint, Kube

IDLE_SECONDS = 1.5
"""The server closes a connection idle this long (the API server: 90 s; aiohttp's client:
15 s)."""
ASK_EVERY = 0.1
"""The pool's asks, here: a stall of the test's event loop (or of the server, which shares
it) longer than IDLE_SECONDS - ASK_EVERY = 1.4 s opens a second connection (the margin; at
an idle of 0.3 s, stalls of 0.2 s did, 2 in 65 runs at load 21-23)."""


async def serve() -> tuple[web.AppRunner, str, list[Any], list[Any]]:
    """The server, its address, and the connection (transport) of each ``/version`` ask and
    of each other call."""
    warm: list[Any] = []
    calls: list[Any] = []

    async def version(request: web.Request) -> web.Response:
        warm.append(request.transport)
        return web.json_response({"gitVersion": "v1.20.2"})

    async def other(request: web.Request) -> web.Response:
        calls.append(request.transport)
        return web.json_response({"kind": "Status"})

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/api/v1/namespaces/ml", other)
    runner = web.AppRunner(app, keepalive_timeout=IDLE_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", warm, calls


async def until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.01)


@pytest.mark.timing  # margin: a stall of 1.4 s (ASK_EVERY)
def test_a_warm_pool_calls_on_the_connection_it_kept_open_through_a_quiet() -> None:
    async def go() -> tuple[int, int]:
        runner, host, warm, calls = await serve()
        kube = Kube(Endpoint(host, False), name="engine")
        try:
            kube.keep_warm(every=ASK_EVERY)
            # a quiet of two idle timeouts at least: 30 asks, 15 per timeout
            await until(lambda: len(warm) >= 30, "30 asks to keep the pool warm")
            await kube.get("v1", "namespaces", None, "ml")
            return len({id(t) for t in warm + calls}), len(calls)
        finally:
            await kube.close()
            await runner.cleanup()

    connections, called = asyncio.run(go())
    assert called == 1
    assert connections == 1, f"{connections} connections opened"


def test_without_the_warmth_the_call_after_a_quiet_opens_another_connection() -> None:
    async def go() -> int:
        runner, host, _, calls = await serve()
        kube = Kube(Endpoint(host, False), name="engine")
        try:
            await kube.get("v1", "namespaces", None, "ml")
            await until(lambda: calls[0].is_closing(), "the server closing the idle connection")
            await kube.get("v1", "namespaces", None, "ml")
            return len({id(t) for t in calls})
        finally:
            await kube.close()
            await runner.cleanup()

    assert asyncio.run(go()) == 2


def test_closing_a_warm_pool_ends_its_asks() -> None:
    async def go() -> tuple[int, bool]:
        runner, host, warm, _ = await serve()
        kube = Kube(Endpoint(host, False), name="engine")
        try:
            kube.keep_warm(every=0.01)
            await until(lambda: len(warm) >= 2, "2 asks")
            task = kube._warm
            await kube.close()
            return len(warm), task is not None and task.done()
        finally:
            await runner.cleanup()

    _, ended = asyncio.run(go())
    assert ended
