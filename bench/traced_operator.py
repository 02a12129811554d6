"""``python -m bench.traced_operator``: the operator (``python -m sdc_operator``) with a
timeline written to the file ``SDC_BENCH_TRACE`` names when it stops (SIGTERM), as JSON:

- ``api``: every call to the API server (pool, method, resource, start, end; unix seconds),
  as the calling coroutine saw it: the API server's time plus any wait for the event loop;
- ``lag``: the event loop's lateness, from a task that sleeps 5 ms at a time (start, lag),
  where it was over 20 ms;
- ``stacks``: the event loop's thread sampled every 5 ms (time, its innermost frames).

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

TRACE: dict[str, list[Any]] = {"api": [], "lag": [], "stacks": []}


def _trace_requests() -> None:
    request = kube.Kube.request

    async def traced(self: kube.Kube, method: str, path: str, **kw: Any) -> dict[str, Any]:
        began = time.time()
        try:
            return await request(self, method, path, **kw)
        finally:
            TRACE["api"].append([self.name, method, kw.get("resource"), began, time.time()])

    kube.Kube.request = traced  # type: ignore[method-assign]


def _trace_loop() -> None:
    start = handlers.Operator.start

    async def started(self: handlers.Operator) -> None:
        await start(self)
        loop = asyncio.get_running_loop()
        main_thread = threading.get_ident()

        async def lateness() -> None:
            while True:
                before = loop.time()
                await asyncio.sleep(0.005)
                late = loop.time() - before - 0.005
                if late > 0.02:
                    TRACE["lag"].append([time.time() - late, round(late, 4)])

        def sample() -> None:
            while True:
                time.sleep(0.005)
                frame = sys._current_frames().get(main_thread)
                names: list[str] = []
                while frame is not None and len(names) < 12:
                    code = frame.f_code
                    names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    frame = frame.f_back
                TRACE["stacks"].append([time.time(), names])

        self._loops.append(loop.create_task(lateness()))
        threading.Thread(target=sample, name="trace sampler", daemon=True).start()

    handlers.Operator.start = started  # type: ignore[method-assign]


if __name__ == "__main__":
    _trace_requests()
    _trace_loop()
    try:
        code = main()
    finally:
        with open(os.environ["SDC_BENCH_TRACE"], "w") as out:
            json.dump(TRACE, out)
    sys.exit(code)
