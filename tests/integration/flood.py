"""A flood of requests with bogus tokens (JWT-shaped, so only the API server can tell them
apart from real ones) from many client addresses, as a hostile tenant's pods would send
them. Used by tests/integration/test_flood.py and bench/operator_flood.py.

Each source address (127.0.0.2, 127.0.0.3, ...: every 127/8 address reaches loopback) has
its own thread and keep-alive connection, paced to its share of the rate.
"""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sdc_harness.cluster import Cluster


def bogus_token(audience: str = "hyperpod-sdc") -> str:
    def part(value: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    claims = {
        "aud": [audience],
        "exp": int(time.time()) + 3600,
        "sub": "system:serviceaccount:ml:worker",
        "jti": secrets.token_hex(8),
    }
    signature = base64.urlsafe_b64encode(secrets.token_bytes(256)).rstrip(b"=").decode()
    return f"{part({'alg': 'RS256', 'kid': 'x'})}.{part(claims)}.{signature}"


@dataclass
class Flood:
    url: str
    rate: float
    """Requests per second, all sources together."""
    tokens: list[str]
    sources: int = 30
    statuses: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    started: float = 0.0
    stopped: float = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        for i in range(self.sources):
            thread = threading.Thread(target=self._run, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _run(self, index: int) -> None:
        parts = urllib.parse.urlsplit(self.url)
        assert parts.hostname and parts.port
        source = (f"127.0.0.{2 + index}", 0)
        body = b'{"version": 1}'
        interval = self.sources / self.rate
        next_at = time.monotonic() + interval * index / self.sources
        conn: http.client.HTTPConnection | None = None
        n = index
        while not self._stop.is_set():
            if conn is None:
                conn = http.client.HTTPConnection(
                    parts.hostname, parts.port, timeout=10, source_address=source
                )
            token = self.tokens[n % len(self.tokens)]
            n += self.sources
            response = None
            try:
                conn.request(
                    "POST",
                    "/v1/reports",
                    body=body,
                    headers={
                        "Content-Type": "application/json",
                        "Authorization": f"Bearer {token}",
                    },
                )
                response = conn.getresponse()
                response.read()
                outcome = str(response.status)
                if response.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
                if conn is not None:
                    conn.close()
                conn = None
            finally:
                # a response not read to its end keeps the socket open past conn.close(),
                # until the garbage collector finds it, in a later test (its unclosed
                # socket's ResourceWarning failed test_listeners in a loaded repeat)
                if response is not None:
                    response.close()
            self.statuses[outcome] += 1
            self.sent += 1
            next_at += interval
            wait = next_at - time.monotonic()
            if wait > 0:
                self._stop.wait(wait)
            else:
                next_at = time.monotonic()  # behind: send as fast as answers come
        if conn is not None:
            conn.close()

    def answered(self) -> int:
        """Requests answered so far (any status)."""
        return sum(n for status, n in list(self.statuses.items()) if status.isdigit())

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)
        self.stopped = time.monotonic()
        seconds = self.stopped - self.started
        return {
            "seconds": round(seconds, 1),
            "requests": self.sent,
            "rate_achieved": round(self.sent / seconds, 1),
            "distinct_tokens": len(self.tokens),
            "answers": dict(self.statuses),
        }


def token_reviews(cluster: Cluster) -> float:
    """TokenReviews the API server has served, by its own count."""
    response = cluster.api.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    response = response[0] if isinstance(response, tuple) else response
    total = 0.0
    for line in response.data.decode().splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="tokenreviews"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
