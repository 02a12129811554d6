"""The reporter against a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sdc_agent.launch import free_port
from sdc_agent.protocol import (
    CheckpointReport,
    HeartbeatReport,
    ReporterIdentity,
    VerdictReport,
    parse_report,
)
from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_harness.tls import ca_and_certificate

ME = ReporterIdentity(rank=0, node="hyperpod-i-0abc", pod="job-worker-0")


class Operator:
    """A stand-in intake: records what arrives; answers with ``statuses`` in turn (then
    200), after ``delay`` seconds."""

    def __init__(
        self,
        port: int,
        *,
        delay: float = 0.0,
        statuses: list[int] | None = None,
        retry_after: str | None = None,
        keep_alive: bool = False,
        drop_idle: bool = False,
    ):
        self.received: list[tuple[dict[str, str], Any]] = []
        self.arrived: list[tuple[float, str]] = []
        """Every request: when (monotonic), and the kind of report."""
        self.delay = delay
        self.statuses = list(statuses or [])
        self.retry_after = retry_after
        self.connections = 0
        """Connections accepted."""
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            # HTTP/1.1: the connection stays open between requests (HTTP/1.0: one each);
            # drop_idle: it is closed after each answer, unannounced, as an idle timeout would
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def setup(self) -> None:
                super().setup()
                owner.connections += 1

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(owner.delay)
                status = owner.statuses.pop(0) if owner.statuses else 200
                owner.arrived.append((time.monotonic(), parse_report(body).kind))
                if status == 200:
                    owner.received.append((dict(self.headers), parse_report(body)))
                self.send_response(status)
                if status != 200 and owner.retry_after is not None:
                    self.send_header("Retry-After", owner.retry_after)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                if drop_idle:
                    self.wfile.flush()
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kinds(self) -> list[str]:
        return [r.kind for _, r in self.received]


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-one\n")
    return path


def make(port: int, token: Path | None, **kw: Any) -> Reporter:
    kw.setdefault("initial_backoff_seconds", 0.05)
    kw.setdefault("max_backoff_seconds", 0.2)
    return Reporter(
        ReporterConfig(
            operator_url=f"http://127.0.0.1:{port}",
            token_file=str(token) if token else None,
            **kw,
        )
    )


@pytest.fixture
def operator(port: int) -> Iterator[Operator]:
    op = Operator(port)
    yield op
    op.stop()


def verdict(step: int) -> VerdictReport:
    return VerdictReport(
        reporter=ME,
        sent_at=time.time(),
        check="replay",
        classification="rank",
        step=step,
        last_clean_step=step - 1,
        localized=True,
        transient=False,
        suspects=(),
        message=f"verdict {step}",
    )


def heartbeat(step: int) -> HeartbeatReport:
    return HeartbeatReport(reporter=ME, sent_at=time.time(), step=step, last_clean_step=step)


def test_reports_arrive_intact_with_the_token(operator: Operator, port: int, token: Path) -> None:
    reporter = make(port, token)
    sent: list[VerdictReport | HeartbeatReport | CheckpointReport] = [
        verdict(7),
        heartbeat(8),
        CheckpointReport(reporter=ME, sent_at=1.0, step=8, location="/ckpt/step_8", verified=True),
    ]
    for r in sent:
        reporter.submit(r)
    assert reporter.close(timeout=10)
    assert [r for _, r in operator.received] == sent
    assert all(h["Authorization"] == "Bearer token-one" for h, _ in operator.received)
    assert operator.received[0][0]["Content-Type"] == "application/json"


def test_reports_go_on_one_kept_connection(port: int, token: Path) -> None:
    """Against an operator that keeps connections open (HTTP/1.1), every report goes on the
    one connection: a storm of a job's reports costs the operator no new TLS handshakes."""
    operator = Operator(port, keep_alive=True)
    reporter = make(port, token)
    try:
        for step in range(1, 6):
            reporter.submit(verdict(step) if step % 2 else heartbeat(step))
        assert reporter.flush(10)
        assert len(operator.received) == 5
        assert operator.connections == 1 and reporter.connections_opened == 1
    finally:
        reporter.close(timeout=1)
        operator.stop()


def test_a_connection_closed_while_idle_is_opened_again_at_once(port: int, token: Path) -> None:
    """The operator closes the kept connection after each answer (its idle timeout): the next
    report goes on a new connection at once, not after a back-off, and none is lost."""
    operator = Operator(port, keep_alive=True, drop_idle=True)
    reporter = make(port, token, initial_backoff_seconds=30.0, max_backoff_seconds=30.0)
    try:
        for step in range(1, 5):
            reporter.submit(verdict(step))
            assert reporter.flush(5), "a report waited out a back-off"
        assert [r.step for _, r in operator.received] == [1, 2, 3, 4]
        assert operator.connections == 4 and reporter.delivered == 4
    finally:
        reporter.close(timeout=1)
        operator.stop()


def test_a_rotated_token_is_read_again(operator: Operator, port: int, token: Path) -> None:
    reporter = make(port, token)
    reporter.submit(heartbeat(1))
    assert reporter.flush(10)
    token.write_text("token-two-rotated\n")
    reporter.submit(heartbeat(2))
    assert reporter.close(10)
    assert [h["Authorization"] for h, _ in operator.received] == [
        "Bearer token-one",
        "Bearer token-two-rotated",
    ]


def _submit_seconds(reporter: Reporter, count: int) -> list[float]:
    times = []
    for step in range(count):
        start = time.perf_counter()
        reporter.submit(heartbeat(step) if step % 10 else verdict(step + 1))
        times.append(time.perf_counter() - start)
    return times


def test_an_outage_does_not_block_and_nothing_is_lost(port: int, token: Path) -> None:
    reporter = make(port, token)  # nobody listens yet
    times = _submit_seconds(reporter, 50)
    # Measured, not a benchmark: submitting is a queue append while every send fails.
    assert max(times) < 0.05, f"submit blocked: max {max(times):.4f} s"
    time.sleep(0.3)  # a few failed attempts
    assert reporter.delivered == 0
    assert reporter.verdict_overdue(0.1)
    operator = Operator(port)
    try:
        assert reporter.close(timeout=20)
        kinds = operator.kinds()
        assert len(kinds) == 50
        assert kinds[:5] == ["verdict"] * 5  # verdicts go first
        assert not reporter.verdict_overdue(0.1)
    finally:
        operator.stop()
    print(
        json.dumps(
            {
                "submit_during_outage_ms": {
                    "median": statistics.median(times) * 1e3,
                    "max": max(times) * 1e3,
                }
            }
        )
    )


# timing: submit() asserted < 50 ms while each request takes 200 ms (it only appends to a queue)
@pytest.mark.timing
def test_a_slow_operator_does_not_slow_the_caller(port: int, token: Path) -> None:
    operator = Operator(port, delay=0.2)
    try:
        reporter = make(port, token)
        times = _submit_seconds(reporter, 11)  # two verdicts, nine heartbeats
        assert max(times) < 0.05, f"submit blocked: max {max(times):.4f} s"
        assert reporter.delivered == 0  # the first request is still in flight
        assert reporter.close(timeout=60)
        assert len(operator.received) == 11
    finally:
        operator.stop()


def test_a_full_queue_drops_the_oldest_heartbeats_never_a_verdict(port: int, token: Path) -> None:
    reporter = make(port, token, queue_size=3)
    for step in range(1, 7):
        reporter.submit(heartbeat(step))
    reporter.submit(verdict(7))
    reporter.submit(verdict(8))
    assert reporter.dropped == 3
    operator = Operator(port)
    try:
        assert reporter.close(timeout=20)
        got = [(r.kind, r.step) for _, r in operator.received]
        assert sorted(got) == sorted(
            [("verdict", 7), ("verdict", 8), ("heartbeat", 4), ("heartbeat", 5), ("heartbeat", 6)]
        )
    finally:
        operator.stop()


def test_server_errors_are_retried_refusals_are_not(port: int, token: Path) -> None:
    operator = Operator(port, statuses=[503, 429])
    try:
        reporter = make(port, token)
        reporter.submit(heartbeat(1))  # 503, 429, then delivered
        assert reporter.flush(10)
        operator.statuses = [400]
        reporter.submit(heartbeat(2))  # refused, dropped, not retried
        assert reporter.close(10)
        assert [r.step for _, r in operator.received] == [1]
        assert (reporter.delivered, reporter.refused) == (1, 1)
    finally:
        operator.stop()


def test_a_shed_heartbeat_waits_its_retry_after_and_a_verdict_goes_meanwhile(
    port: int, token: Path
) -> None:
    """The operator sheds a heartbeat (429, Retry-After: 2): it is sent again no sooner
    than 2 s later (its back-off alone would be at most 0.2 s), and a verdict submitted in
    between is delivered at once. Before: the Reporter's thread slept through its back-off,
    verdicts included, and ignored Retry-After."""
    operator = Operator(port, statuses=[429], retry_after="2")
    try:
        reporter = make(port, token, heartbeat_jitter_seconds=0)
        began = time.monotonic()
        reporter.submit(heartbeat(1))
        while not operator.arrived:
            time.sleep(0.01)
        time.sleep(0.3)
        reporter.submit(verdict(2))
        assert reporter.flush(10)
        (shed, first), (verdict_at, second), (again, third) = operator.arrived
        assert (first, second, third) == ("heartbeat", "verdict", "heartbeat")
        assert verdict_at - shed < 1.0, "the verdict waited behind the heartbeat's Retry-After"
        assert again - shed >= 1.9, f"sent again after {again - shed:.2f} s, not 2"
        assert [r.kind for _, r in operator.received] == ["verdict", "heartbeat"]
        assert time.monotonic() - began < 5
        assert reporter.refused == 0
    finally:
        operator.stop()


def test_heartbeats_are_spread_with_jitter_verdicts_are_not(port: int, token: Path) -> None:
    """A heartbeat waits a random 0 to ``heartbeat_jitter_seconds``; a verdict submitted
    with it (the same audit step) goes at once, and flush() sends what waits for jitter."""
    operator = Operator(port)
    try:
        waits = []
        for step in range(1, 9):  # (a verdict's last clean step, step - 1, is >= 0)
            reporter = make(port, token, heartbeat_jitter_seconds=0.5)
            submitted = time.monotonic()
            reporter.submit(heartbeat(step))
            reporter.submit(verdict(step))
            while len(operator.arrived) < 2 * step:
                time.sleep(0.005)
            (verdict_at, v), (heartbeat_at, h) = operator.arrived[-2:]
            assert (v, h) == ("verdict", "heartbeat")
            assert verdict_at - submitted < 0.3
            waits.append(heartbeat_at - submitted)
            reporter.close(1)
        assert max(waits) <= 1.0 and max(waits) - min(waits) > 0.05, waits  # spread, bounded
        reporter = make(port, token, heartbeat_jitter_seconds=60)
        reporter.submit(heartbeat(99))
        assert reporter.flush(2), "flush() waited for the jitter"
        assert operator.kinds()[-1] == "heartbeat"
    finally:
        operator.stop()


def test_held_heartbeats_wait_the_hold_and_verdicts_do_not(port: int, token: Path) -> None:
    """hold_heartbeats(0.6) (a step with a verdict): a heartbeat submitted then arrives no
    sooner than 0.6 s later (a lower bound only: load can only delay it), a verdict
    submitted with it at once; flush() sends what is held."""
    operator = Operator(port)
    try:
        reporter = make(port, token, heartbeat_jitter_seconds=0)
        held = time.monotonic()
        reporter.hold_heartbeats(0.6)
        reporter.submit(heartbeat(1))
        reporter.submit(verdict(2))
        while len(operator.arrived) < 2:
            time.sleep(0.01)
        (_, first), (heartbeat_at, second) = operator.arrived
        assert (first, second) == ("verdict", "heartbeat")
        assert heartbeat_at - held >= 0.55, f"held {heartbeat_at - held:.2f} s, not 0.6"
        reporter.hold_heartbeats(60)
        reporter.submit(heartbeat(3))
        assert reporter.flush(5), "flush() waited for the hold"
        assert operator.kinds()[-1] == "heartbeat"
    finally:
        operator.stop()


def test_a_checkpoint_record_goes_ahead_of_held_heartbeats(port: int, token: Path) -> None:
    """After a step with a verdict the heartbeats are held, not the checkpoint records: the
    operator waits for the verified snapshot's record before it stops the job (before, the
    record queued behind the hold, 10 s plus the jitter)."""
    operator = Operator(port)
    try:
        reporter = make(port, token, heartbeat_jitter_seconds=0)
        reporter.hold_heartbeats(60)
        reporter.submit(heartbeat(1))
        reporter.submit(CheckpointReport(ME, time.time(), 2, "/ckpt/sdc-snapshot-step_2", True))
        deadline = time.monotonic() + 30
        while "checkpoint" not in operator.kinds() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert operator.kinds() == ["checkpoint"], "the record waited for the hold"
        assert reporter.flush(5)
        assert operator.kinds() == ["checkpoint", "heartbeat"]
    finally:
        operator.stop()


def test_settings_are_checked(tmp_path: Path) -> None:
    from sdc_agent.errors import ConfigError

    with pytest.raises(ConfigError, match="^operator_url:"):
        ReporterConfig(operator_url="hyperpod-sdc:8443")
    with pytest.raises(ConfigError, match="^ca_bundle:"):
        ReporterConfig(operator_url="https://x", ca_bundle=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="^queue_size:"):
        ReporterConfig(operator_url="https://x", queue_size=0)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPERPOD_SDC_OPERATOR_URL", raising=False)
    assert ReporterConfig.from_env() is None
    monkeypatch.setenv("HYPERPOD_SDC_OPERATOR_URL", "https://hyperpod-sdc.svc:8443")
    monkeypatch.setenv("HYPERPOD_SDC_TOKEN_FILE", "/tok")
    c = ReporterConfig.from_env()
    assert c is not None
    assert (c.operator_url, c.token_file) == ("https://hyperpod-sdc.svc:8443", "/tok")


def test_a_report_that_cannot_be_sent_does_not_stop_the_thread(
    operator: Operator, port: int, token: Path
) -> None:
    import dataclasses

    reporter = make(port, token)
    reporter.submit(dataclasses.replace(verdict(3), message="x" * 5000))  # over the limit
    reporter.submit(heartbeat(4))
    assert reporter.close(10)
    assert reporter.dropped == 1
    assert [(r.kind, r.step) for _, r in operator.received] == [("heartbeat", 4)]


def test_overdue_counts_from_the_oldest_undelivered_verdict(port: int, token: Path) -> None:
    reporter = make(port, token, initial_backoff_seconds=0.01, max_backoff_seconds=0.02)
    assert not reporter.verdict_overdue(0.0)
    reporter.submit(verdict(1))
    time.sleep(0.3)
    assert reporter.verdict_overdue(0.2)
    operator = Operator(port)
    try:
        assert reporter.flush(10)
        reporter.submit(verdict(2))  # a new verdict starts its own clock
        assert not reporter.verdict_overdue(0.2)
        assert reporter.close(10)
    finally:
        operator.stop()


def _project(directory: Path, version: str, ca: Path) -> None:
    """Update ``directory/ca.crt`` as the kubelet updates a mounted ConfigMap: the new
    content in a new directory, then one rename of the ``..data`` symlink."""
    import os

    (directory / version).mkdir()
    (directory / version / "ca.crt").write_bytes(ca.read_bytes())
    (directory / "..data_tmp").symlink_to(version)
    os.replace(directory / "..data_tmp", directory / "..data")
    if not (directory / "ca.crt").is_symlink():
        (directory / "ca.crt").symlink_to("..data/ca.crt")


def test_a_rotated_ca_bundle_is_read_again(port: int, token: Path, tmp_path: Path) -> None:
    """The operator's certificate and the CA the pod mounts are both replaced: the reporter
    keeps delivering, and it needs the new CA to (the old one no longer verifies)."""
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    first = ca_and_certificate(tmp_path, "first")
    second = ca_and_certificate(tmp_path, "second")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(first[1], first[2])
    operator = Operator(port)
    operator.server.socket = server_tls.wrap_socket(operator.server.socket, server_side=True)
    mounted = tmp_path / "ca"
    mounted.mkdir()
    _project(mounted, "..v1", first[0])
    reporter = Reporter(
        ReporterConfig(
            operator_url=f"https://127.0.0.1:{port}",
            token_file=str(token),
            ca_bundle=str(mounted / "ca.crt"),
            initial_backoff_seconds=0.05,
            max_backoff_seconds=0.2,
        )
    )
    try:
        reporter.submit(heartbeat(1))
        assert reporter.flush(10)
        # the operator's certificate is renewed by a new CA; the pod still has the old CA
        server_tls.load_cert_chain(second[1], second[2])
        reporter.submit(heartbeat(2))
        assert not reporter.flush(1.0), "the old CA verified the new certificate"
        _project(mounted, "..v2", second[0])  # the operator republished its CA
        assert reporter.flush(10)
        assert [r.step for _, r in operator.received] == [1, 2]
        assert reporter.delivered == 2 and reporter.refused == 0
    finally:
        reporter.close(timeout=1)
        operator.stop()


@pytest.mark.parametrize("status", [400, 401, 403, 413, 422])
def test_a_refused_verdict_counts_as_undelivered_and_is_logged_each_time(
    port: int, token: Path, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    operator = Operator(port, statuses=[status, status, status])
    try:
        reporter = make(port, token)
        reporter.submit(heartbeat(1))  # refused: logged, but no verdict is at stake
        assert reporter.flush(10)
        assert not reporter.verdict_overdue(0.0)
        reporter.submit(verdict(2))
        reporter.submit(verdict(3))
        assert reporter.flush(10)
        assert not reporter.verdict_overdue(5.0)
        time.sleep(0.25)
        assert reporter.verdict_overdue(0.2)  # never delivered: unreachable_policy=stop fires
        reporter.submit(verdict(4))  # delivered: the refused ones still count
        assert reporter.close(10)
        assert reporter.verdict_overdue(0.2)
    finally:
        operator.stop()
    counters = reporter.counters()
    assert counters["refused"] == 3 and counters["refused_verdicts"] == 2
    assert counters["refusals"] == {status: 3}
    assert counters["delivered"] == 1 and counters["undeliverable_verdict"] is True
    loud = [
        r for r in caplog.records if r.levelname == "ERROR" and "REFUSED a verdict" in r.message
    ]
    assert len(loud) == 2, [r.message for r in caplog.records]
    assert all(f"HTTP {status}" in r.message for r in loud)


def test_a_verdict_that_cannot_be_encoded_counts_as_undelivered(
    operator: Operator, port: int, token: Path
) -> None:
    import dataclasses

    reporter = make(port, token)
    reporter.submit(dataclasses.replace(verdict(3), message="x" * 5000))  # over the limit
    assert reporter.close(10)
    time.sleep(0.05)
    assert reporter.verdict_overdue(0.01)


def test_the_back_off_never_overflows() -> None:
    from sdc_agent.reporter import _backoff

    assert _backoff(0, 0.5, 30.0) == 0.5
    assert _backoff(3, 0.5, 30.0) == 4.0
    assert _backoff(10_000, 0.5, 30.0) == 30.0  # 0.5 * 2**10000 would raise OverflowError
