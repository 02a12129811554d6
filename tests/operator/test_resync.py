"""The resync counter (``hyperpod_sdc_resyncs_total``) that the integration tests wait on
before asserting that nothing happened: it goes up only once every reconcile a pass drove
has ended, and counted passes never overlap."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sdc_operator import engine as engine_module
from sdc_operator.engine import IncidentEngine
from sdc_operator.metrics import Metrics
from sdc_operator.settings import OperatorSettings


class Incidents:
    def __init__(self, *names: str) -> None:
        self.items = [{"metadata": {"namespace": "ml", "name": n}} for n in names]

    def values(self) -> list[dict[str, Any]]:
        return self.items

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next((i for i in self.items if i["metadata"]["name"] == name), None)


class Caches:
    def __init__(self, *names: str) -> None:
        self.incidents = Incidents(*names)
        self.policies = type("P", (), {"values": lambda _self: []})()

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return {}

    def confirmation_pods(self) -> list[dict[str, Any]]:
        return []


def passes(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("hyperpod_sdc_resyncs_total")
    assert value is not None
    return value


def test_a_pass_counts_once_every_reconcile_it_drove_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module.incidents, "pending_actions", lambda *_: True)
    metrics = Metrics()
    nothing: Any = None
    fake: Any = Caches("a", "b")
    engine = IncidentEngine(OperatorSettings(), metrics, fake, records=nothing, containment=nothing)
    engine.refresh_quarantined = lambda: None  # type: ignore[method-assign]
    release = {"a": asyncio.Event(), "b": asyncio.Event()}
    reconciled: list[str] = []

    async def reconcile(namespace: str, name: str) -> None:
        await release[name].wait()
        reconciled.append(name)

    engine.reconcile = reconcile  # type: ignore[method-assign]

    async def go() -> list[tuple[float, list[str]]]:
        seen = []
        engine.leader = True
        engine.resync()  # pass 1 drives a and b
        await asyncio.sleep(0.01)
        seen.append((passes(metrics), list(reconciled)))
        release["a"].set()
        await asyncio.sleep(0.01)
        engine.resync()  # pass 1 still waits for b: this resync starts no counted pass
        await asyncio.sleep(0.01)
        seen.append((passes(metrics), list(reconciled)))
        release["b"].set()
        await asyncio.sleep(0.01)
        seen.append((passes(metrics), list(reconciled)))
        engine.resync()  # pass 2: both reconcile again at once
        await asyncio.sleep(0.01)
        seen.append((passes(metrics), list(reconciled)))
        await engine.close()
        return seen

    assert asyncio.run(go()) == [
        (0.0, []),
        (0.0, ["a", "a"]),  # the second resync drove a again (it had ended)
        (1.0, ["a", "a", "b", "b"]),  # and b once more after its first (marked dirty)
        (2.0, ["a", "a", "b", "b", "a", "b"]),
    ]


def test_the_clean_run_a_pass_with_nothing_to_drive_counts_at_once() -> None:
    metrics = Metrics()
    nothing: Any = None
    fake: Any = Caches()
    engine = IncidentEngine(OperatorSettings(), metrics, fake, records=nothing, containment=nothing)
    engine.refresh_quarantined = lambda: None  # type: ignore[method-assign]

    async def go() -> float:
        engine.resync()  # not the leader: nothing, not even a count
        await asyncio.sleep(0)
        assert passes(metrics) == 0
        engine.leader = True
        engine.resync()
        await asyncio.sleep(0)
        return passes(metrics)

    assert asyncio.run(go()) == 1.0


def test_containment_on_its_lane_goes_on_while_the_operators_loop_is_blocked() -> None:
    """A storm holds the operator's event loop (here: blocked 1.5 s). With a lane
    (:class:`sdc_operator.lane.LoopThread`), a reconcile scheduled from that loop runs on
    the lane and makes its 20 sequential awaits (the containment's API calls) meanwhile;
    without one, it waits for the loop and has made none of them when the block ends,
    which shows the test can fail."""
    import threading
    import time

    from sdc_operator.lane import LoopThread

    async def blocked(lane: LoopThread | None) -> tuple[int, set[int]]:
        if lane is not None:
            lane.start()
        metrics = Metrics()
        nothing: Any = None
        fake: Any = Caches("a")
        engine = IncidentEngine(
            OperatorSettings(), metrics, fake, records=nothing, containment=nothing, lane=lane
        )
        calls: list[int] = []
        threads: set[int] = set()

        async def reconcile(namespace: str, name: str) -> None:
            threads.add(threading.get_ident())
            for _ in range(20):
                await asyncio.sleep(0.001)
                calls.append(1)

        engine.reconcile = reconcile  # type: ignore[method-assign]
        engine.leader = True
        engine.schedule("ml", "a")
        time.sleep(1.5)  # the loop runs nothing at all
        during = len(calls)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(calls) == 20:
                break
        assert len(calls) == 20  # and it ends either way
        await engine.close()
        if lane is not None:
            await lane.stop()
        return during, threads

    during, threads = asyncio.run(blocked(LoopThread("containment")))
    assert during == 20 and threading.get_ident() not in threads
    during, threads = asyncio.run(blocked(None))
    assert during == 0 and threads == {threading.get_ident()}


def test_a_lane_never_started_leaves_no_event_loop_to_collect() -> None:
    """The operator's parts make their lanes when they are built, and unit tests build them
    without starting them: a loop made there and never closed was collected later, in
    another test, as an unclosed event loop and two unclosed sockets (its self-pipe)."""
    import gc
    import warnings

    from sdc_operator.lane import LoopThread

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        lane = LoopThread("never started")
        assert not lane.alive and not lane.here()
        with pytest.raises(RuntimeError, match="never started: start"):
            lane.call(print)
        del lane
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_a_lane_starts_once() -> None:
    from sdc_operator.lane import LoopThread

    lane = LoopThread("twice")
    lane.start()
    with pytest.raises(RuntimeError, match="twice: started already"):
        lane.start()
    asyncio.run(lane.stop())
    assert not lane.alive


def test_a_start_run_after_the_lease_was_lost_again_makes_no_leader() -> None:
    """The election posts its start to the operator's loop; a storm can hold it there until
    the Lease is lost again (the stop reaches the engine at once, from the election's
    thread): run late, the start must not make the engine act (review of 0102219)."""
    nothing: Any = None
    fake: Any = Caches("a")
    engine = IncidentEngine(
        OperatorSettings(), Metrics(), fake, records=nothing, containment=nothing
    )
    resyncs: list[int] = []
    engine.resync = lambda: resyncs.append(1)  # type: ignore[method-assign]
    engine.leading = lambda: False
    engine.become_leader()
    assert engine.leader is False
    engine.leading = lambda: True
    engine.become_leader()
    assert engine.leader is True and resyncs == [1]
