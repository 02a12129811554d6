"""The operator's three listeners as a real process serves them: what each port answers,
and the TLS handshakes a client may hold (:mod:`sdc_operator.listeners`).

NetworkPolicy decides who reaches which port in a cluster (tests/chart checks what the
chart's policies allow); the API server built here enforces none, so what is tested here
is what the operator itself enforces: the tenants' port serves nothing but the reports.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdc_operator.webhook import ADMISSION_PATH
from tests.tls import issue, make_ca

from .cluster import Cluster, OperatorProcess, post, post_split
from .test_attacks import assert_quiet, heartbeat
from .test_containment import make_job

REVIEW = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "namespace": "default",
        "userInfo": {"username": "system:serviceaccount:kubeflow:training-operator"},
        "object": {"metadata": {"name": "x"}, "spec": {"containers": []}},
    },
}


def ask(
    url: str, path: str, body: dict[str, Any] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data is not None else "GET",
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_tenants_port_serves_only_the_reports(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Before: the admission webhook (which answered a tenant's forged review with an
    attestation) and ``/metrics`` (every opted-in job of every namespace) were served on
    the port the tenants report to."""
    job = make_job(cluster, namespace)
    op = start_operator()
    intake, admission, metrics = op.url, op.admission_url, op.metrics_url
    # the tenants' port: the reports, and 404 for everything else
    assert post(intake, heartbeat(job), cluster.token(namespace, job.pods[0]))[0] == 202
    for path, body in [
        (ADMISSION_PATH, REVIEW),
        ("/metrics", None),
        ("/healthz", None),
        ("/readyz", None),
    ]:
        status, text = ask(intake, path, body)
        assert (status, json.loads(text)["error"]) == (404, "not_found"), (path, text)
    # the API server's port: the admission webhook only
    status, text = ask(admission, ADMISSION_PATH, REVIEW)
    assert status == 200 and json.loads(text)["response"]["uid"] == "u-1"
    for path, body in [("/v1/reports", {}), ("/metrics", None)]:
        assert ask(admission, path, body)[0] == 404, path
    # monitoring's port: metrics and health, no reports and no reviews
    status, text = ask(metrics, "/metrics")
    assert status == 200 and "hyperpod_sdc_admission_reviews_total" in text
    assert ask(metrics, "/healthz")[0] == 200 and ask(metrics, "/readyz")[0] == 200
    for path, body in [("/v1/reports", {}), (ADMISSION_PATH, REVIEW)]:
        assert ask(metrics, path, body)[0] == 404, path
    assert_quiet(op)


# timing: 1 s handshake timeout; the limited connections close < 0.5 s, the timed ones in (0.8, 3.0)
# s: 0.2 s early, 2 s late margin
@pytest.mark.timing
def test_tls_handshakes_are_timed_and_limited_per_source(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], tmp_path: Path
) -> None:
    """Connections that never finish their TLS handshake are closed after the timeout; one
    address holding more than its share is refused at once; a client from another address
    is answered meanwhile, on every listener."""
    ca = make_ca(tmp_path)
    key, cert = issue(tmp_path, ca)
    job = make_job(cluster, namespace)
    op = start_operator(
        scheme="https",
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        tls_handshake_timeout_seconds="1",
        handshakes_per_source="8",
    )
    trust = ssl.create_default_context(cafile=str(ca[1]))
    for port in (op.port, op.admission_port, op.metrics_port):
        # 20 connections from 127.0.0.2 that never send a ClientHello; meanwhile a client
        # from 127.0.0.1 is served at once
        waiting = IdleClients(port, 20, "127.0.0.2")
        started = time.monotonic()
        status, _ = ask(op.metrics_url, "/healthz", context=trust)
        assert status == 200 and time.monotonic() - started < 1.0
        closed = waiting.closed_after(10)
        assert len(closed) == 20, f"port {port}: {20 - len(closed)} still open after 10 s"
        # 12 over the limit of 8 closed at once, the 8 others when their handshake timed out
        assert closed[11] < 0.5, (port, closed)
        assert all(0.8 < t < 3.0 for t in closed[12:]), (port, closed)
    token = cluster.token(namespace, job.pods[0])
    assert post_split(op.url, heartbeat(job), token, context=trust)[0] == 202
    assert_quiet(op)


class IdleClients:
    """``count`` connections from ``source`` to ``port`` that send nothing; when each was
    closed by the server."""

    def __init__(self, port: int, count: int, source: str) -> None:
        self.opened = time.monotonic()
        self.closed: list[float] = []
        self.socks = [
            socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
            for _ in range(count)
        ]
        self.threads = [threading.Thread(target=self._watch, args=(s,)) for s in self.socks]
        for thread in self.threads:
            thread.start()

    def _watch(self, sock: socket.socket) -> None:
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            sock.recv(1)  # b"" (closed) or a reset
        self.closed.append(time.monotonic() - self.opened)

    def closed_after(self, seconds: float) -> list[float]:
        for thread in self.threads:
            thread.join(seconds)
        for sock in self.socks:
            sock.close()
        return sorted(self.closed)
