"""Sends reports to the operator from a background thread; never slows the training step.

:meth:`Reporter.submit` only appends to a bounded in-memory queue. A daemon thread posts
the reports, oldest first with verdicts ahead of everything else, and retries transient
failures (connection errors, timeouts, HTTP 408, 429 and 5xx) with exponential back-off
and full jitter. A report the operator refuses (any other 4xx: 400, 401, 403, 413, 422, ...)
is not retried, since it will not get better; it is logged at ERROR every time and counted
(:meth:`Reporter.counters`). A refused verdict counts as undelivered for ever: once it is
older than the deadline, :meth:`Reporter.verdict_overdue` says so and
``unreachable_policy="stop"`` stops training, as it does when the operator cannot be
reached. When the queue is full the oldest heartbeat goes first, then the oldest checkpoint
record; verdicts are never dropped.

Verdicts first, on both sides: a heartbeat waits a random ``0`` to
``heartbeat_jitter_seconds`` after it is submitted, so the heartbeats of a job's nodes,
submitted at the same step as an audit's verdicts, spread out behind them instead of
arriving with them; and a heartbeat or checkpoint record the operator answers 429 or 503
with ``Retry-After`` waits that long (its back-off, if longer) while verdicts still go at
once. :meth:`Reporter.flush` sends what waits for jitter at once.

Protocol versions (``docs/protocol.md``, "Versions"): reports are written in the newest
version both sides speak. The operator names the versions it accepts in the
``Hyperpod-Sdc-Protocol`` header of every answer; an operator from before that header
refuses a newer version with a 422 naming ``version``, and the reporter then writes the
version that operator speaks and sends the report again at once (not a refusal). What the
older version cannot carry, and what the operator says it ignored, is logged at WARNING
once per field, counted (:meth:`Reporter.counters`, ``unreported``) and named in every
heartbeat's ``unreported`` that can carry it.

One connection: the reporter keeps its HTTP/1.1 connection to the operator open between
reports and sends every report on it, so a job's storm of verdicts and heartbeats costs the
operator no TLS handshakes (docs/operator.md, "Memory and connections"). A connection the
operator closed while it was idle is opened again at once for the same report; one that
fails otherwise is closed, and the report is retried after the back-off as before.

The verdict port: where ``verdict_url`` is set (``HYPERPOD_SDC_VERDICT_URL``, injected by
operators that have one), every report but heartbeats goes there instead, on a connection
opened for it and closed after its answer (the operator serves that port on its own
thread, so a verdict is not read behind a burst of heartbeats; docs/operator.md, "Verdicts
first"). Where that fails before an answer (refused, reset, timed out: an operator without
the port, one at its connection limit, a network policy that drops it), the same attempt
goes at once on the kept connection to ``operator_url``, and so does every report for
:data:`VERDICT_PORT_PAUSE_SECONDS`.

Authentication: the Bearer token is read from ``token_file`` (a projected
ServiceAccount token) before each request whose file changed since the last read, so a
rotated token is picked up. TLS: the system trust store, or ``ca_bundle``, likewise read
again when the file changes (its modification time, size or inode: the kubelet updates a
mounted ConfigMap by swapping a symlink), so a rotated CA does not break delivery.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import json
import logging
import os
import random
import re
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from sdc_common.names import (
    CA_BUNDLE_ENV,
    DEFAULT_TOKEN_FILE,
    OPERATOR_URL_ENV,
    TOKEN_FILE_ENV,
    VERDICT_URL_ENV,
)

from ._validate import require_int, require_number
from .errors import ConfigError
from .protocol import (
    ACCEPTED_VERSIONS,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    CheckpointReport,
    HeartbeatReport,
    Report,
    VerdictReport,
    encode_report,
)

__all__ = [
    "CA_BUNDLE_ENV",
    "OPERATOR_URL_ENV",
    "TOKEN_FILE_ENV",
    "VERDICT_PORT_PAUSE_SECONDS",
    "VERDICT_URL_ENV",
    "Reporter",
    "ReporterConfig",
]

log = logging.getLogger("sdc_agent.reporter")

REPORTS_PATH = "/v1/reports"
HEARTBEAT_JITTER_ENV = "HYPERPOD_SDC_HEARTBEAT_JITTER_SECONDS"
_SPEAKS = re.compile(r"this side speaks (\d+)")
VERDICT_PORT_PAUSE_SECONDS = 60.0
"""After the verdict port failed without an answer, how long every report goes to the
intake's main URL instead (an operator without the port costs one failed attempt a minute:
a refused connection at once, one a network policy drops ``timeout_seconds``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReporterConfig:
    """Settings of :class:`Reporter`; :meth:`from_env` fills them from the environment."""

    operator_url: str
    """Base URL of the operator's intake, e.g. ``https://hyperpod-sdc.hyperpod-sdc.svc:8443``
    (env ``HYPERPOD_SDC_OPERATOR_URL``); reports go to ``<url>/v1/reports``."""
    verdict_url: str | None = None
    """Base URL of the intake's verdict listener, e.g.
    ``https://hyperpod-sdc.hyperpod-sdc.svc:8444``: every report but heartbeats goes there,
    each on a connection of its own; ``None``: everything goes to ``operator_url`` (env
    ``HYPERPOD_SDC_VERDICT_URL``, set by the admission webhook)."""
    token_file: str | None = DEFAULT_TOKEN_FILE
    """File holding the Bearer token, re-read when it changes; ``None`` sends no token
    (env ``HYPERPOD_SDC_TOKEN_FILE``)."""
    ca_bundle: str | None = None
    """PEM file of the CA that signed the operator's certificate; default: the system
    trust store (env ``HYPERPOD_SDC_CA_BUNDLE``)."""
    queue_size: int = 1000
    """Heartbeats and checkpoint records held while the operator is unreachable."""
    timeout_seconds: float = 5.0
    """Per request."""
    initial_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    heartbeat_jitter_seconds: float = 10.0
    """A heartbeat is sent a random 0 to this many seconds after it is submitted, so the
    nodes of a job do not all send theirs at the moment of an audit (env
    ``HYPERPOD_SDC_HEARTBEAT_JITTER_SECONDS``; 0: at once)."""

    def __post_init__(self) -> None:
        for name in ("operator_url", "verdict_url"):
            value = getattr(self, name)
            if name == "verdict_url" and value is None:
                continue
            url = urllib.parse.urlsplit(value) if isinstance(value, str) else None
            try:
                valid = url is not None and url.scheme in ("http", "https") and bool(url.hostname)
                valid = valid and (url is not None and (url.port is None or url.port > 0))
            except ValueError:  # a port that is not a number
                valid = False
            if not valid:
                raise ConfigError(
                    f"{name}: must be an http:// or https:// URL with a host, got {value!r}"
                )
        require_int("queue_size", self.queue_size, minimum=1)
        for name in ("timeout_seconds", "initial_backoff_seconds", "max_backoff_seconds"):
            require_number(
                name, getattr(self, name), minimum=0, maximum=3600, exclusive_minimum=True
            )
        require_number(
            "heartbeat_jitter_seconds", self.heartbeat_jitter_seconds, minimum=0, maximum=3600
        )
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ConfigError(f"ca_bundle: no such file: {self.ca_bundle}")

    @classmethod
    def from_env(cls, **overrides: object) -> ReporterConfig | None:
        """Settings from the environment; ``None`` when no operator URL is configured."""
        values: dict[str, object] = {}
        if url := os.environ.get(OPERATOR_URL_ENV, "").strip():
            values["operator_url"] = url
        if url := os.environ.get(VERDICT_URL_ENV, "").strip():
            values["verdict_url"] = url
        if (token := os.environ.get(TOKEN_FILE_ENV)) is not None:
            values["token_file"] = token.strip() or None
        if ca := os.environ.get(CA_BUNDLE_ENV, "").strip():
            values["ca_bundle"] = ca
        if jitter := os.environ.get(HEARTBEAT_JITTER_ENV, "").strip():
            try:
                values["heartbeat_jitter_seconds"] = float(jitter)
            except ValueError:
                raise ConfigError(
                    f"{HEARTBEAT_JITTER_ENV}: expected a number of seconds, got {jitter!r}"
                ) from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)}: unknown setting; known: {', '.join(sorted(known))}"
            )
        values.update(overrides)
        if "operator_url" not in values:
            return None
        return cls(**values)  # type: ignore[arg-type]


class Reporter:
    """Delivers reports in the background. Thread-safe; one per reporting rank."""

    def __init__(self, config: ReporterConfig) -> None:
        self.config = config
        self.url = config.operator_url.rstrip("/") + REPORTS_PATH
        self.verdict_url = (
            config.verdict_url.rstrip("/") + REPORTS_PATH if config.verdict_url else None
        )
        """Where every report but heartbeats goes first (``None``: :attr:`url`)."""
        self._verdict_port_off_until = 0.0  # (monotonic) after it failed without an answer
        # Queued reports with the monotonic time they were submitted.
        self._verdicts: collections.deque[tuple[float, Report]] = collections.deque()
        self._others: collections.deque[tuple[float, Report]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()  # set by close(): no more attempts
        self._closed = False
        self._in_flight: tuple[float, Report] | None = None
        self._attempt = 0  # consecutive failed attempts: the back-off grows with them
        # Heartbeats and checkpoint records wait until both have passed (monotonic time):
        self._jitter_until = 0.0  # a heartbeat's jitter
        self._hold_until = 0.0  # heartbeats held after a step with a verdict
        self._retry_until = 0.0  # the operator's Retry-After, or the back-off
        self._retry_after: float | None = None  # of the last answer, where it said one
        self._token: str | None = None
        self._token_stamp: tuple[float, int] | None = None
        self._ssl_stamp: tuple[int, int, int, int] | None = None
        self._ssl = self._tls_context(initial=True)
        self._conn: http.client.HTTPConnection | None = None
        self._conn_tls: ssl.SSLContext | None = None  # the context it was opened with
        self.connections_opened = 0
        """Connections opened to the operator (one while it keeps the connection open)."""
        self.verdict_connections = 0
        """Connections opened to the verdict port (one per report sent there)."""
        self.delivered = 0
        self.dropped = 0
        self.refused = 0
        self.refused_verdicts = 0
        self.refusals: dict[int, int] = {}
        """Refused reports by the operator's HTTP status."""
        self.protocol_version = PROTOCOL_VERSION
        """The version reports are written in: the newest the operator accepts."""
        self.unreported: dict[str, int] = {}
        """Fields the operator did not receive (left out for its older version) or did not
        read (it said it ignored them), and how many reports lacked each, since the start."""
        self._left_out: set[str] = set()
        """Fields left out of reports written in :attr:`_left_out_version`."""
        self._left_out_version = PROTOCOL_VERSION
        self._ignored: set[str] = set()
        """Fields the operator's last answer to a report carrying them said it ignored."""
        self._undeliverable_since: float | None = None
        """When the oldest verdict that will never be delivered (refused, or that could not
        be sent) was submitted."""
        self._thread = threading.Thread(target=self._run, name="sdc-reporter", daemon=True)
        self._thread.start()

    # -- the training side ---------------------------------------------------------------

    def submit(self, report: Report) -> None:
        """Queue ``report``; returns at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError("Reporter is closed")
            entry = (time.monotonic(), report)
            if isinstance(report, VerdictReport):
                self._verdicts.append(entry)
            else:
                if len(self._others) >= self.config.queue_size:
                    self._drop_one()
                self._others.append(entry)
                jitter = self.config.heartbeat_jitter_seconds
                if isinstance(report, HeartbeatReport) and jitter and self._jitter_until < entry[0]:
                    self._jitter_until = entry[0] + random.uniform(0, jitter)
            self._cond.notify_all()

    def hold_heartbeats(self, seconds: float) -> None:
        """Send no heartbeat for ``seconds`` from now, plus this Reporter's jitter: the
        training side found a verdict at this step, so every node's agent is about to
        report it (and the operator sheds heartbeats meanwhile). Verdicts still go at once,
        and so do checkpoint records, ahead of the held heartbeats: the operator waits for
        the verified snapshot's record before it stops the job."""
        with self._cond:
            jitter = self.config.heartbeat_jitter_seconds
            until = time.monotonic() + seconds + (random.uniform(0, jitter) if jitter else 0.0)
            self._hold_until = max(self._hold_until, until)
            self._cond.notify_all()

    def _drop_one(self) -> None:
        for kind in (HeartbeatReport, CheckpointReport):
            for i, (_, queued) in enumerate(self._others):
                if isinstance(queued, kind):
                    del self._others[i]
                    self.dropped += 1
                    log.warning(
                        "sdc_agent: report queue full, dropped the oldest %s", kind.__name__
                    )
                    return

    def verdict_overdue(self, deadline_seconds: float) -> bool:
        """An undelivered verdict has waited longer than ``deadline_seconds``: one still
        queued or in flight, or one the operator refused (it will never be delivered)."""
        with self._cond:
            waiting = [t for t, _ in self._verdicts]
            if self._in_flight is not None and isinstance(self._in_flight[1], VerdictReport):
                waiting.append(self._in_flight[0])
            if self._undeliverable_since is not None:
                waiting.append(self._undeliverable_since)
        return bool(waiting) and time.monotonic() - min(waiting) > deadline_seconds

    def counters(self) -> dict[str, object]:
        """What happened to the reports so far (for the Guard's metrics and logs)."""
        with self._cond:
            return {
                "delivered": self.delivered,
                "dropped": self.dropped,
                "refused": self.refused,
                "refused_verdicts": self.refused_verdicts,
                "refusals": dict(self.refusals),
                "undeliverable_verdict": self._undeliverable_since is not None,
                "protocol_version": self.protocol_version,
                "unreported": dict(self.unreported),
                "not_received": self.not_received(),
            }

    def not_received(self) -> list[str]:
        """The fields the operator does not receive now, as heartbeats name them: those the
        version reports are written in lacks, and those its answers still say it ignores
        (an upgraded operator stops being named, while :attr:`unreported` keeps the counts)."""
        with self._cond:
            if self._left_out_version != self.protocol_version:
                return sorted(self._ignored)
            return sorted(self._left_out | self._ignored)

    def pending(self) -> int:
        with self._cond:
            return len(self._verdicts) + len(self._others) + (self._in_flight is not None)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is delivered or refused; false on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._jitter_until = self._hold_until = 0.0
            self._cond.notify_all()
            while self._verdicts or self._others or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Deliver what is queued (up to ``timeout``), then stop the thread."""
        delivered_all = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        self._thread.join(timeout=self.config.timeout_seconds + 1.0)
        if not delivered_all:
            log.error("sdc_agent: %d report(s) not delivered to %s", self.pending(), self.url)
        return delivered_all

    # -- the sending thread --------------------------------------------------------------

    def _next(self) -> tuple[float, Report] | None:
        """The next report to send: a verdict at once, anything else once its jitter and
        the operator's Retry-After have passed, a heartbeat once the hold after a verdict
        has too (a checkpoint record goes ahead of held heartbeats)."""
        with self._cond:
            entry = None
            while not self._closed and entry is None:
                if self._verdicts:
                    entry = self._verdicts.popleft()
                elif self._others:
                    now = time.monotonic()
                    wait = max(self._jitter_until, self._retry_until) - now
                    if wait <= 0:
                        held = self._hold_until - now
                        entry = self._first_unheld(held > 0)
                        wait = held
                    if entry is None:
                        self._cond.wait(wait)
                else:
                    self._cond.wait()
            if self._closed:
                return None
            self._in_flight = entry
            return entry

    def _first_unheld(self, holding: bool) -> tuple[float, Report] | None:
        """Takes the first of the other reports that may go now: any, or while heartbeats
        are held the first that is not one."""
        for i, entry in enumerate(self._others):
            if not holding or not isinstance(entry[1], HeartbeatReport):
                del self._others[i]
                return entry
        return None

    def _run(self) -> None:
        try:
            self._deliver()
        finally:
            self._disconnect()

    def _deliver(self) -> None:
        while (entry := self._next()) is not None:
            submitted, report = entry
            try:
                outcome = self._send(report)
            except Exception:  # never let one report kill the thread
                log.exception("sdc_agent: cannot send a %s report; dropped", report.kind)
                outcome = "dropped"
            with self._cond:
                self._in_flight = None
                if outcome in ("refused", "dropped") and isinstance(report, VerdictReport):
                    self._undeliverable(submitted)
                if outcome == "retry":
                    # Back in front of its queue: the next pick takes verdicts first.
                    queue = self._verdicts if isinstance(report, VerdictReport) else self._others
                    queue.appendleft(entry)
                else:
                    self._attempt = 0
                    if outcome == "delivered":
                        self.delivered += 1
                    elif outcome == "dropped":
                        self.dropped += 1
                self._cond.notify_all()
            if outcome == "retry":
                backoff = _backoff(
                    self._attempt,
                    self.config.initial_backoff_seconds,
                    self.config.max_backoff_seconds,
                )
                self._attempt += 1
                wait = random.uniform(0, backoff)  # full jitter
                if not isinstance(report, VerdictReport):
                    # Waits in the queue, where a verdict submitted meanwhile goes first.
                    with self._cond:
                        self._retry_until = time.monotonic() + max(wait, self._retry_after or 0)
                    continue
                if self._stop.wait(wait):  # close() ends it
                    return

    def _undeliverable(self, submitted: float) -> None:
        """A verdict that will never be delivered (called with the lock held)."""
        if self._undeliverable_since is None or submitted < self._undeliverable_since:
            self._undeliverable_since = submitted

    def _refused(self, report: Report, status: int, detail: str) -> str:
        """Count and log a refusal (every time: each one is a report the operator will
        never act on)."""
        with self._cond:
            self.refused += 1
            self.refusals[status] = self.refusals.get(status, 0) + 1
            if isinstance(report, VerdictReport):
                self.refused_verdicts += 1
        if isinstance(report, VerdictReport):
            log.error(
                "sdc_agent: the operator REFUSED a verdict (HTTP %d) for step %d; it will not "
                "be acted on, and counts as undelivered (unreachable_policy=stop stops "
                "training once it is overdue): %s",
                status,
                report.step,
                detail,
            )
        else:
            log.error(
                "sdc_agent: operator refused a %s report (%d): %s", report.kind, status, detail
            )
        return "refused"

    def _bearer(self) -> str | None:
        path = self.config.token_file
        if path is None:
            return None
        try:
            st = os.stat(path)
            stamp = (st.st_mtime, st.st_size)
            if stamp != self._token_stamp:
                with open(path, encoding="utf-8") as f:
                    self._token = f.read().strip()
                self._token_stamp = stamp
        except OSError as exc:
            log.warning("sdc_agent: cannot read token file %s: %s", path, exc)
        return self._token

    def _current_tls(self) -> ssl.SSLContext:
        self._ssl = self._tls_context()
        return self._ssl

    def _tls_context(self, initial: bool = False) -> ssl.SSLContext:
        """The TLS context, built again when the CA bundle file changed. A bundle that
        cannot be read later (mid-rotation) keeps the context in use; at start it fails."""
        path = self.config.ca_bundle
        if path is None:
            return self._ssl if not initial else ssl.create_default_context()
        stamp = None
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
            if not initial and stamp == self._ssl_stamp:
                return self._ssl
            context = ssl.create_default_context(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            if initial:
                raise
            self._ssl_stamp = stamp  # said once per version of the file
            log.warning(
                "sdc_agent: cannot read the CA bundle %s again, keeping the last: %s", path, exc
            )
            return self._ssl
        if not initial:
            log.info("sdc_agent: the CA bundle %s changed; using it from now on", path)
        self._ssl_stamp = stamp
        return context

    def _send(self, report: Report) -> str:
        """``delivered``, ``refused`` (do not retry) or ``retry``."""
        for _ in range(len(ACCEPTED_VERSIONS) + 1):
            version = self.protocol_version
            outcome = self._send_as(report, version)
            if outcome != "again" or self.protocol_version == version:
                return "retry" if outcome == "again" else outcome
        return "retry"

    def _send_as(self, report: Report, version: int) -> str:
        """One attempt in protocol ``version``: ``again`` when the operator asked for
        another version (:attr:`protocol_version` has changed then)."""
        if isinstance(report, HeartbeatReport) and (names := self.not_received()):
            report = dataclasses.replace(report, unreported=tuple(names[:64]))
        self._retry_after = None
        left_out: list[str] = []
        body = encode_report(report, version=version, left_out=left_out)
        # (the heartbeat's own list of such fields is no news to an operator that lacks it)
        left_out = [name for name in left_out if name != "unreported"]
        with self._cond:
            if self._left_out_version != version:
                self._left_out, self._left_out_version = set(), version
            self._left_out.update(left_out)
        if left_out:
            self._unreported(left_out, f"the operator speaks protocol {version}, which lacks them")
        headers = {"Content-Type": "application/json"}
        if token := self._bearer():
            headers["Authorization"] = f"Bearer {token}"
        try:
            status, answer, retry_after, versions = self._post(
                body, headers, verdict_lane=not isinstance(report, HeartbeatReport)
            )
        except (OSError, TimeoutError, http.client.HTTPException) as exc:
            # refused connections, timeouts, a connection cut mid-answer
            log.info("sdc_agent: operator unreachable at %s, will retry: %s", self.url, exc)
            return "retry"
        if 200 <= status < 300:
            self._learn_versions(versions, None)
            self._note_ignored(body, answer)
            return "delivered"
        detail = answer[:2048].decode("utf-8", "replace")
        if status == 422 and self._learn_versions(versions, detail):
            return "again"
        self._retry_after = _retry_after(retry_after)
        if status in (408, 429) or status >= 500:
            log.info("sdc_agent: operator answered %d, will retry: %s", status, detail)
            return "retry"
        return self._refused(report, status, detail)

    def _post(
        self, body: bytes, headers: dict[str, str], verdict_lane: bool = False
    ) -> tuple[int, bytes, str | None, str | None]:
        """POST ``body``: the status, the answer (at most 64 KiB), its ``Retry-After`` and
        protocol header. ``verdict_lane``: to the verdict port first, where there is one
        (:meth:`_post_verdict_port`); else, or where that fails before an answer, on the
        kept connection (:meth:`_post_kept`)."""
        if verdict_lane and self.verdict_url and time.monotonic() >= self._verdict_port_off_until:
            try:
                return self._post_verdict_port(self.verdict_url, body, headers)
            except (OSError, TimeoutError, http.client.HTTPException) as exc:
                self._verdict_port_off_until = time.monotonic() + VERDICT_PORT_PAUSE_SECONDS
                log.info(
                    "sdc_agent: the verdict port %s failed (%s: %s); sending to %s instead, "
                    "and for the next %g s",
                    self.verdict_url,
                    type(exc).__name__,
                    exc,
                    self.url,
                    VERDICT_PORT_PAUSE_SECONDS,
                )
        return self._post_kept(body, headers)

    def _post_verdict_port(
        self, url: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None, str | None]:
        """POST ``body`` to ``url`` on a connection opened for it and closed after the
        answer: the verdict port holds no connection of an agent between its reports."""
        context = self._current_tls() if url.startswith("https") else None
        conn = self._open(context, url)
        try:
            conn.connect()
            self.verdict_connections += 1
            conn.request(
                "POST", _path_of(url), body=body, headers={**headers, "Connection": "close"}
            )
            return _answer(conn.getresponse())
        finally:
            conn.close()

    def _post_kept(
        self, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, str | None, str | None]:
        """POST ``body`` on the kept connection. A kept connection that the operator closed
        while it was idle fails at once; the report then goes again on a new one."""
        for fresh in (False, True):
            conn, reused = self._connection(fresh)
            try:
                conn.request("POST", _path_of(self.url), body=body, headers=headers)
                response = conn.getresponse()
                answered = _answer(response)
                if not response.isclosed():  # an answer over 64 KiB: not read to its end
                    self._disconnect()
                return answered
            except (ConnectionError, http.client.RemoteDisconnected, ssl.SSLEOFError):
                self._disconnect()
                if not reused:
                    raise
            except BaseException:
                self._disconnect()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _connection(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """The kept connection (opened again where the CA bundle changed, or ``fresh``),
        and whether it is one that served a request before."""
        https = self.url.startswith("https")
        context = self._current_tls() if https else None
        conn = self._conn
        if conn is not None and (fresh or context is not self._conn_tls or conn.sock is None):
            self._disconnect()
            conn = None
        if conn is not None:
            return conn, True
        conn = self._open(context, self.url)
        conn.connect()
        self._conn, self._conn_tls = conn, context
        self.connections_opened += 1
        return conn, False

    def _open(self, context: ssl.SSLContext | None, url: str) -> http.client.HTTPConnection:
        """A new connection to the operator at ``url`` (not yet connected)."""
        parts = urllib.parse.urlsplit(url)
        host, port, timeout = parts.hostname or "", parts.port, self.config.timeout_seconds
        if context is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _learn_versions(self, header: str | None, refusal: str | None) -> bool:
        """Take the operator's accepted versions from its header, or, from an operator
        before the header, from its refusal of ``version``. True: the version changed."""
        offered: set[int] = set()
        if header:
            for part in header.split(","):
                if part.strip().isdigit():
                    offered.add(int(part.strip()))
        elif refusal is not None:
            try:
                message = str(json.loads(refusal).get("message", ""))
            except (ValueError, AttributeError):
                message = refusal
            if message.startswith("version:") and (speaks := _SPEAKS.search(message)):
                offered.add(int(speaks.group(1)))
        common = offered & set(ACCEPTED_VERSIONS)
        if not offered or (common and max(common) == self.protocol_version):
            return False
        if not common:
            log.error(
                "sdc_agent: the operator at %s accepts protocol version(s) %s; this agent "
                "speaks %s: upgrade the agent (sdc_agent) in the training image",
                self.url,
                ", ".join(map(str, sorted(offered))),
                ", ".join(map(str, ACCEPTED_VERSIONS)),
            )
            return False
        before, self.protocol_version = self.protocol_version, max(common)
        log.warning(
            "sdc_agent: the operator at %s accepts protocol version(s) %s; writing version %d "
            "from now on (was %d)",
            self.url,
            ", ".join(map(str, sorted(offered))),
            self.protocol_version,
            before,
        )
        return True

    def _note_ignored(self, body: bytes, answer: bytes) -> None:
        """What the operator's answer says it ignored of the report it accepted; a field the
        report carried that the answer no longer names is received again."""
        try:
            ignored = json.loads(answer).get("ignored") or []
        except (ValueError, AttributeError):
            return
        names = [str(name) for name in ignored[:64]] if isinstance(ignored, list) else []
        with self._cond:
            self._ignored = (self._ignored - set(json.loads(body))) | set(names)
        if names:
            self._unreported(names, "the operator ignores them: it is older than this agent")

    def _unreported(self, names: list[str], why: str) -> None:
        with self._cond:
            new = [name for name in names if name not in self.unreported]
            for name in names:
                self.unreported[name] = self.unreported.get(name, 0) + 1
        if new:
            log.warning(
                "sdc_agent: the operator at %s does not receive these fields: %s (%s); "
                "upgrade the operator to get them",
                self.url,
                ", ".join(new),
                why,
            )


def _path_of(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _answer(response: http.client.HTTPResponse) -> tuple[int, bytes, str | None, str | None]:
    """A response's status, body (at most 64 KiB), ``Retry-After`` and protocol header."""
    return (
        response.status,
        response.read(65536),
        response.getheader("Retry-After"),
        response.getheader(PROTOCOL_HEADER),
    )


def _retry_after(value: str | None) -> float | None:
    """An answer's ``Retry-After`` in seconds (at most an hour); ``None`` where it has none
    or an HTTP date, which the operator never sends."""
    try:
        return min(3600.0, max(0.0, float(value))) if value else None
    except ValueError:
        return None


def _backoff(attempt: int, initial: float, most: float) -> float:
    """The longest wait before retry number ``attempt + 1``: doubling from ``initial`` up to
    ``most``. The exponent is capped: ``2.0 ** 1024`` overflows a float, and an operator
    down for a day makes that many attempts."""
    return min(most, initial * 2.0 ** min(attempt, 60))
