"""Token buckets: per job, per client address, and one for TokenReviews, so a flood from
one source is refused (429) without slowing the others. Thread-safe: both report listeners
(on two threads' event loops) take from the same buckets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["RateLimiter", "TokenBucket"]


class TokenBucket:
    """One bucket: ``burst`` requests at once, refilled at ``rate`` per second."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def acquire(self) -> float | None:
        """Take one token: ``None`` if granted, else seconds until one is."""
        with self._lock:
            return self._take()

    def _take(self) -> float | None:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) / self.rate


class RateLimiter:
    """A bucket per key (a job's uid, a client's address)."""

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 100_000,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> float | None:
        """Take one token for ``key``: ``None`` if granted, else seconds until one is."""
        with self._lock:
            return self._take(key)

    def _take(self, key: str) -> float | None:
        now = self._clock()
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens >= 1.0:
            self._remember(key, tokens - 1.0, now)
            return None
        self._remember(key, tokens, now)
        return (1.0 - tokens) / self.rate

    def _remember(self, key: str, tokens: float, now: float) -> None:
        if key not in self._buckets and len(self._buckets) >= self._max_keys:
            # Full buckets carry no state worth keeping: drop them first.
            for k in [
                k
                for k, (t, last) in self._buckets.items()
                if t + (now - last) * self.rate >= self.burst
            ]:
                del self._buckets[k]
            if len(self._buckets) >= self._max_keys:  # all busy: forget the oldest
                del self._buckets[next(iter(self._buckets))]
        self._buckets[key] = (tokens, now)
