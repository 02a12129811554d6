"""Agents and operators of different releases against the real API server
(docs/protocol.md, "Versions"): the previous release's agent is heard by this operator, and
this release's agent is heard by the previous release's operator (its intake check,
tests/integration/previous_operator.py), each ending in one contained incident."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_common.protocol import PROTOCOL_HEADER, HeartbeatReport, Report, encode_report
from tests import previous_protocol as previous

from .cluster import Cluster, OperatorProcess, post
from .test_containment import incident_in, make_job, verdict


def as_previous(report: Report) -> Any:
    """The same report, built by the previous release's agent."""
    values = {
        f.name: getattr(report, f.name)
        for f in dataclasses.fields(report)
        if f.name not in ("kind", "version", "unreported")
    }
    values["reporter"] = previous.ReporterIdentity(**dataclasses.asdict(report.reporter))
    if "suspects" in values:
        values["suspects"] = tuple(
            previous.Suspect(**dataclasses.asdict(s)) for s in values["suspects"]
        )
    return getattr(previous, type(report).__name__)(**values)


def beat(job: Any, reporter: int) -> HeartbeatReport:
    v = verdict(job, reporter)
    return HeartbeatReport(reporter=v.reporter, sent_at=time.time(), step=20, last_clean_step=10)


def test_a_previous_agent_is_heard_by_this_operator(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    for reporter in (0, 2):
        token = cluster.token(namespace, job.pods[reporter])
        for report in (beat(job, reporter), verdict(job, reporter)):
            body = previous.encode_report(as_previous(report))
            assert json.loads(body)["version"] == 1
            status, answer, headers = post(op.url, body, token)
            assert status == 202, answer
            assert "ignored" not in answer and headers[PROTOCOL_HEADER] == "1, 2"
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["status"]["node"] == job.node_name(1)
    assert 'hyperpod_sdc_report_versions_total{version="1"} 4.0' in op.metrics()


def test_this_agent_is_heard_by_the_previous_operator(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(module="tests.integration.previous_operator")
    # it is the previous release: it refuses version 2 with its own words, and no header
    token = cluster.token(namespace, job.pods[0])
    status, answer, headers = post(op.url, encode_report(beat(job, 0)), token)
    assert (status, answer["message"]) == (
        422,
        "version: unsupported protocol version 2; this side speaks 1",
    )
    assert PROTOCOL_HEADER not in headers
    reporters = []
    for reporter in (0, 2):
        token_file = tmp_path / f"token-{reporter}"
        token_file.write_text(cluster.token(namespace, job.pods[reporter]))
        r = Reporter(ReporterConfig(operator_url=op.url, token_file=str(token_file)))
        r.submit(beat(job, reporter))
        r.submit(verdict(job, reporter))
        reporters.append(r)
    for r in reporters:
        assert r.flush(timeout=20)
        counters = r.counters()
        r.close()
        assert (counters["delivered"], counters["refused"]) == (2, 0)
        assert (counters["protocol_version"], counters["unreported"]) == (1, {})
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["status"]["node"] == job.node_name(1)
