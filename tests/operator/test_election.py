"""Leader election against a fake Lease store with a fake clock, and what heartbeats
become: silence, across replicas."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity
from sdc_operator.errors import ApiError
from sdc_operator.heartbeats import Heartbeats
from sdc_operator.incidents import JobRef
from sdc_operator.leader import LeaderElector
from sdc_operator.metrics import Metrics


class Leases:
    """One Lease with resourceVersion preconditions, as the API server keeps it."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False
        self.hung = False

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        if self.hung:
            await asyncio.Event().wait()  # a connection that never answers
        if self.down:
            raise ApiError(0, "unreachable")
        if self.lease is None:
            raise ApiError(404, "not found")
        return copy.deepcopy(self.lease)

    async def create(self, api_version: str, plural: str, namespace: str | None, body: Any) -> Any:
        if self.lease is not None:
            raise ApiError(409, "exists")
        self.version += 1
        self.lease = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
        }
        return self.lease

    async def close(self) -> None:
        pass

    async def replace(self, api_version: str, plural: str, namespace: str | None, body: Any) -> Any:
        if self.down:
            raise ApiError(0, "unreachable")
        assert self.lease is not None
        if body["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "conflict")
        self.version += 1
        self.lease = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": str(self.version)},
        }
        return self.lease


def elector(store: Leases, identity: str, now: list[float], log: list[str]) -> LeaderElector:
    return LeaderElector(
        store,  # type: ignore[arg-type]
        "hyperpod-sdc",
        "leader",
        identity,
        8.0,
        on_start=lambda: log.append(f"{identity} leads"),
        on_stop=lambda: log.append(f"{identity} follows"),
        clock=lambda: now[0],
    )


def test_one_leads_the_other_takes_over_only_after_the_lease_runs_out() -> None:
    store, now = Leases(), [0.0]
    log: list[str] = []
    a, b = elector(store, "a", now, log), elector(store, "b", now, log)

    async def rounds(until: float, *who: LeaderElector) -> None:
        while now[0] < until:
            for e in who:
                await e.step()
            now[0] += a.retry_seconds

    asyncio.run(rounds(10, a, b))
    assert (a.is_leader, b.is_leader) == (True, False)
    assert log == ["a leads"]
    # a dies: b waits for the Lease to run out on its own clock, then leads
    died = now[0]
    asyncio.run(rounds(died + 7.9, b))
    assert not b.is_leader
    asyncio.run(rounds(died + 12.0, b))
    assert b.is_leader and log == ["a leads", "b leads"]
    assert store.lease is not None and store.lease["spec"]["leaseTransitions"] == 1


def test_a_leader_that_cannot_renew_stops_acting_before_anyone_may_take_over() -> None:
    store, now = Leases(), [0.0]
    log: list[str] = []
    a = elector(store, "a", now, log)
    asyncio.run(a.step())
    assert a.is_leader
    store.down = True

    async def loop_for(seconds: float) -> None:
        task = asyncio.ensure_future(a.run())
        end = now[0] + seconds
        while now[0] < end:
            await asyncio.sleep(0)
            now[0] += 0.01
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    a.retry_seconds = 0.0
    asyncio.run(loop_for(5.7))
    assert not a.is_leader, "still acting 5.7 s without renewing an 8 s Lease"
    assert log == ["a leads", "a follows"]


def test_silence_is_decided_on_what_either_replica_heard() -> None:
    now = [1000.0]
    beats = Heartbeats(Metrics(), clock=lambda: now[0])
    job = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "train", "u1")
    report = HeartbeatReport(ReporterIdentity(0, "n0", "p0"), 1000.0, 120, 100, interval_seconds=30)
    beats.observe(job, "n0", report)
    now[0] = 1000.0 + 120  # past the floor (100 s) but not past 3 intervals (90 s)? both: 120
    went, came = beats.silent(100.0, {}, lambda _: True)
    assert [b.job.name for b in went] == ["train"]
    # the other replica heard from the job recently: not silent
    beats2 = Heartbeats(Metrics(), clock=lambda: now[0])
    beats2.observe(job, "n0", report)
    went, _ = beats2.silent(100.0, {"ml/u1": now[0] - 5}, lambda _: True)
    assert went == []
    # heard again
    beats.observe(job, "n0", report)
    went, came = beats.silent(100.0, {}, lambda _: True)
    assert (went, [b.job.name for b in came]) == ([], ["train"])
    # a job that is not running any more is forgotten, never silent
    now[0] += 1000
    went, _ = beats.silent(100.0, {}, lambda _: False)
    assert went == [] and beats.jobs == {}


# timing: the leader stops by its renew deadline, 2.8 s; asserted under the 4 s Lease: 1.2 s margin
@pytest.mark.timing
def test_a_leader_whose_renewal_hangs_stops_acting_by_its_renew_deadline() -> None:
    """A partition leaves the renewal's connection open and silent: the leader must stop
    acting by its renew deadline (0.7 of the Lease: 2.8 s), before a standby may take over
    (4 s), not when the call times out (30 s)."""
    store, log = Leases(), []
    a = LeaderElector(
        store,  # type: ignore[arg-type]
        "hyperpod-sdc",
        "leader",
        "a",
        4.0,
        on_start=lambda: log.append("a leads"),
        on_stop=lambda: log.append("a follows"),
    )

    async def hang() -> float:
        await a.step()
        assert a.is_leader
        store.hung = True
        started = time.monotonic()
        task = asyncio.ensure_future(a.run())
        while a.is_leader and time.monotonic() - started < 10:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - started

    took = asyncio.run(hang())
    assert log == ["a leads", "a follows"]
    assert took < 4.0, f"acted {took:.1f} s without renewing a 4 s Lease"


class _Answered:
    """One replica's view of the Lease store: ``late`` runs after a replace is written and
    before its answer comes back (the answer delayed on the way); ``down`` cuts this
    replica off."""

    def __init__(self, store: Leases) -> None:
        self.store = store
        self.late: Any = None
        self.down = False

    async def get(self, *args: Any) -> Any:
        if self.down:
            raise ApiError(0, "unreachable")
        return await self.store.get(*args)

    async def create(self, *args: Any) -> Any:
        return await self.store.create(*args)

    async def replace(self, *args: Any) -> Any:
        if self.down:
            raise ApiError(0, "unreachable")
        written = await self.store.replace(*args)
        if self.late is not None:
            late, self.late = self.late, None
            await late()
        return written


def test_a_renewal_answered_late_does_not_lengthen_the_leaders_term() -> None:
    """a's renewal is written at t=1 and b sees it then; its answer reaches a at t=6. b
    may take over 8 s after it saw the renewal (t=9): a must have stopped acting by then,
    having counted its term from t=1 (when it sent the renewal), not from t=6."""
    store, now = Leases(), [0.0]
    log: list[str] = []
    view_a, view_b = _Answered(store), _Answered(store)
    a = elector(view_a, "a", now, log)  # type: ignore[arg-type]
    b = elector(view_b, "b", now, log)  # type: ignore[arg-type]
    overlap: list[float] = []

    async def scenario() -> None:
        await a.step()
        await b.step()
        now[0] = 1.0

        async def answered_late() -> None:
            await b.step()  # b sees the renewal as written
            now[0] = 6.0

        view_a.late = answered_late
        await a.step()
        assert a.is_leader and now[0] == 6.0
        view_a.down = True  # a cannot renew again
        a.retry_seconds = 0.0
        task = asyncio.ensure_future(a.run())
        while now[0] < 14.0:
            await asyncio.sleep(0)
            now[0] = round(now[0] + 0.01, 2)
            if round(now[0] * 100) % 20 == 0:
                await b.step()
            if a.is_leader and b.is_leader:
                overlap.append(now[0])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert b.is_leader and not a.is_leader
    assert overlap == [], f"both acted from t={overlap[0]} to t={overlap[-1]}"
    assert log == ["a leads", "a follows", "b leads"]


def test_only_the_leader_exports_the_leader_owned_gauges() -> None:
    """A replica that steps down stops exporting its last counts (max() over the replicas
    would otherwise alert on them for ever); when it leads again it exports them anew."""
    from prometheus_client import generate_latest

    metrics = Metrics()

    def exported() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(("hyperpod_sdc_quarantined_nodes", "hyperpod_sdc_silent_jobs"))
        }

    assert exported() == {}  # not leading yet
    metrics.lead(True)
    metrics.quarantined_nodes.set(3)
    metrics.silent_jobs.set(2)
    assert exported() == {"hyperpod_sdc_quarantined_nodes": 3.0, "hyperpod_sdc_silent_jobs": 2.0}
    metrics.lead(False)
    assert exported() == {}
    assert "hyperpod_sdc_leader 0.0" in generate_latest(metrics.registry).decode()
    metrics.lead(True)
    assert exported() == {"hyperpod_sdc_quarantined_nodes": 0.0, "hyperpod_sdc_silent_jobs": 0.0}


def test_a_standby_forgets_the_jobs_that_stopped() -> None:
    """Only the leader decides silence, but every replica prunes: a standby's
    heartbeat_age for a deleted job must not grow for a day."""
    from prometheus_client import generate_latest

    now = [1000.0]
    metrics = Metrics()
    beats = Heartbeats(metrics, clock=lambda: now[0])
    job = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "train", "u1")
    report = HeartbeatReport(ReporterIdentity(0, "n0", "p0"), 1000.0, 120, 100, interval_seconds=30)
    beats.observe(job, "n0", report)
    beats.prune(lambda _: True)
    beats.refresh(window=600)
    assert (
        'hyperpod_sdc_heartbeat_age_seconds{job="train"'
        in generate_latest(metrics.registry).decode()
    )
    now[0] += 300
    beats.prune(lambda _: False)  # the job was deleted
    beats.refresh(window=600)
    assert beats.jobs == {}
    assert "hyperpod_sdc_heartbeat_age_seconds{" not in generate_latest(metrics.registry).decode()


def test_a_saturated_event_loop_does_not_cost_the_lease() -> None:
    """The operator's event loop blocked for 3 s (a storm of handshakes and reports), with
    a 1 s Lease (renewed every 0.2 s, given up after 0.7 s unrenewed): the election on its
    own thread and loop keeps renewing and never stops acting. The same election on the
    blocked loop itself (as before) gives the Lease up, which shows the test can fail."""
    from sdc_operator.leader import ElectionThread

    async def block(threaded: bool) -> tuple[list[str], int]:
        leases = Leases()
        events: list[str] = []
        kwargs: dict[str, Any] = {
            "on_start": lambda: events.append("start"),
            "on_stop": lambda: events.append("stop"),
        }
        elector: Any = (
            ElectionThread(leases, "ns", "lease", "me", 1.0, **kwargs)  # type: ignore[arg-type]
            if threaded
            else LeaderElector(leases, "ns", "lease", "me", 1.0, **kwargs)  # type: ignore[arg-type]
        )
        elector.start()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if events:
                break
        assert events == ["start"] and elector.is_leader
        before = leases.version
        time.sleep(3.0)  # the loop runs nothing at all
        await asyncio.sleep(0.5)  # and then catches up
        renewed = leases.version - before
        if threaded:
            assert elector.is_leader
        await elector.stop()
        return events, renewed

    events, renewed = asyncio.run(block(threaded=True))
    assert events == ["start", "stop"], events  # the stop is the clean shutdown's
    assert renewed >= 10, f"{renewed} renewals in 3.5 s"
    events, renewed = asyncio.run(block(threaded=False))
    assert events[:2] == ["start", "stop"], "the election on the blocked loop kept its Lease"


class _Acting:
    """A reconcile that makes API calls for as long as the engine says it leads: when each
    was sent and when each ended (answered or cancelled)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.sent: list[float] = []
        self.ended: list[float] = []
        self.running = False

    async def reconcile(self, namespace: str, name: str) -> None:
        self.running = True
        try:
            while True:
                at = time.monotonic()  # before the check: a call that saw "leader" is earlier
                if not self.engine.leader:
                    return
                self.sent.append(at)
                try:
                    await asyncio.sleep(0.005)  # one containment API call
                finally:
                    self.ended.append(time.monotonic())
        finally:
            self.running = False


def _storm(busy: list[bool]) -> None:
    """A turn of the intake's loop that takes 20 ms, queued again while ``busy``."""
    time.sleep(0.02)
    if busy[0]:
        asyncio.get_running_loop().call_soon(_storm, busy)


@pytest.mark.timing
def test_a_leader_that_loses_the_lease_stops_acting_while_the_intakes_loop_is_busy() -> None:
    """The renewals fail while a storm holds the intake's loop: the election stops leading
    (after 0.7 s with a 1 s Lease), and the engine on its own lane makes no API call after
    that, although the intake's loop takes the "stop acting" in only 0.5 s later. The old
    wiring (the stop reaching the engine through the intake's loop only) goes on acting
    meanwhile, which shows the test can fail. No fixed wait: the loop is held until the
    election has stopped leading, then 0.5 s more. Timing: only the old wiring's count
    depends on it (measured 83 calls, the last 0.50 s late, on the loaded 2-core machine,
    against the asserted > 10 and > 0.3 s)."""
    from sdc_operator.engine import IncidentEngine
    from sdc_operator.lane import LoopThread
    from sdc_operator.leader import ElectionThread
    from sdc_operator.settings import OperatorSettings
    from tests.operator.test_resync import Caches

    async def lose(wired: bool) -> tuple[_Acting, float]:
        lane = LoopThread("incident engine")
        lane.start()
        nothing: Any = None
        fake: Any = Caches("a")
        engine = IncidentEngine(
            OperatorSettings(), Metrics(), fake, records=nothing, containment=nothing, lane=lane
        )
        acting = _Acting(engine)
        engine.reconcile = acting.reconcile  # type: ignore[method-assign]
        stopped: list[float] = []

        def stop_acting() -> None:  # on the election's thread
            if wired:
                engine.stop_acting()
            stopped.append(time.monotonic())

        leases = Leases()
        election = ElectionThread(
            leases,  # type: ignore[arg-type]
            "ns",
            "lease",
            "me",
            1.0,
            on_start=engine.become_leader,
            on_stop=engine.become_standby,
            stop_acting=stop_acting,
        )
        election.start()
        for _ in range(200):
            await asyncio.sleep(0.02)
            if engine.leader:
                break
        engine.schedule("ml", "a")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if acting.sent:
                break
        leases.down = True  # the renewals fail from now on
        deadline = time.monotonic() + 10.0
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.01)  # the intake's loop busy with a storm
        assert stopped, "the election never stopped leading"
        time.sleep(0.5)
        for _ in range(200):  # the loop takes the "stop acting" in; the reconcile ends
            await asyncio.sleep(0.01)
            if not acting.running:
                break
        assert not acting.running
        await election.stop()
        await engine.close()
        await lane.stop()
        return acting, stopped[0]

    acting, stopped = asyncio.run(lose(wired=True))
    assert acting.sent and [t for t in acting.sent if t > stopped] == []
    acting, stopped = asyncio.run(lose(wired=False))
    late = [t - stopped for t in acting.sent if t > stopped]
    assert len(late) > 10 and max(late) > 0.3, late


@pytest.mark.timing
def test_a_clean_stop_ends_the_engines_calls_before_it_gives_the_lease_up() -> None:
    """Operator.stop while a storm keeps the intake's loop busy: the engine's calls stop,
    and those in flight end, before the Lease is given up (holderIdentity ""), so the
    replica that takes over next never acts at the same time. The old order (the Lease
    given up first, the engine stopped through the intake's loop) goes on calling after
    it, which shows the test can fail. Timing: only the old order's count depends on it
    (measured 30 calls after the Lease was given up, loaded, against the asserted >= 5)."""
    from sdc_operator.handlers import Operator
    from sdc_operator.kube import Endpoint
    from sdc_operator.settings import OperatorSettings

    class Released(Leases):
        at: float | None = None

        async def replace(self, api_version: str, plural: str, ns: Any, body: Any) -> Any:
            written = await super().replace(api_version, plural, ns, body)
            if body["spec"]["holderIdentity"] == "":
                self.at = time.monotonic()
            return written

    async def stop(old_order: bool) -> tuple[_Acting, float]:
        settings = OperatorSettings.from_env({"HYPERPOD_SDC_LEASE_SECONDS": "10"})
        operator = Operator(settings, Endpoint("https://127.0.0.1:1", False))
        leases = Released()
        operator.coordination = leases  # type: ignore[assignment]
        acting = _Acting(operator.engine)
        operator.engine.reconcile = acting.reconcile  # type: ignore[method-assign]
        operator.lane.start()
        operator._elect()
        for _ in range(200):
            await asyncio.sleep(0.02)
            if operator.engine.leader:
                break
        operator.engine.schedule("ml", "a")
        for _ in range(200):
            await asyncio.sleep(0.01)
            if acting.sent:
                break
        busy = [True]
        for _ in range(10):  # each turn of the loop waits 0.2 s behind them
            asyncio.get_running_loop().call_soon(_storm, busy)
        if old_order:  # as before: the Lease first, the engine through the intake's loop
            assert operator.elector is not None
            operator.elector._stop_acting = lambda: None
            await operator.elector.stop()
            busy[0] = False
            for _ in range(200):
                await asyncio.sleep(0.01)
                if not acting.running:
                    break
        await operator.stop()
        busy[0] = False
        assert leases.at is not None, "the Lease was not given up"
        assert not acting.running
        return acting, leases.at

    acting, released = asyncio.run(stop(old_order=False))
    assert acting.sent and max(acting.ended) < released
    acting, released = asyncio.run(stop(old_order=True))
    late = [t - released for t in acting.sent if t > released]
    assert len(late) >= 5, late
