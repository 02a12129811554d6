"""A thread with an event loop of its own, for work that must not wait behind the intake.

The intake's event loop reads, decrypts and answers every report of a storm; a coroutine on
that loop waits for a turn behind all of them at each of its ``await``\\ s. At 2,048 nodes
with every node reporting, that made each of the containment's dozen sequential API calls
wait up to a second for the loop (docs/operator.md, "The engine's own thread"). Work on a
:class:`LoopThread` waits for the GIL instead, which CPython hands over every 5 ms
(``sys.getswitchinterval()``) to a thread that asks for it.

What runs there must use clients made for it (an ``aiohttp`` session belongs to one loop)
and reach the other loop's state only through ``call_soon_threadsafe`` or data that is safe
to share (:class:`.informer.Informer`'s writes are locked).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """``start()``, then :meth:`call` or :meth:`run` work on the thread's loop from any
    thread; :meth:`stop` ends it."""

    def __init__(self, name: str) -> None:
        self._name = name
        # Made by start(): a loop made and never run would never be closed.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self._name}: started already")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"{self._name}: start() the thread first")
        return self._loop

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def here(self) -> bool:
        """Whether the caller runs on this thread."""
        return self._thread is not None and threading.get_ident() == self._thread.ident

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on the thread's loop, soon (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the thread's loop; its result, awaited from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (what still runs on it is dropped), then join the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
