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
        hold = Hold(site, loop, most=30.0, gap=0.3)  # type: ignore[arg-type]
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
        hold.busy(True)  # a new hold, once the site was read for gap after the first
        await _until(lambda: len(site.calls) == 3)
        assert site.calls[2][0] is True
        assert site.calls[2][1] - site.calls[1][1] >= 0.3 - 1e-3

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
        hold = Hold(site, loop, most=30.0, gap=0.1, quiet=0.3)  # type: ignore[arg-type]
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


def test_connections_opened_and_closed_in_turn_hold_the_site_at_most_half_of_the_time() -> None:
    """A client of the verdict port (any pod may connect: the hold begins before TLS)
    that keeps a connection open for less than ``most``, closes it and opens the next."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        site = Site(loop)
        hold = Hold(site, loop, most=0.2, gap=0.2)  # type: ignore[arg-type]
        began = loop.time()
        while loop.time() - began < 2.0:
            hold.busy(True)
            await asyncio.sleep(0.05)
            hold.busy(False)
            await asyncio.sleep(0.001)
        await _until(lambda: not site.calls or site.calls[-1][0] is False)
        assert [held for held, _ in site.calls] == [True, False] * hold.holds
        assert hold.holds >= 2
        # each hold (about 0.05 s here, at most 0.2 s) is followed by at least 0.2 s of
        # reading: at most half of the time held, whatever the client does
        releases, next_holds = site.calls[1::2], site.calls[2::2]
        for (_, off_at), (_, on_at) in zip(releases, next_holds, strict=False):
            assert on_at - off_at >= 0.2 - 1e-3, site.calls

    asyncio.run(main())
