"""The operator's three listeners as a real process serves them: what each port answers,
and the TLS handshakes a client may hold (:mod:`sdc_operator.listeners`).

NetworkPolicy decides who reaches which port in a cluster (tests/chart checks what the
chart's policies allow); the API server built here enforces none, so what is tested here
is what the operator itself enforces: the tenants' port serves nothing but the reports.
"""

from __future__ import annotations

import concurrent.futures
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

from sdc_harness.cluster import Cluster, OperatorProcess, post, post_split
from sdc_harness.tls import issue, make_ca
from sdc_operator.webhook import ADMISSION_PATH

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
# s: 0.2 s early, 2 s late margin; the other address's three asks, sent at once, each answered
# < 1.0 s (tens of ms unloaded: about 0.9 s margin)
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
    # 20 connections from 127.0.0.2 to each listener, all at once (each listener keeps its
    # own count), that never send a ClientHello; meanwhile a client from 127.0.0.1 is
    # served at once
    waiting = {
        port: IdleClients(port, 20, "127.0.0.2")
        for port in (op.port, op.admission_port, op.metrics_port)
    }

    def answered(url: str, path: str, body: dict[str, Any] | None) -> tuple[int, float]:
        started = time.monotonic()
        return ask(url, path, body, context=trust)[0], time.monotonic() - started

    # all three at once, while the idle clients hold their handshakes
    asks = [
        (op.url, "/healthz", None),  # the tenants' port serves nothing but the reports: 404
        (op.admission_url, ADMISSION_PATH, REVIEW),
        (op.metrics_url, "/healthz", None),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda a: answered(*a), asks))
    assert [status for status, _ in answers] == [404, 200, 200], answers
    assert all(took < 1.0 for _, took in answers), answers
    for port, clients in waiting.items():
        closed = clients.closed_after(10)
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


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


class MemoryCgroup:
    """A cgroup v1 memory group limiting one process, where the machine lets us make one;
    ``None`` from :meth:`make` otherwise."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls, name: str) -> MemoryCgroup | None:
        path = CGROUP_V1 / name
        try:
            path.mkdir()
        except OSError:
            return None
        return cls(path)

    def limit(self, pid: int, limit_bytes: int) -> None:
        """Move ``pid`` in, limited to ``limit_bytes`` from now on: what it holds already
        stays charged where it was (cgroup v1 moves no charges by default)."""
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        (self.path / "cgroup.procs").write_text(str(pid))

    def usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def vm(pid: int, key: str) -> int:
    """``VmRSS`` or ``VmHWM`` (peak RSS) of ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for {pid}")


async def open_tls(port: int, trust: ssl.SSLContext, sources: list[str]) -> tuple[list[Any], int]:
    """A TLS connection from each of ``sources`` at once, each sending one request (no
    token: answered 401, kept alive); the writers of those answered, and how many were
    reset before or during their handshake."""
    import asyncio

    request = (
        b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )

    async def one(source: str) -> Any:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=trust, local_addr=(source, 0), ssl_handshake_timeout=30
        )
        try:
            writer.write(request)
            status = await asyncio.wait_for(reader.readline(), 30)
            assert status.startswith(b"HTTP/1.1 401"), status
        except BaseException:
            # reset after its handshake: closed here, not by the garbage collector in a
            # later test (which failed there on the unclosed socket's ResourceWarning)
            writer.close()
            raise
        return writer

    results = await asyncio.gather(*(one(s) for s in sources), return_exceptions=True)
    answered = [r for r in results if not isinstance(r, BaseException)]
    reset = [r for r in results if isinstance(r, (ConnectionError, ssl.SSLError, OSError))]
    others = [r for r in results if isinstance(r, BaseException) and r not in reset]
    assert not others, others[:3]
    return answered, len(reset)


@pytest.mark.slow  # 20 to 25 s on 2 cores: 1,096 TLS handshakes, client and server here
# each handshake within the handshake timeout, raised here from the operator's 5 s to the
# client's 30 s (this test is about memory, not that timeout: at 5 s, 426 of 1,024
# handshakes missed it with the machine loaded); still in the serial pass
@pytest.mark.timing
def test_memory_stays_within_the_bound_with_1024_tls_connections_at_once(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1,024 TLS connections opened at once, each with a request answered and held open,
    plus 64 past ``max_connections`` and 8 past one address's share: the operator's memory
    grows by at most ``CONNECTION_BYTES`` per connection it holds (docs/operator.md,
    "Memory"), under a memory cgroup of that size where the machine allows one, and the
    connections past the limits are reset before their handshake. Before: 0.3 MiB per TLS
    connection (asyncio's 256 KiB read buffer), and no limit on how many."""
    import asyncio

    from sdc_operator.listeners import CONNECTION_BYTES

    ca = make_ca(tmp_path)
    key, cert = issue(tmp_path, ca)
    job = make_job(cluster, namespace)
    held = 1024
    op = start_operator(
        scheme="https",
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        max_connections=str(held),
        connections_per_source="4",
        tls_handshake_timeout_seconds="30",
        log_level="WARNING",
        # started as a pod starts it: a forked one writes to pages it shares with the
        # zygote (reference counts), which its memory would count as growth
        forked=False,
    )
    trust = ssl.create_default_context(cafile=str(ca[1]))
    token = cluster.token(namespace, job.pods[0])
    assert post_split(op.url, heartbeat(job), token, context=trust)[0] == 202  # warm
    idle = vm(op.proc.pid, "VmRSS")
    bound = idle + held * CONNECTION_BYTES
    group = MemoryCgroup.make(f"hyperpod-sdc-test-{op.proc.pid}")
    try:
        if group is not None:
            # what it grows by; the cgroup also charges page cache: 32 MiB of room
            group.limit(op.proc.pid, held * CONNECTION_BYTES + 32 * 2**20)
        # 1,020 addresses with one connection each, one with 4 + 8 too many, and 64 more
        # addresses past max_connections (1,024)
        many = [f"127.0.{2 + i // 250}.{1 + i % 250}" for i in range(held - 4 + 64)]
        sources = many[: held - 4] + ["127.0.9.9"] * 12 + many[held - 4 :]

        async def storm() -> tuple[int, int, int]:
            writers, reset = await open_tls(op.port, trust, sources)
            await asyncio.sleep(0.5)
            peak = vm(op.proc.pid, "VmHWM")
            for writer in writers:
                writer.close()
            await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
            return len(writers), reset, peak

        answered, reset, peak = asyncio.run(storm())
        alive = op.proc.poll() is None
        usage = group.usage() if group is not None else None
    finally:
        if group is not None:
            (CGROUP_V1 / "cgroup.procs").write_text(str(op.proc.pid))  # back to the root
            group.remove()
    with capsys.disabled():
        where = (
            f"under a memory cgroup limiting its growth to "
            f"{(held * CONNECTION_BYTES + 32 * 2**20) / 2**20:.0f} MiB (peak growth "
            f"{usage / 2**20:.0f} MiB)"
            if usage is not None
            else "no memory cgroup on this machine: peak RSS from /proc checked instead"
        )
        print(
            f"\n{answered} TLS connections held, {reset} reset: peak RSS "
            f"{peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB "
            f"(idle {idle / 2**20:.0f} MiB + {held} x {CONNECTION_BYTES // 1024} KiB); {where}"
        )
    assert alive, f"the operator died (OOM?):\n{op.log()[-3000:]}"
    assert answered == held and reset == len(sources) - held, (answered, reset)
    assert peak <= bound, f"peak RSS {peak / 2**20:.0f} MiB over the bound {bound / 2**20:.0f}"
    # the connections closed, the intake serves again
    assert post_split(op.url, heartbeat(job), token, context=trust)[0] == 202
    assert_quiet(op)
