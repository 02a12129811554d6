"""A stopping operator waits for the SageMaker calls it already sent before it gives the
Lease up: the call runs on a pool's thread, which cancelling its task does not stop."""

from __future__ import annotations

import asyncio
import threading
import time

from sdc_operator.remediate import HyperPodNodes


def test_finish_waits_for_a_call_in_flight_and_says_when_it_did_not_end() -> None:
    ended = threading.Event()

    def call(seconds: float) -> str:
        time.sleep(seconds)
        ended.set()
        return "accepted"

    async def stop(seconds: float, timeout: float) -> tuple[bool, bool, float]:
        nodes = HyperPodNodes(lambda: None)
        task = asyncio.ensure_future(nodes._run(call, seconds))
        await asyncio.sleep(0.05)  # on the pool's thread now
        task.cancel()  # what stopping the engine does to it
        began = time.monotonic()
        finished = await nodes.finish(timeout)
        return finished, ended.is_set(), time.monotonic() - began

    finished, done, _ = asyncio.run(stop(0.3, 5.0))
    assert (finished, done) == (True, True)  # waited for the call's end
    ended.clear()
    finished, done, waited = asyncio.run(stop(1.5, 0.2))  # (the process still waits at exit)
    assert (finished, done) == (False, False) and waited < 1.0
