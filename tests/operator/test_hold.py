"""``listeners.Hold``: the intake's main port is held while the verdict port is busy, at most
``most`` seconds at a time, then let go for at least ``gap`` seconds (docs/operator.md,
"Verdicts first"). A stand-in site records what it is told (the real sites are exercised by
tests/integration/test_verdict_port.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sdc_operator.listeners import Hold


class Site:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: list[tuple[bool, float]] = []

    def hold(self, held: bool) -> None:
        self.calls.append((held, self.loop.time()))


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_held_while_busy_and_let_go_when_not() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        site = Site(loop)
        hold = Hold(site, loop, most=30.0, gap=30.0)  # type: ignore[arg-type]
        # from another thread, as the verdict port's loop calls it
        threading.Thread(target=hold.busy, args=(True,)).start()
        await _until(lambda: len(site.calls) == 1)
        assert site.calls[0][0] is True
        hold.busy(True)  # no second hold while held
        hold.busy(False)
        await _until(lambda: len(site.calls) == 2)
        assert [held for held, _ in site.calls] == [True, False]
        assert hold.holds == 1
        hold.busy(False)  # nothing to let go
        hold.busy(True)  # a new hold: the first one ended before its most
        await _until(lambda: len(site.calls) == 3)
        assert site.calls[2][0] is True

    asyncio.run(main())


def test_a_hold_ends_after_most_and_the_site_is_read_for_gap_before_the_next() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        site = Site(loop)
        hold = Hold(site, loop, most=0.2, gap=0.3)  # type: ignore[arg-type]
        hold.busy(True)  # and busy for ever after: a client that never lets go
        await _until(lambda: len(site.calls) == 3)
        (on, held_at), (off, freed_at), (again, again_at) = site.calls
        assert (on, off, again) == (True, False, True)
        assert freed_at - held_at >= 0.2 - 1e-3
        assert again_at - freed_at >= 0.3 - 1e-3
        hold.busy(False)
        await _until(lambda: len(site.calls) == 4)
        assert site.calls[3][0] is False

    asyncio.run(main())


def test_not_held_for_quiet_after_the_verdict_port_overflowed() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        site = Site(loop)
        hold = Hold(site, loop, most=30.0, gap=30.0, quiet=0.3)  # type: ignore[arg-type]
        hold.busy(True)
        await _until(lambda: len(site.calls) == 1)
        began = loop.time()
        hold.overflowed()  # its agents now send on the main port: read it
        hold.overflowed()  # (told once)
        await _until(lambda: len(site.calls) == 2)
        assert site.calls[1][0] is False
        # still busy: held again only once the quiet is over
        await _until(lambda: len(site.calls) == 3)
        assert site.calls[2][0] is True
        assert site.calls[2][1] - began >= 0.3 - 1e-3
        assert hold.holds == 2

    asyncio.run(main())
