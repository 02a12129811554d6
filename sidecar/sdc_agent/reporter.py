"""Sends reports to the operator from a background thread; never slows the training step.

:meth:`Reporter.submit` only appends to a bounded in-memory queue. A daemon thread posts
the reports, oldest first with verdicts ahead of everything else, and retries transient
failures (connection errors, timeouts, HTTP 408, 429 and 5xx) with exponential back-off
and full jitter. A report the operator refuses (any other 4xx) is logged and dropped: it
will not get better by retrying. When the queue is full the oldest heartbeat goes first,
then the oldest checkpoint record; verdicts are never dropped.

Authentication: the Bearer token is read from ``token_file`` (a projected
ServiceAccount token) before each request whose file changed since the last read, so a
rotated token is picked up. TLS: the system trust store, or ``ca_bundle``.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .errors import ConfigError
from .protocol import CheckpointReport, HeartbeatReport, Report, VerdictReport, encode_report

__all__ = [
    "CA_BUNDLE_ENV",
    "OPERATOR_URL_ENV",
    "TOKEN_FILE_ENV",
    "Reporter",
    "ReporterConfig",
]

log = logging.getLogger("sdc_agent.reporter")

OPERATOR_URL_ENV = "HYPERPOD_SDC_OPERATOR_URL"
TOKEN_FILE_ENV = "HYPERPOD_SDC_TOKEN_FILE"
CA_BUNDLE_ENV = "HYPERPOD_SDC_CA_BUNDLE"
DEFAULT_TOKEN_FILE = "/var/run/secrets/hyperpod-sdc/token"
REPORTS_PATH = "/v1/reports"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReporterConfig:
    """Settings of :class:`Reporter`; :meth:`from_env` fills them from the environment."""

    operator_url: str
    """Base URL of the operator's intake, e.g. ``https://hyperpod-sdc.hyperpod-sdc.svc:8443``
    (env ``HYPERPOD_SDC_OPERATOR_URL``); reports go to ``<url>/v1/reports``."""
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

    def __post_init__(self) -> None:
        if not self.operator_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"operator_url: must start with http:// or https://, got {self.operator_url!r}"
            )
        if self.queue_size < 1:
            raise ConfigError(f"queue_size: must be >= 1, got {self.queue_size}")
        for name in ("timeout_seconds", "initial_backoff_seconds", "max_backoff_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ConfigError(f"ca_bundle: no such file: {self.ca_bundle}")

    @classmethod
    def from_env(cls, **overrides: object) -> ReporterConfig | None:
        """Settings from the environment; ``None`` when no operator URL is configured."""
        values: dict[str, object] = {}
        if url := os.environ.get(OPERATOR_URL_ENV, "").strip():
            values["operator_url"] = url
        if (token := os.environ.get(TOKEN_FILE_ENV)) is not None:
            values["token_file"] = token.strip() or None
        if ca := os.environ.get(CA_BUNDLE_ENV, "").strip():
            values["ca_bundle"] = ca
        values.update(overrides)
        if "operator_url" not in values:
            return None
        return cls(**values)  # type: ignore[arg-type]


class Reporter:
    """Delivers reports in the background. Thread-safe; one per reporting rank."""

    def __init__(self, config: ReporterConfig) -> None:
        self.config = config
        self.url = config.operator_url.rstrip("/") + REPORTS_PATH
        self._verdicts: collections.deque[Report] = collections.deque()
        self._others: collections.deque[Report] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._in_flight = 0
        self._token: str | None = None
        self._token_stamp: tuple[float, int] | None = None
        self._ssl = ssl.create_default_context(cafile=config.ca_bundle)
        self.delivered = 0
        self.dropped = 0
        self.refused = 0
        self.oldest_undelivered_verdict: float | None = None
        """Monotonic time a still undelivered verdict was submitted, else ``None``."""
        self._thread = threading.Thread(target=self._run, name="sdc-reporter", daemon=True)
        self._thread.start()

    # -- the training side ---------------------------------------------------------------

    def submit(self, report: Report) -> None:
        """Queue ``report``; returns at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError("Reporter is closed")
            if isinstance(report, VerdictReport):
                self._verdicts.append(report)
                if self.oldest_undelivered_verdict is None:
                    self.oldest_undelivered_verdict = time.monotonic()
            else:
                if len(self._others) >= self.config.queue_size:
                    self._drop_one()
                self._others.append(report)
            self._cond.notify()

    def _drop_one(self) -> None:
        for kind in (HeartbeatReport, CheckpointReport):
            for i, queued in enumerate(self._others):
                if isinstance(queued, kind):
                    del self._others[i]
                    self.dropped += 1
                    log.warning(
                        "sdc_agent: report queue full, dropped the oldest %s", kind.__name__
                    )
                    return

    def verdict_overdue(self, deadline_seconds: float) -> bool:
        """A verdict has waited longer than ``deadline_seconds`` for delivery."""
        since = self.oldest_undelivered_verdict
        return since is not None and time.monotonic() - since > deadline_seconds

    def pending(self) -> int:
        with self._cond:
            return len(self._verdicts) + len(self._others) + self._in_flight

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is delivered or refused; false on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._verdicts or self._others or self._in_flight:
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
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        if not delivered_all:
            log.error("sdc_agent: %d report(s) not delivered to %s", self.pending(), self.url)
        return delivered_all

    # -- the sending thread --------------------------------------------------------------

    def _next(self) -> Report | None:
        with self._cond:
            while not (self._verdicts or self._others):
                if self._closed:
                    return None
                self._cond.wait()
            queue = self._verdicts if self._verdicts else self._others
            self._in_flight += 1
            return queue.popleft()

    def _run(self) -> None:
        while (report := self._next()) is not None:
            attempt = 0
            while True:
                outcome = self._send(report)
                if outcome != "retry":
                    break
                with self._cond:
                    if self._closed:
                        break
                backoff = min(
                    self.config.max_backoff_seconds,
                    self.config.initial_backoff_seconds * 2**attempt,
                )
                attempt += 1
                with self._cond:
                    self._cond.wait(random.uniform(0, backoff))  # full jitter
            with self._cond:
                self._in_flight -= 1
                if outcome == "delivered":
                    self.delivered += 1
                # A refused verdict reached the operator too: nothing left to wait for.
                if isinstance(report, VerdictReport) and not self._verdicts and outcome != "retry":
                    self.oldest_undelivered_verdict = None
                self._cond.notify_all()

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

    def _send(self, report: Report) -> str:
        """``delivered``, ``refused`` (do not retry) or ``retry``."""
        body = encode_report(report)
        request = urllib.request.Request(self.url, data=body, method="POST")
        request.add_header("Content-Type", "application/json")
        if token := self._bearer():
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(
                request,
                timeout=self.config.timeout_seconds,
                context=self._ssl if self.url.startswith("https") else None,
            ) as response:
                response.read()
            return "delivered"
        except urllib.error.HTTPError as exc:
            detail = exc.read(2048).decode("utf-8", "replace")
            if exc.code in (408, 429) or exc.code >= 500:
                log.info("sdc_agent: operator answered %d, will retry: %s", exc.code, detail)
                return "retry"
            self.refused += 1
            log.error(
                "sdc_agent: operator refused a %s report (%d): %s", report.kind, exc.code, detail
            )
            return "refused"
        except (OSError, TimeoutError) as exc:  # URLError, connection refused, timeouts
            log.info("sdc_agent: operator unreachable at %s, will retry: %s", self.url, exc)
            return "retry"
