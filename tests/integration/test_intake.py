"""Refusals against the real API server: each answers a clear 4xx and changes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity, encode_report
from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_harness.cluster import (
    Cluster,
    OperatorProcess,
    post,
    post_split,
    self_signed_cert,
    wait_for,
)

from .test_containment import Job, incident_in, make_job, send, verdict


def snapshot(cluster: Cluster, job: Job) -> tuple[Any, ...]:
    """What a refused report must leave as it was."""
    return (
        [i["metadata"]["name"] for i in cluster.incidents(job.namespace)],
        cluster.get_job(job.namespace, job.name)["metadata"]["resourceVersion"],
        [
            cluster.get_node(job.node_name(i))["metadata"]["resourceVersion"]
            for i in range(len(job.nodes))
        ],
    )


@pytest.mark.fast
def test_refusals_change_nothing(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    off = make_job(cluster, namespace, "notoptedin", enabled=False)
    other = make_job(cluster, namespace, "other")
    cluster.pod(namespace, "loose", job.node_name(0), None)  # a pod of no job
    op = start_operator()
    token = cluster.token(namespace, job.pods[0])
    good = encode_report(verdict(job, 0))
    as_dict = json.loads(good)
    before = snapshot(cluster, job)

    wrong_version = dict(as_dict, version=3)
    bad_step = dict(as_dict, step="fifteen")
    lying_node = json.loads(encode_report(verdict(job, 0)))
    lying_node["reporter"]["node"] = job.node_name(1)
    lying_pod = json.loads(encode_report(verdict(job, 0)))
    lying_pod["reporter"]["pod"] = job.pods[1]
    stale = encode_report(verdict(job, 0, sent_at=time.time() - 7200))
    in_an_hour = encode_report(verdict(job, 0, sent_at=time.time() + 3600))
    in_a_century = encode_report(verdict(job, 0, sent_at=time.time() + 100 * 365 * 86400))
    # "kind" twice: a parser that keeps the last one would read a heartbeat
    kind_twice = good.replace(b'"kind":"verdict"', b'"kind":"verdict","kind":"heartbeat"')
    assert kind_twice != good
    cases: list[tuple[str, bytes | str, str | None, str, int, str, str]] = [
        # (what, body, token, content type, status, reason, text in message)
        (
            "malformed JSON",
            b"{not json",
            token,
            "application/json",
            400,
            "malformed",
            "not valid JSON",
        ),
        (
            "wrong version",
            json.dumps(wrong_version),
            token,
            "application/json",
            422,
            "schema",
            "version",
        ),
        ("wrong type", json.dumps(bad_step), token, "application/json", 422, "schema", "step"),
        (
            "oversized",
            b"{" + b" " * 70_000 + b"}",
            token,
            "application/json",
            413,
            "too_large",
            "65536",
        ),
        ("not JSON media type", good, token, "text/plain", 415, "media_type", "application/json"),
        ("no token", good, None, "application/json", 401, "unauthenticated", "Bearer"),
        (
            "invalid token",
            good,
            "not-a-token",
            "application/json",
            401,
            "unauthenticated",
            "token rejected",
        ),
        (
            "wrong audience",
            good,
            cluster.token(namespace, job.pods[0], audience="https://kubernetes.default.svc"),
            "application/json",
            401,
            "unauthenticated",
            "token rejected",
        ),
        (
            "job did not opt in",
            good,
            cluster.token(namespace, off.pods[0]),
            "application/json",
            403,
            "not_opted_in",
            "notoptedin",
        ),
        (
            "pod of no job",
            good,
            cluster.token(namespace, "loose"),
            "application/json",
            403,
            "not_a_job_pod",
            "loose",
        ),
        (
            "another job's token naming this job's rank",
            encode_report(verdict(job, 0))
            .replace(job.pods[0].encode(), other.pods[0].encode())
            .replace(job.node_name(0).encode(), other.node_name(0).encode()),
            cluster.token(namespace, other.pods[0]),
            "application/json",
            422,
            "unknown_suspect",
            "is not a pod of PyTorchJob",
        ),
        (
            "reporter.node lies",
            json.dumps(lying_node),
            token,
            "application/json",
            403,
            "reporter_mismatch",
            "reporter.node",
        ),
        (
            "reporter.pod lies",
            json.dumps(lying_pod),
            token,
            "application/json",
            403,
            "reporter_mismatch",
            "reporter.pod",
        ),
        ("stale", stale, token, "application/json", 422, "stale", "sent_at"),
        ("an hour ahead", in_an_hour, token, "application/json", 422, "future", "sent_at"),
        ("a century ahead", in_a_century, token, "application/json", 422, "future", "sent_at"),
        ("a key twice", kind_twice, token, "application/json", 422, "schema", "kind: is given"),
    ]
    for what, body, tok, content_type, status, reason, text in cases:
        got, answer, _ = post(op.url, body, tok, content_type)
        assert (got, answer.get("error")) == (status, reason), f"{what}: {got} {answer}"
        assert text in answer["message"], f"{what}: {answer['message']!r} lacks {text!r}"
        assert snapshot(cluster, job) == before, f"{what} changed the cluster"
    metrics = op.metrics()
    for reason, count in {
        "malformed": 1,
        "schema": 3,
        "future": 2,
        "unauthenticated": 3,
        "reporter_mismatch": 2,
        "unknown_suspect": 1,
    }.items():
        assert f'hyperpod_sdc_refusals_total{{reason="{reason}"}} {count}.0' in metrics, reason
    assert not [i for i in cluster.incidents(namespace)]


def test_flood_from_one_job_is_rate_limited(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    calm = make_job(cluster, namespace, "calm")
    op = start_operator(rate_per_job="0.5", rate_burst="5")
    token = cluster.token(namespace, job.pods[0])

    def heartbeat(j: Job) -> bytes:
        return encode_report(
            HeartbeatReport(ReporterIdentity(0, j.node_name(0), j.pods[0]), time.time(), 100, 50)
        )

    answers = [post(op.url, heartbeat(job), token) for _ in range(8)]
    assert [a[0] for a in answers] == [202] * 5 + [429] * 3
    assert answers[5][1]["error"] == "rate_limited"
    assert int(answers[5][2]["Retry-After"]) >= 1
    # another job is not slowed by the flood
    assert post(op.url, heartbeat(calm), cluster.token(namespace, calm.pods[0]))[0] == 202
    assert 'hyperpod_sdc_refusals_total{reason="rate_limited"} 3.0' in op.metrics()


@pytest.mark.fast
def test_duplicates_fold_into_one_incident(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    for reporter in (0, 0, 0, 2, 2, 1):
        status, answer, _ = send(cluster, op, job, reporter, verdict(job, reporter))
        assert status == 202, answer
    incident = incident_in(cluster, namespace, "Contained")
    assert len(cluster.incidents(namespace)) == 1
    # Once containment started, a new node's report changes nothing: it is answered from
    # memory and only counted.
    assert sorted(r["node"] for r in incident["status"]["reports"]) == sorted(
        job.node_name(i) for i in (0, 2)
    )
    wait_for(
        "the third node counted",
        lambda: cluster.incidents(namespace)[0]["status"].get("reportingNodes") == 3,
    )
    actions = [(a["action"], a["target"]) for a in incident["status"]["actions"]]
    assert actions == [
        ("suspend-job", f"PyTorchJob {namespace}/train"),
        ("quarantine-node", job.node_name(1)),
        ("resume-job", f"PyTorchJob {namespace}/train"),
    ]


def test_one_node_is_not_enough(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    before = snapshot(cluster, job)
    status, answer, _ = send(cluster, op, job, 0, verdict(job, 0))
    assert (status, answer["phase"]) == (202, "WaitingForAgreement")
    incident = incident_in(cluster, namespace, "WaitingForAgreement")
    op.resynced(2)  # two whole resyncs: still nothing done
    assert snapshot(cluster, job)[1:] == before[1:]
    assert not (cluster.incidents(namespace)[0]["status"].get("actions"))
    assert incident["status"]["conditions"][0]["type"] == "Detected"
    # a second node that names a different suspect does not agree either
    status, answer, _ = send(cluster, op, job, 2, verdict(job, 2, suspect_node=0))
    assert (status, answer["phase"]) == (202, "WaitingForAgreement")
    # a second node that agrees completes it
    status, answer, _ = send(cluster, op, job, 1, verdict(job, 1))
    assert (status, answer["phase"]) == (202, "Detected")
    incident_in(cluster, namespace, "Contained")


def test_dry_run_changes_nothing_but_the_incident(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(dry_run="true")
    before = snapshot(cluster, job)
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    incident = incident_in(cluster, namespace, "DryRun")
    assert [(a["action"], a["result"]) for a in incident["status"]["actions"]] == [
        ("suspend-job", "DryRun"),
        ("quarantine-node", "DryRun"),
    ]
    assert "would quarantine node" in incident["status"]["actions"][1]["message"]
    assert snapshot(cluster, job)[1:] == before[1:]


def test_training_problem_accuses_nobody(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    before = snapshot(cluster, job)
    report = verdict(job, 0, classification="training")
    body = json.loads(encode_report(report))
    body.update(
        suspects=[],
        localized=False,
        check="nonfinite",
        message="every rank computed non-finite gradients",
    )
    for reporter in (0, 1, 2):
        body["reporter"] = {
            "rank": reporter * 2,
            "node": job.node_name(reporter),
            "pod": job.pods[reporter],
        }
        status, answer, _ = post(
            op.url, json.dumps(body), cluster.token(namespace, job.pods[reporter])
        )
        assert (status, answer.get("phase")) == (202, "NotHardware"), answer
    op.resynced()
    assert snapshot(cluster, job)[1:] == before[1:]
    (incident,) = cluster.incidents(namespace)
    assert incident["status"]["phase"] == "NotHardware"
    assert not incident["status"].get("actions")


def test_https_intake_with_the_agents_reporter(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], tmp_path: Path
) -> None:
    key, cert = self_signed_cert(tmp_path)
    job = make_job(cluster, namespace)
    op = start_operator(tls_cert_file=str(cert), tls_key_file=str(key), scheme="https")
    token_file = tmp_path / "token"
    token_file.write_text(cluster.token(namespace, job.pods[0]))
    reporter = Reporter(
        ReporterConfig(operator_url=op.url, token_file=str(token_file), ca_bundle=str(cert))
    )
    reporter.submit(
        HeartbeatReport(ReporterIdentity(0, job.node_name(0), job.pods[0]), time.time(), 100, 50)
    )
    assert reporter.flush(timeout=20)
    assert (reporter.delivered, reporter.refused) == (1, 0)
    reporter.close()
    assert 'hyperpod_sdc_reports_total{kind="heartbeat",verdict=""} 1.0' in op.metrics()
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        post(op.url, b"{}", "t")  # a client that does not trust the certificate


def test_bad_setting_stops_the_operator_with_a_clear_message() -> None:
    env = {**os.environ, "HYPERPOD_SDC_AGREEMENT_NODES": "none"}
    done = subprocess.run(
        [sys.executable, "-m", "sdc_operator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "HYPERPOD_SDC_AGREEMENT_NODES: expected an integer, got 'none'" in done.stderr


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_report_split_across_segments_and_records_is_accepted(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
    scheme: str,
) -> None:
    """A verdict whose body arrives in several writes 10 ms apart (as a busy network or
    TLS delivers a 58 KB report) is read whole, not parsed half-read."""
    job = make_job(cluster, namespace)
    context = None
    settings: dict[str, str] = {}
    if scheme == "https":
        key, cert = self_signed_cert(tmp_path)
        settings = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
        context = ssl.create_default_context(cafile=str(cert))
    op = start_operator(scheme=scheme, **settings)
    big = verdict(job, 0)
    big = dataclasses.replace(big, evidence={"padding": "x" * 50_000})
    body = encode_report(big)
    assert len(body) > 50_000
    for reporter, pieces in ((0, 2), (2, 7)):
        report = dataclasses.replace(
            big,
            reporter=ReporterIdentity(reporter * 2, job.node_name(reporter), job.pods[reporter]),
        )
        status, answer = post_split(
            op.url,
            encode_report(report),
            cluster.token(namespace, job.pods[reporter]),
            pieces=pieces,
            context=context,
        )
        assert (status, answer.get("accepted")) == (202, "verdict"), answer
    incident_in(cluster, namespace, "Contained")
