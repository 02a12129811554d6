"""The intake's verdict port (docs/operator.md, "Verdicts first"): the real operator, the
real API server, real :class:`sdc_agent.reporter.Reporter`\\ s.

Agents told of the verdict port send their verdicts there, on a connection of their own;
agents of earlier releases (no verdict URL) send them to the intake's main port, which
still accepts them; an agent whose verdict port cannot be reached sends on its kept
connection to the main port at once. Heartbeats are refused on the verdict port.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_common.protocol import encode_report
from sdc_harness.cluster import Cluster, OperatorProcess, free_port, post, wait_for
from sdc_harness.tls import issue, make_ca
from sdc_operator.handlers import VERDICT_PORT_CONNECTIONS

from .storm import (
    Contained,
    Sender,
    _send,
    burst,
    elected,
    heartbeat_reports,
    heartbeats,
    job_of,
    source_of,
    summary,
)
from .test_containment import verdict
from .test_scale import STORM_SETTINGS

NODES = 8


def _reporter(
    tmp_path: Path,
    i: int,
    token: str,
    url: str,
    verdict_url: str | None,
    ca: Path | None = None,
) -> Reporter:
    path = tmp_path / f"token-{i}"
    path.write_text(token)
    return Reporter(
        ReporterConfig(
            operator_url=url,
            verdict_url=verdict_url,
            token_file=str(path),
            ca_bundle=str(ca) if ca else None,
            heartbeat_jitter_seconds=0,
            initial_backoff_seconds=0.1,
        )
    )


def test_verdicts_go_to_the_verdict_port_and_old_agents_still_reach_the_main_port(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    job, tokens = job_of(cluster, namespace, NODES)
    op = start_operator(**STORM_SETTINGS)
    suspect = 5
    new, old, cut_off = elected(NODES, suspect)
    closed = f"http://127.0.0.1:{free_port()}"  # nobody listens there: refused at once
    agents = {
        "new": _reporter(tmp_path, new, tokens[new], op.url, op.verdict_url),
        "old": _reporter(tmp_path, old, tokens[old], op.url, None),
        "cut_off": _reporter(tmp_path, cut_off, tokens[cut_off], op.url, closed),
    }
    beats = heartbeat_reports(job)
    watcher = Contained(cluster, namespace, step=15)
    try:
        for node, agent in zip((new, old, cut_off), agents.values(), strict=True):
            agent.submit(beats[node])
            agent.submit(verdict(job, node, suspect, step=15, last_clean=10))
        for name, agent in agents.items():
            assert agent.flush(30), f"{name}: not delivered within 30 s: {agent.counters()}"
        contained = watcher.wait(30)
        counts = {
            name: (a.delivered, a.refused, a.connections_opened, a.verdict_connections)
            for name, a in agents.items()
        }
    finally:
        for agent in agents.values():
            agent.close(timeout=1)
    print(f"\n(delivered, refused, kept connections, verdict-port connections): {counts}")
    assert contained is not None, "not contained within 30 s"
    # the new agent's verdict went to the verdict port on a connection of its own, its
    # heartbeat on its kept connection to the main port
    assert counts["new"] == (2, 0, 1, 1), counts
    # an agent of an earlier release: both on the main port, accepted as before
    assert counts["old"] == (2, 0, 1, 0), counts
    # the verdict port refused the connection: the verdict went on the kept connection
    assert counts["cut_off"] == (2, 0, 1, 0), counts
    assert agents["cut_off"]._verdict_port_off_until > time.monotonic()
    assert agents["new"]._verdict_port_off_until == 0.0

    # a heartbeat sent to the verdict port is refused, and says where heartbeats go
    status, answer, _ = post(op.verdict_url, encode_report(beats[0]), tokens[0])
    assert (status, answer["error"]) == (421, "misdirected"), answer
    assert "HYPERPOD_SDC_OPERATOR_URL" in str(answer["message"])
    # the verdict port answers with the same checks: a bad token is a 401 there too
    status, answer, _ = post(
        op.verdict_url, encode_report(verdict(job, 1, suspect, step=15, last_clean=10)), "x.y.z"
    )
    assert (status, answer["error"]) == (401, "unauthenticated"), answer


FLOOD = 8
"""Heartbeats per node in the flood of the main port (each on a new TLS connection)."""


# timing: the verdict on the verdict port must be answered within 2 s of the flood's release
# (0.05-0.5 s in most runs here, 1.48 s in one fresh-clone CI) while the main port is
# saturated (a heartbeat sent to it at the same moment is the saturation's observable signal:
# answered 429, or 202 after 1-3 s). Whether the verdict port answers before the main port
# does is printed, not asserted: in that CI run the probe's 429 came at 1.19 s, before it
@pytest.mark.timing
@pytest.mark.slow  # 7 to 10 s loaded (API server start aside): 96 nodes, 768 TLS connections
def test_a_verdict_is_answered_while_heartbeats_saturate_the_main_port(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    ca = make_ca(tmp_path)
    key, cert = issue(tmp_path, ca)
    trust = ssl.create_default_context(cafile=str(ca[1]))
    job, tokens = job_of(cluster, namespace, 96)
    op = start_operator(
        **STORM_SETTINGS,
        log_level="WARNING",
        scheme="https",
        tls_cert_file=str(cert),
        tls_key_file=str(key),
        heartbeat_retry_after_seconds="1",
    )
    warm, _ = burst(op.url, heartbeats(job), tokens, context=trust)  # tokens reviewed
    assert summary(warm)["delivered"] == 96, summary(warm)
    suspect = 50
    new, old, _ = elected(96, suspect)
    agents = {
        "verdict port": _reporter(tmp_path, new, tokens[new], op.url, op.verdict_url, ca[1]),
        "main port (an old agent)": _reporter(tmp_path, old, tokens[old], op.url, None, ca[1]),
    }
    for name, agent in agents.items():  # each opens its kept connection, as agents do
        agent.submit(heartbeat_reports(job)[new if name == "verdict port" else old])
        assert agent.flush(30), agent.counters()

    # the flood: every node's heartbeat 8 times, each on a new TLS connection from an
    # address of its own, released at once; with it, a probe heartbeat and two verdicts.
    # Stopped once both verdicts and the probe were answered: what the senders would retry
    # after that (3,000 more TLS handshakes, 12 s here, as the verdicts' quiet of 5 s and
    # the back-off end) is asserted nowhere.
    start, stop = threading.Event(), threading.Event()
    bodies = heartbeats(job) * FLOOD
    flood = [Sender() for _ in bodies]
    probe = Sender()
    threads = [
        threading.Thread(
            target=_send,
            args=(op.url, body, tokens[i % 96], sender, start, trust, source_of(i), True, stop),
            daemon=True,
        )
        for i, (body, sender) in enumerate(zip(bodies, flood, strict=True))
    ] + [
        threading.Thread(
            target=_send,
            args=(op.url, heartbeats(job)[0], tokens[0], probe, start, trust, None, True, stop),
            daemon=True,
        )
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # every thread waiting at the line
    watcher = Contained(cluster, namespace, step=115)
    released = time.monotonic()
    start.set()
    for node, agent in zip((new, old), agents.values(), strict=True):
        agent.submit(verdict(job, node, suspect, step=115, last_clean=110))
    answered = {}
    for name, agent in agents.items():
        assert agent.flush(30), f"{name}: {agent.counters()}"
        answered[name] = time.monotonic() - released
    wait_for("the probe's first answer", lambda: probe.attempts, timeout=30)
    stop.set()
    for thread in threads:
        thread.join(30)
    contained = watcher.wait(30)
    for agent in agents.values():
        agent.close(timeout=1)
    probe_s = probe.attempts[0][1] if probe.attempts else None
    got = summary(flood)
    print(
        f"\nverdicts delivered after {answered} (since the release); a heartbeat sent to the "
        f"main port with them answered after {probe_s} s ({probe.attempts[0][0]}); the flood "
        f"of {len(bodies)} (stopped after those answers): {got}; contained after "
        f"{contained and round(contained - released, 3)} s"
    )
    assert probe_s is not None
    # the observable signal: the main port was saturated (a shed, or an answer that waited
    # behind the flood) while the verdict was answered
    assert probe.attempts[0][0] == "429" or probe_s > 0.5, probe.attempts
    assert answered["verdict port"] < 2.0, answered
    assert agents["verdict port"].verdict_connections == 1
    assert contained is not None, "not contained within 30 s"


def test_a_full_verdict_port_sends_the_agent_to_the_main_port(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """The verdict port holds at most 64 connections (``VERDICT_PORT_CONNECTIONS``): with
    those held open by someone else (a tenant's idle connections), an agent's verdict
    connection is reset, and the agent delivers its verdict on its kept connection to the
    main port, which the held verdict port keeps from being read only half of the time."""
    job, tokens = job_of(cluster, namespace, NODES)
    op = start_operator(**STORM_SETTINGS, header_timeout_seconds="60")
    parts = urllib.parse.urlsplit(op.verdict_url)
    held: list[socket.socket] = []
    try:
        # idle connections, half a request line each, 8 more than the port holds: the
        # port resets exactly the 8 (each read says so: a reset or the end)
        for _ in range(VERDICT_PORT_CONNECTIONS + 8):
            conn = socket.create_connection((parts.hostname, parts.port), timeout=5)
            conn.sendall(b"POST /v1/rep")
            held.append(conn)
        reset: set[socket.socket] = set()
        deadline = time.monotonic() + 10
        while len(reset) < 8 and time.monotonic() < deadline:
            readable, _, _ = select.select([c for c in held if c not in reset], [], [], 0.5)
            for conn in readable:
                try:
                    if conn.recv(1) == b"":
                        reset.add(conn)
                except ConnectionResetError:
                    reset.add(conn)
        # (and no more within another half second)
        readable, _, _ = select.select([c for c in held if c not in reset], [], [], 0.5)
        assert (len(reset), len(readable)) == (8, 0), (len(reset), len(readable))
        agent = _reporter(tmp_path, 1, tokens[1], op.url, op.verdict_url)
        try:
            agent.submit(heartbeat_reports(job)[1])
            agent.submit(verdict(job, 1, 5, step=15, last_clean=10))
            assert agent.flush(30), agent.counters()
            counts = (agent.delivered, agent.refused, agent.verdict_connections)
            off = agent._verdict_port_off_until
        finally:
            agent.close(timeout=1)
    finally:
        for conn in held:
            conn.close()
    # both delivered: the verdict's connection to the verdict port was reset, and it went
    # on the kept connection to the main port (and so will everything for a minute)
    assert counts == (2, 0, 1), counts
    assert off > time.monotonic()
