"""A verdict the operator refuses stops training (``unreachable_policy="stop"``) as surely
as an unreachable operator does: refused is undelivered."""

from __future__ import annotations

import http.server
import threading

import pytest

from sdc_agent.drill import Drill, run_drill
from sdc_agent.launch import free_port
from sdc_agent.protocol import parse_report

from .test_reporting import CONFIG, FAULT, NODES

pytestmark = pytest.mark.distributed


class Refusing:
    """An intake that accepts heartbeats and answers every verdict 403, as the operator
    does for a namespace no SDCPolicy admits."""

    def __init__(self, port: int) -> None:
        self.refused = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                report = parse_report(self.rfile.read(int(self.headers["Content-Length"])))
                status = 403 if report.kind == "verdict" else 202
                if status == 403:
                    owner.refused += 1
                body = b'{"error": "namespace_not_admitted", "message": "no SDCPolicy"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_refused_verdict_stops_training_on_every_rank() -> None:
    port = free_port()
    operator = Refusing(port)
    env = {
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{port}",
        "HYPERPOD_SDC_TOKEN_FILE": "",
        "HYPERPOD_SDC_REPORT_DEADLINE_SECONDS": "0.5",
    }
    try:
        (ranks,) = run_drill(NODES, [Drill(steps=400, faults=(FAULT,), config=CONFIG)], env=env)
    finally:
        operator.stop()
    assert operator.refused > 0
    stops = {r.stopped.split(":")[0] if r.stopped else None for r in ranks}
    assert len(stops) == 1, "every rank must stop at the same step"
    (where,) = stops
    assert where is not None, "training went on although the operator refused the verdict"
    assert 4 < int(where.split()[1]) < 400
