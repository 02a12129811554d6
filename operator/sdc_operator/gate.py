"""What the intake lets through at once: :class:`PriorityGate` for the checks of one
listener's reports (at most ``slots`` holders at once, and whoever waits with
``first=True``, a verdict, is let in before anyone without: a heartbeat, a checkpoint
record), and :class:`InFlight`, the reports in flight on both report listeners together,
by lane."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["InFlight", "PriorityGate"]


class InFlight:
    """Reports in flight on the report listeners together (the main port's loop and the
    verdict port's, on two threads: every change is locked), and the verdicts' lane:
    how many verdicts are in flight and when the last one was answered, which sheds
    heartbeats on either listener."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.reports = 0
        """Reports past the overload check, not yet answered."""
        self.lanes: dict[str, int] = {"verdict": 0, "heartbeat": 0}
        """Verdicts and heartbeats past their body, not yet answered."""
        self.verdict_at = -1e9
        """When (the clock's time) the last verdict was answered."""

    def enter(self, most: int) -> int | None:
        """Count a report in, unless ``most`` are in flight: their number then, or ``None``."""
        with self._lock:
            if self.reports >= most:
                return None
            self.reports += 1
            return self.reports

    def leave(self, lane: str | None, *, answered: bool = True) -> int:
        """Count a report (of ``lane``, where it got one) out; the number left. A verdict
        ``answered`` (it passed the checks) is when the last verdict was; a refused one
        (an unauthenticated body saying it is a verdict) is not."""
        with self._lock:
            self.reports -= 1
            if lane is not None:
                self.lanes[lane] -= 1
                if lane == "verdict" and answered:
                    self.verdict_at = self._clock()
            return self.reports

    def join(self, lane: str, most: int | None = None) -> bool:
        """Count a report into ``lane``, unless ``most`` of its kind are in flight."""
        with self._lock:
            if most is not None and self.lanes[lane] >= most:
                return False
            self.lanes[lane] += 1
            return True

    def verdict_recent(self, quiet: float) -> bool:
        """A verdict is in flight, or was answered less than ``quiet`` seconds ago."""
        return self.lanes["verdict"] > 0 or self._clock() - self.verdict_at < quiet


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
