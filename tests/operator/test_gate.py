"""The intake's PriorityGate: at most its slots held, verdicts let in first, cancellation
passes a place on."""

from __future__ import annotations

import asyncio

import pytest

from sdc_operator.gate import PriorityGate


def test_slots_bound_holders_and_first_callers_go_ahead_of_others() -> None:
    async def run() -> list[str]:
        gate = PriorityGate(2)
        order: list[str] = []
        held = 0
        most = 0

        async def one(name: str, first: bool) -> None:
            nonlocal held, most
            await gate.enter(first)
            held += 1
            most = max(most, held)
            order.append(name)
            await asyncio.sleep(0)
            held -= 1
            gate.leave()

        await gate.enter(False)  # both slots taken before anyone queues
        await gate.enter(False)
        tasks = [asyncio.create_task(one(f"h{i}", False)) for i in range(3)]
        tasks += [asyncio.create_task(one(f"v{i}", True)) for i in range(2)]
        await asyncio.sleep(0)
        assert gate.waiting == 5
        gate.leave()
        gate.leave()
        await asyncio.gather(*tasks)
        assert most <= 2 and gate.free == 2 and gate.waiting == 0
        return order

    assert asyncio.run(run()) == ["v0", "v1", "h0", "h1", "h2"]


def test_a_cancelled_waiter_gives_its_place_on() -> None:
    async def run() -> None:
        gate = PriorityGate(1)
        await gate.enter(False)
        gone = asyncio.create_task(gate.enter(True))
        kept = asyncio.create_task(gate.enter(False))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        gate.leave()  # to ``kept``: the cancelled waiter is skipped
        await asyncio.wait_for(kept, 1)
        assert gone.cancelled() and gate.free == 0 and gate.waiting == 0
        # given the slot, then cancelled before it ran: the slot goes on, not lost
        late = asyncio.create_task(gate.enter(True))
        await asyncio.sleep(0)
        gate.leave()
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert gate.free == 1

    asyncio.run(run())


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slots"):
        PriorityGate(0)
