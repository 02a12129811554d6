"""A detection storm: one job of N nodes whose agents all report at the same moment, each
on its own connection with the agent's timeout (5 s) and back-off, against the operator
as a real process. Used by tests/integration/test_scale.py and bench/operator_scale.py.

The senders behave as :class:`sdc_agent.reporter.Reporter` does (HTTP POST, 5 s timeout,
retries of 408, 429, 5xx and connection errors after a full-jitter back-off from 0.5 s,
doubling; with ``retry_after``, a heartbeat's ``Retry-After`` waited out too), and record
every attempt, which the Reporter does not expose.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import watch

from sdc_agent.protocol import HeartbeatReport, Report, ReporterIdentity, encode_report
from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_harness.cluster import Cluster

from .test_containment import Job, verdict

TIMEOUT_SECONDS = 5.0
"""The agent's own per-request timeout (ReporterConfig.timeout_seconds)."""


@dataclass
class Sender:
    """One node's agent: its attempts as (status or exception name, seconds)."""

    attempts: list[tuple[str, float]] = field(default_factory=list)
    delivered_at: float | None = None


SETUP_THREADS = 8
"""Requests made at once while a storm's objects are made: each waits mostly on the API
server (about 10 ms of a sequential request's 20-40 ms on the loaded 2-core machine)."""


def job_of(cluster: Cluster, namespace: str, nodes: int) -> tuple[Job, list[str]]:
    """A job of ``nodes`` pods, one per new node, attested; and each pod's token."""
    body = cluster.job(namespace, "storm", replicas=nodes)
    pods = ["storm-master-0"] + [f"storm-worker-{i}" for i in range(nodes - 1)]
    with ThreadPoolExecutor(SETUP_THREADS) as pool:
        created = list(pool.map(lambda _: cluster.node(), range(nodes)))
        list(
            pool.map(
                lambda pod, node: cluster.pod(namespace, pod, node["metadata"]["name"], body),
                pods,
                created,
            )
        )
    return Job(namespace, "storm", body, created, pods), tokens(cluster, namespace, pods)


def tokens(cluster: Cluster, namespace: str, pods: list[str]) -> list[str]:
    """Each pod's token (a TokenRequest bound to the pod), in the order of ``pods``."""
    with ThreadPoolExecutor(SETUP_THREADS) as pool:
        return list(pool.map(lambda pod: cluster.token(namespace, pod), pods))


def _send(
    url: str,
    body: bytes,
    token: str,
    sender: Sender,
    start: threading.Event,
    context: ssl.SSLContext | None = None,
    source: str | None = None,
    retry_after: bool = False,
    stop: threading.Event | None = None,
) -> None:
    """One agent's report, tried until it is delivered or refused (or ``stop`` is set:
    no attempt is begun after it)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname and parts.port
    # the Reporter waits out a Retry-After for anything but a verdict
    heeds = retry_after and json.loads(body).get("kind") != "verdict"
    start.wait()
    attempt = 0
    deadline = time.monotonic() + 120
    bind = (source, 0) if source else None
    stop = stop or threading.Event()
    while time.monotonic() < deadline and not stop.is_set():
        began = time.monotonic()
        outcome = ""
        told: str | None = None
        conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(
                parts.hostname,
                parts.port,
                timeout=TIMEOUT_SECONDS,
                context=context,
                source_address=bind,
            )
            if parts.scheme == "https"
            else http.client.HTTPConnection(
                parts.hostname, parts.port, timeout=TIMEOUT_SECONDS, source_address=bind
            )
        )
        try:
            conn.request(
                "POST",
                "/v1/reports",
                body=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            )
            response = conn.getresponse()
            response.read()
            outcome = str(response.status)
            told = response.getheader("Retry-After")
        except (OSError, http.client.HTTPException) as exc:
            outcome = type(exc).__name__
        finally:
            conn.close()
        sender.attempts.append((outcome, time.monotonic() - began))
        if outcome.isdigit() and int(outcome) < 300:
            sender.delivered_at = time.monotonic()
            return
        if outcome.isdigit() and int(outcome) not in (408, 429) and int(outcome) < 500:
            return  # refused: the agent does not retry
        wait = random.uniform(0, min(30.0, 0.5 * 2**attempt))
        if heeds and told is not None:
            wait = max(wait, min(float(told), 3600.0))
        stop.wait(wait)
        attempt += 1


def burst(
    url: str,
    bodies: list[bytes],
    tokens: list[str],
    context: ssl.SSLContext | None = None,
    sources: list[str] | None = None,
    retry_after: bool = False,
) -> tuple[list[Sender], float]:
    """Every body sent at once, each from its own thread and connection (from
    ``sources[i]`` where given); the senders and the monotonic time they were released.
    ``retry_after``: a heartbeat answered with ``Retry-After`` waits that long (its back-off,
    if longer), as the Reporter's does; without it, the back-off alone (the senders of
    bench/operator_scale.py's storms so far, which retry a shed heartbeat sooner)."""
    start = threading.Event()
    senders = [Sender() for _ in bodies]
    where = sources or [None] * len(bodies)  # type: ignore[list-item]
    threads = [
        threading.Thread(
            target=_send, args=(url, b, t, s, start, context, a, retry_after), daemon=True
        )
        for b, t, s, a in zip(bodies, tokens, senders, where, strict=True)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # every thread waiting at the line
    released = time.monotonic()
    start.set()
    for thread in threads:
        thread.join(150)
    return senders, released


class Agent(Reporter):
    """A node's agent as it reports: :class:`sdc_agent.reporter.Reporter` itself (its one
    kept connection, verdicts first, the 5 s timeout, back-off, ``Retry-After`` for
    heartbeats), its connection bound to ``source``, with every attempt of every report
    recorded in a :class:`Sender` (which the Reporter does not expose)."""

    def __init__(self, config: ReporterConfig, source: str | None = None) -> None:
        self.source = source
        self.senders: dict[int, Sender] = {}
        self._status = ""
        super().__init__(config)

    def send(self, report: Report) -> Sender:
        """Submit ``report``; its :class:`Sender` fills as it is attempted."""
        sender = self.senders[id(report)] = Sender()
        self.submit(report)
        return sender

    def _open(self, context: ssl.SSLContext | None, url: str) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(url)
        bind = (self.source, 0) if self.source else None
        timeout = self.config.timeout_seconds
        if context is not None:
            return http.client.HTTPSConnection(
                parts.hostname or "", parts.port, timeout=timeout, context=context,
                source_address=bind,
            )  # fmt: skip
        return http.client.HTTPConnection(
            parts.hostname or "", parts.port, timeout=timeout, source_address=bind
        )

    def _post(
        self, body: bytes, headers: dict[str, str], verdict_lane: bool = False
    ) -> tuple[int, bytes, str | None, str | None]:
        try:
            answer = super()._post(body, headers, verdict_lane)
        except BaseException as exc:
            self._status = type(exc).__name__
            raise
        self._status = str(answer[0])
        return answer

    def _send(self, report: Report) -> str:
        began = time.monotonic()
        self._status = ""
        outcome = super()._send(report)
        sender = self.senders.get(id(report))
        if sender is not None:
            sender.attempts.append((self._status or outcome, time.monotonic() - began))
            if outcome == "delivered":
                sender.delivered_at = time.monotonic()
        return outcome


def agents(
    urls: list[str],
    tokens: list[str],
    directory: Path,
    ca: Path | None,
    sources: list[str | None],
    verdict_urls: list[str | None] | None = None,
) -> list[Agent]:
    """One :class:`Agent` per node, reporting to ``urls[i]`` (and its verdicts to
    ``verdict_urls[i]``, where given), token files written under ``directory``, heartbeats
    sent at once (no jitter: the worst case, every heartbeat of the job together)."""
    out = []
    directory.mkdir(parents=True, exist_ok=True)
    verdict_urls = verdict_urls or [None] * len(urls)
    for i, (url, token, source) in enumerate(zip(urls, tokens, sources, strict=True)):
        path = directory / f"token-{i}"
        path.write_text(token)
        config = ReporterConfig(
            operator_url=url,
            verdict_url=verdict_urls[i],
            token_file=str(path),
            ca_bundle=str(ca) if ca else None,
            heartbeat_jitter_seconds=0,
            timeout_seconds=TIMEOUT_SECONDS,
        )
        out.append(Agent(config, source))
    return out


def release(
    agents: list[Agent], reports: list[tuple[int, Report]], timeout: float = 150
) -> tuple[list[Sender], float]:
    """Every ``(node, report)`` submitted to its node's agent at once (a node's reports in
    the order given: its Reporter sends a verdict ahead of its heartbeat); the senders, in
    that order, and the monotonic time they were released. Waits until every agent has
    delivered or given up, at most ``timeout`` seconds."""
    released = time.monotonic()
    senders = [agents[node].send(report) for node, report in reports]
    deadline = released + timeout
    for agent in {node for node, _ in reports}:
        agents[agent].flush(max(0.1, deadline - time.monotonic()))
    return senders, released


def source_of(node: int) -> str:
    """A loopback address of its own for node ``node``'s agent (127.0.0.0/8 is all
    loopback on Linux): 127.1.0.1, 127.1.0.2, ..."""
    return f"127.{1 + node // 62500}.{(node // 250) % 250}.{1 + node % 250}"


def heartbeats(job: Job) -> list[bytes]:
    return [encode_report(report) for report in heartbeat_reports(job)]


def heartbeat_reports(job: Job) -> list[HeartbeatReport]:
    return [
        (
            HeartbeatReport(
                ReporterIdentity(i, job.node_name(i), job.pods[i]),
                time.time(),
                120,
                100,
                check_seconds={"replay": 0.2},
                interval_seconds=2.0,
            )
        )
        for i in range(len(job.pods))
    ]


def verdicts(job: Job, reporters: list[int], suspect: int, step: int = 15) -> list[bytes]:
    """The verdict every node computes at ``step`` (``suspect``'s second GPU is wrong), as
    sent by ``reporters`` (node indexes)."""
    return [
        encode_report(verdict(job, i, suspect, step=step, last_clean=step - 5)) for i in reporters
    ]


def elected(nodes: int, suspect: int) -> list[int]:
    """Who reports a verdict when the agents elect reporters (3 by default): the suspect's
    replay partners on either side and a witness, never the suspect itself."""
    chosen = []
    for candidate in (suspect - 1, suspect + 1, suspect + 2, suspect - 2):
        index = candidate % nodes
        if index != suspect and index not in chosen:
            chosen.append(index)
    return chosen[:3]


class Contained:
    """Watches the storm job's incidents; ``at`` is when one of detection step ``step``
    was first seen Contained."""

    def __init__(self, cluster: Cluster, namespace: str, step: int = 15) -> None:
        self.step = step
        self.at: float | None = None
        self.incident: dict[str, Any] | None = None
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(cluster, namespace), daemon=True)
        self._thread.start()
        time.sleep(0.3)

    def _run(self, cluster: Cluster, namespace: str) -> None:
        for event in self._watch.stream(
            cluster.custom.list_namespaced_custom_object,
            "hyperpod-sdc.dev",
            "v1alpha1",
            namespace,
            "sdcincidents",
            timeout_seconds=300,
        ):
            obj = event["object"]
            if (obj.get("status") or {}).get("phase") == "Contained" and obj["spec"][
                "detectionStep"
            ] == self.step:
                self.at = time.monotonic()
                self.incident = obj
                self._watch.stop()
                return

    def wait(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        self._watch.stop()
        return self.at


class HealthProbe:
    """Polls ``/healthz`` every 50 ms; ``worst`` is the slowest answer (seconds)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=10) as response:
                    response.read()
            except OSError:
                self.failures += 1
            self.worst = max(self.worst, time.monotonic() - began)
            self._stop.wait(0.05)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(15)
        return self.worst


def operator_api_requests(metrics: str) -> float:
    """Requests the operator made to the API server (its own counter), watches, the leader
    election and the engine's keep-warm asks (``GET /version``) left out."""
    total = 0.0
    for line in metrics.splitlines():
        if (
            line.startswith("hyperpod_sdc_api_requests_total{")
            and 'verb="watch"' not in line
            and 'client="election"' not in line
            and 'resource="version"' not in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def apiserver_requests(cluster: Cluster) -> float:
    """The API server's own count of the requests it served, watches left out."""
    response = cluster.api.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    response = response[0] if isinstance(response, tuple) else response
    total = 0.0
    for line in response.data.decode().splitlines():
        if line.startswith("apiserver_request_total{") and 'verb="WATCH"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(senders: list[Sender]) -> dict[str, Any]:
    firsts = [s.attempts[0] for s in senders if s.attempts]
    first_ok = [t for o, t in firsts if o.isdigit() and int(o) < 300]
    latencies = sorted(t for _, t in firsts)
    outcomes: dict[str, int] = {}
    for o, _ in firsts:
        outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "senders": len(senders),
        "first_attempt_outcomes": outcomes,
        "first_attempt_accepted": len(first_ok),
        "first_attempt_p50_s": round(latencies[len(latencies) // 2], 4) if latencies else None,
        "first_attempt_p99_s": round(
            latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4
        )
        if latencies
        else None,
        "attempts": sum(len(s.attempts) for s in senders),
        "delivered": sum(1 for s in senders if s.delivered_at is not None),
    }


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
