"""``last_clean_step``: the newest step at which every check with a say vouched for the job.

Each such check (the replay audit, check 3) vouches for steps on its own schedule; the clean
step is the oldest of their newest. A step no check blocked may still wait for results that
come after it ended (its non-finite flags read during the next step, check 3's exchange
overlapped with the next step): it counts once they came back clean, never if one did not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CleanSteps"]


@dataclass(slots=True)
class _Candidate:
    vouched: dict[str, int]
    """What the step adds (check name -> the step)."""
    waiting: set[str]
    """What it still waits for."""


class CleanSteps:
    """The bookkeeping behind ``Guard.last_clean_step`` (see the module docstring)."""

    def __init__(
        self,
        checks: Iterable[str],
        start: int,
        on_advance: Callable[[int], None] | None = None,
    ) -> None:
        self._verified = dict.fromkeys(checks, start)
        self._candidates: dict[int, _Candidate] = {}
        self.last = start
        self.on_advance = on_advance
        """Called with the new ``last`` each time a step's results advance it (not on
        :meth:`restore`)."""
        self.on_pending: Callable[[int], None] | None = None
        """Called with a step that ended waiting for results which, if clean, make it
        ``last`` (so ``on_advance`` for it comes later, from :meth:`resolved`)."""

    def step_ended(self, step: int, vouched: dict[str, int], waiting: set[str]) -> None:
        """No check blocked ``step``; ``vouched`` is what it adds, once nothing in
        ``waiting`` is still awaited."""
        if waiting:
            self._candidates[step] = _Candidate(vouched, waiting)
            if self.on_pending is not None and self._would_reach(vouched) == step:
                self.on_pending(step)
        else:
            self._count(vouched)

    def resolved(self, step: int, what: str, *, passed: bool) -> None:
        """``what`` ``step`` waited for came back: ``passed``, the step counts once
        nothing else is awaited; not, it never does."""
        candidate = self._candidates.get(step)
        if candidate is None:
            return
        if not passed:
            del self._candidates[step]
            return
        candidate.waiting.discard(what)
        if not candidate.waiting:
            del self._candidates[step]
            self._count(candidate.vouched)

    def last_if_passed(self, step: int, what: str) -> int:
        """What :attr:`last` would be if ``what`` that ``step`` waits for came back clean
        now (nothing changes)."""
        candidate = self._candidates.get(step)
        if candidate is None or candidate.waiting - {what}:
            return self.last
        return max(self.last, self._would_reach(candidate.vouched))

    def restore(self, step: int) -> None:
        """A checkpoint of ``step`` was restored: trusted, nothing awaited."""
        self._candidates.clear()
        self._verified = dict.fromkeys(self._verified, step)
        self.last = step

    def _would_reach(self, vouched: dict[str, int]) -> int:
        return min(max(at, vouched.get(name, at)) for name, at in self._verified.items())

    def _count(self, vouched: dict[str, int]) -> None:
        for name, step in vouched.items():
            self._verified[name] = max(self._verified[name], step)
        last = min(self._verified.values())
        advanced = last > self.last
        self.last = last
        if advanced and self.on_advance is not None:
            self.on_advance(last)
