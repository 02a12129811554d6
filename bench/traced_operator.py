"""``python -m bench.traced_operator``: the operator (``python -m sdc_operator``) with a
timeline written to the file ``SDC_BENCH_TRACE`` names when it stops (SIGTERM), as JSON:

- ``api``: every call to the API server (pool, method, resource, start, end; unix seconds;
  the calling thread), as the calling coroutine saw it: the API server's time plus any wait
  for the event loop;
- ``lag``: each event loop's lateness (the intake's, the verdict port's, the engine's), from
  a task that sleeps 5 ms at a time (start, lag, thread), where it was over 20 ms;
- ``stacks``: the threads of the intake's loop, the verdict port's and the engine's, sampled
  every 5 ms (time, thread, its innermost frames);
- ``spans``: the steps of each report (``post``: from its handler's start to its answer;
  ``authenticate``, ``check``, ``resolve``, ``record``), and the verdict port's connections
  (``accept`` to ``handshake``), as (step, thread, lane or site, start, end);
- ``holds``: when the intake's main port was held and let go (``listeners.Hold``);
- ``cpu``: each of those threads' CPU seconds and seconds spent runnable, waiting for a core
  (``/proc/.../schedstat``: other processes using the cores), sampled every 50 ms (time,
  thread, ran, waited);
- ``machine``: every 50 ms, the CPU seconds of the whole machine (busy, idle) and of this
  process: what the others (the load generator, the API server, etcd) used beside it.

``bench/operator_scale.py --trace FILE`` runs it. Sampling takes the GIL 200 times a second:
the timings it gives are a little worse than the operator's own."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

from sdc_operator import handlers, kube
from sdc_operator.__main__ import main

TRACE: dict[str, list[Any]] = {
    "api": [],
    "lag": [],
    "stacks": [],
    "spans": [],
    "holds": [],
    "cpu": [],
    "machine": [],
}
THREADS = ("MainThread", "verdict intake", "incident engine")
_ELSEWHERE: list[asyncio.Task[None]] = []
"""The lateness tasks on the verdict port's and the engine's loops."""


def _machine() -> tuple[float, float, float]:
    """CPU seconds so far: every core busy (``/proc/stat``), every core idle, and this
    process (every thread): what the rest of the machine used is the difference."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    with open("/proc/self/stat") as f:
        mine = f.read().rsplit(")", 1)[1].split()
    return (sum(fields[:8]) - idle) / tick, idle / tick, (int(mine[11]) + int(mine[12])) / tick


def _thread() -> str:
    return threading.current_thread().name


def _span(owner: Any, name: str, label: Any = None) -> None:
    """Wrap the coroutine method ``owner.name`` to record its spans."""
    inner = getattr(owner, name)

    async def spanned(self: Any, *args: Any, **kw: Any) -> Any:
        began = time.time()
        try:
            return await inner(self, *args, **kw)
        finally:
            tag = label(self, args) if label is not None else None
            TRACE["spans"].append([name, _thread(), tag, began, time.time()])

    setattr(owner, name, spanned)


def _trace_steps() -> None:
    from sdc_operator import auth, engine, intake, listeners

    def lane_of(self: Any, args: Any) -> Any:
        request = args[0]
        return [request.get(intake._LANE), self.verdicts_only]

    _span(intake.Intake, "post_report", lane_of)
    _span(intake.Intake, "_check", lambda self, args: self.verdicts_only)
    _span(intake.Intake, "_resolve_suspects", lambda self, args: self.verdicts_only)
    _span(auth.TokenReviewer, "authenticate")
    _span(engine.IncidentEngine, "record_verdict")
    _span(engine.IncidentEngine, "reconcile")

    accept = listeners.GuardedSite._accept

    def accepted(self: listeners.GuardedSite, transport: Any) -> None:
        began = time.time()
        accept(self, transport)
        TRACE["spans"].append(["accept", _thread(), self._label, began, time.time()])

    listeners.GuardedSite._accept = accepted  # type: ignore[method-assign]
    done = listeners.GuardedSite._handshake_done

    def handshaken(self: listeners.GuardedSite, source: str, waiter: Any) -> None:
        TRACE["spans"].append(["handshake", _thread(), self._label, time.time(), time.time()])
        done(self, source, waiter)

    listeners.GuardedSite._handshake_done = handshaken  # type: ignore[method-assign]
    hold = listeners.GuardedSite.hold

    def held(self: listeners.GuardedSite, on: bool) -> None:
        if on != self._held:
            TRACE["holds"].append([time.time(), on])
        hold(self, on)

    listeners.GuardedSite.hold = held  # type: ignore[method-assign,assignment]


def _trace_requests() -> None:
    request = kube.Kube.request

    async def traced(self: kube.Kube, method: str, path: str, **kw: Any) -> dict[str, Any]:
        began = time.time()
        try:
            return await request(self, method, path, **kw)
        finally:
            TRACE["api"].append(
                [self.name, method, kw.get("resource"), began, time.time(), _thread()]
            )

    kube.Kube.request = traced  # type: ignore[method-assign]


def _trace_loop() -> None:
    start = handlers.Operator.start

    async def started(self: handlers.Operator) -> None:
        await start(self)
        loop = asyncio.get_running_loop()

        async def lateness() -> None:
            while True:
                before = asyncio.get_running_loop().time()
                await asyncio.sleep(0.005)
                late = asyncio.get_running_loop().time() - before - 0.005
                if late > 0.02:
                    TRACE["lag"].append([time.time() - late, round(late, 4), _thread()])

        def sample() -> None:
            by_name = {t.name: t for t in threading.enumerate()}
            ids = {by_name[n].ident: n for n in THREADS if n in by_name}
            native = {n: by_name[n].native_id for n in THREADS if n in by_name}
            turn = 0
            while True:
                time.sleep(0.005)
                now = time.time()
                frames = sys._current_frames()
                for ident, thread in ids.items():
                    frame = frames.get(ident or 0)
                    names: list[str] = []
                    while frame is not None and len(names) < 12:
                        code = frame.f_code
                        names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                        frame = frame.f_back
                    TRACE["stacks"].append([now, thread, names])
                turn += 1
                if turn % 10 == 0:
                    for thread, tid in native.items():
                        try:
                            with open(f"/proc/self/task/{tid}/schedstat") as f:
                                ran, waited = (int(x) / 1e9 for x in f.read().split()[:2])
                        except OSError:
                            continue
                        TRACE["cpu"].append([now, thread, ran, waited])
                    TRACE["machine"].append([now, *_machine()])

        self._loops.append(loop.create_task(lateness()))
        for other in (self.lane, self.verdict_thread):
            if other.alive:
                other.call(lambda o=other: _ELSEWHERE.append(o.loop.create_task(lateness())))
        threading.Thread(target=sample, name="trace sampler", daemon=True).start()

    handlers.Operator.start = started  # type: ignore[method-assign]
    stop = handlers.Operator.stop

    async def stopped(self: handlers.Operator) -> None:
        # the lateness tasks on the other threads' loops end before those loops do
        for task in _ELSEWHERE:
            task.get_loop().call_soon_threadsafe(task.cancel)
        await stop(self)

    handlers.Operator.stop = stopped  # type: ignore[method-assign]


if __name__ == "__main__":
    _trace_requests()
    _trace_steps()
    _trace_loop()
    try:
        code = main()
    finally:
        with open(os.environ["SDC_BENCH_TRACE"], "w") as out:
            json.dump(TRACE, out)
    sys.exit(code)
