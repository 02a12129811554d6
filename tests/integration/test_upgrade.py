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

from .cluster import Cluster, OperatorProcess, post, wait_for
from .test_containment import incident_in, make_job, verdict


def as_previous(report: Report) -> Any:
    """The same report, built by the previous release's agent: the fields it has (those added
    since must be unset: that agent could not send them)."""
    cls = getattr(previous, type(report).__name__)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for f in dataclasses.fields(report):
        if f.name in ("kind", "version", "unreported"):
            continue
        if f.name in known:
            values[f.name] = getattr(report, f.name)
        else:
            assert getattr(report, f.name) == f.default, (
                f"{f.name} is new since the previous release"
            )
    values["reporter"] = previous.ReporterIdentity(**dataclasses.asdict(report.reporter))
    if "suspects" in values:
        values["suspects"] = tuple(
            previous.Suspect(**dataclasses.asdict(s)) for s in values["suspects"]
        )
    return cls(**values)


def beat(job: Any, reporter: int) -> HeartbeatReport:
    v = verdict(job, reporter)
    return HeartbeatReport(reporter=v.reporter, sent_at=time.time(), step=20, last_clean_step=10)


def test_a_previous_agent_is_heard_by_this_operator(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    tokens = {r: cluster.token(namespace, job.pods[r]) for r in (0, 2)}

    def accepted(report: Report, reporter: int) -> bool:
        body = previous.encode_report(as_previous(report))
        assert json.loads(body)["version"] == 1
        status, answer, headers = post(op.url, body, tokens[reporter])
        assert headers[PROTOCOL_HEADER] == "1, 2" and "ignored" not in answer
        if status == 429 and answer["error"] == "shed":  # heartbeats wait behind verdicts
            return False
        assert status == 202, answer
        return True

    for reporter in (0, 2):
        assert accepted(verdict(job, reporter), reporter)
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["status"]["node"] == job.node_name(1)
    for reporter in (0, 2):

        def beat_accepted(r: int = reporter) -> bool:
            return accepted(beat(job, r), r)

        wait_for("a heartbeat accepted", beat_accepted, timeout=20)
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


RECORDED = Path(__file__).parent / "recorded" / "incident-waiting-0.1.0.json"
"""An incident as the release before this one wrote it (one node's report, waiting for a
second), with the names of that run replaced by placeholders."""


def test_an_incident_written_by_the_previous_release_is_read_by_this_operator(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    from sdc_operator.incidents import JobRef, incident_name

    job = make_job(cluster, namespace)
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", namespace, meta["name"], meta["uid"])
    name = incident_name(ref, verdict(job, 0))
    text = RECORDED.read_text().replace("@JOB_UID@", meta["uid"]).replace("@NAMESPACE@", namespace)
    for i in range(3):
        node = job.node_name(i)
        text = text.replace(f"@NODE{i}@", node).replace(f"@INSTANCE{i}@", node[len("hyperpod-") :])
    recorded = json.loads(text)
    recorded["metadata"]["name"] = name
    status = recorded.pop("status")
    args = ("hyperpod-sdc.dev", "v1alpha1", namespace, "sdcincidents")
    cluster.custom.create_namespaced_custom_object(*args, recorded)
    cluster.custom.patch_namespaced_custom_object_status(*args, name, {"status": status})
    op = start_operator()
    # the second node's report agrees with the one the recorded status holds
    code, answer, _ = post(
        op.url, encode_report(verdict(job, 2)), cluster.token(namespace, job.pods[2])
    )
    assert code == 202 and answer["incident"] == f"{namespace}/{name}", answer
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["metadata"]["name"] == name
    assert sorted(r["node"] for r in incident["status"]["reports"]) == sorted(
        job.node_name(i) for i in (0, 2)
    )
