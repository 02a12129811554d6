"""A gate for the intake's checks: at most ``slots`` holders at once, and whoever waits
with ``first=True`` (a verdict) is let in before anyone without (a heartbeat, a checkpoint
record)."""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["PriorityGate"]


class PriorityGate:
    """``await enter(first)`` ... ``leave()``: at most ``slots`` between the two at once.
    A freed slot goes to the longest-waiting ``first`` caller, then to the longest-waiting
    other one; a caller cancelled while it waits gives its place (or the slot it was just
    given) on."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots: must be at least 1, got {slots}")
        self.free = slots
        self._waiting: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (
            deque(),
            deque(),
        )

    @property
    def waiting(self) -> int:
        return len(self._waiting[0]) + len(self._waiting[1])

    async def enter(self, first: bool) -> None:
        if self.free > 0 and not (self._waiting[0] or self._waiting[1]):
            self.free -= 1
            return
        queue = self._waiting[0 if first else 1]
        future = asyncio.get_running_loop().create_future()
        queue.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.leave()  # given the slot, then cancelled: pass it on
            elif future in queue:
                queue.remove(future)
            raise

    def leave(self) -> None:
        for queue in self._waiting:
            while queue:
                future = queue.popleft()
                if not future.done():
                    future.set_result(None)
                    return
        self.free += 1
