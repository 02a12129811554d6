"""Heartbeats: no API call each, what they say becomes metrics, and a job whose agents
go quiet gets an Event."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from kubernetes import client

from sdc_agent.protocol import HeartbeatReport, ReplayKind, ReporterIdentity, encode_report
from sdc_harness.cluster import (
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    post,
    shared_settings,
    wait_for,
)
from sdc_operator.leader import HEARTBEATS_ANNOTATION, MEMBER_LABEL

from .test_containment import Job, make_job


def api_calls(op: OperatorProcess) -> float:
    """Requests the operator made to the API server, watches and the engine's keep-warm asks
    (``GET /version``, Kube.keep_warm) left out."""
    total = 0.0
    for line in op.metrics().splitlines():
        if (
            line.startswith("hyperpod_sdc_api_requests_total{")
            and 'verb="watch"' not in line
            and 'resource="version"' not in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def in_member_lease(cluster: Cluster, namespace: str, job: Job) -> bool:
    """The operator's member Lease says when it last heard from the job."""
    lease = shared_settings(namespace)["HYPERPOD_SDC_LEASE_NAME"]
    found = client.CoordinationV1Api(cluster.api).list_namespaced_lease(
        OPERATOR_NAMESPACE, label_selector=f"{MEMBER_LABEL}={lease[:63]}"
    )
    key = f"{namespace}/{job.body['metadata']['uid']}"
    return any(
        key in (item.metadata.annotations or {}).get(HEARTBEATS_ANNOTATION, "")
        for item in found.items
    )


def beat(job: Job, i: int, step: int) -> bytes:
    return encode_report(
        HeartbeatReport(
            ReporterIdentity(i * 2, job.node_name(i), job.pods[i]),
            time.time(),
            step,
            step - 20,
            check_seconds={"replay": 0.1, "weights": 0.05},
            interval_seconds=1.0,
            fingerprint_kernel="eager",
            gradient_tolerance=1e-4,
            bit_reproducible=False,
            replay_dtype="bfloat16",
            replay_cap=2**-7,
            replay_kinds=(
                ReplayKind("loss", 0.0, 0.0),
                ReplayKind("gradients:3", None, 6.7e-3, True),
                ReplayKind("gradients:5", 1e-4, 5e-5),
            ),
        )
    )


def test_heartbeats_cost_no_api_call_become_metrics_and_silence_is_told(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(heartbeat_silence_seconds="3")
    tokens = [cluster.token(namespace, pod) for pod in job.pods]
    for i in range(3):  # the first of each token costs its TokenReview
        assert post(op.url, beat(job, i, 100), tokens[i])[0] == 202
    # the member Lease's first writes (made, then naming the job) are not counted below
    wait_for("the job in the member Lease", lambda: in_member_lease(cluster, namespace, job))
    before = api_calls(op)
    started = time.monotonic()
    for step in range(101, 121):
        for i in range(3):
            assert post(op.url, beat(job, i, step), tokens[i])[0] == 202

    def sample(name: str, value: str, **extra: str) -> str:
        labels = {"namespace": namespace, "job": job.name, **extra}
        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return f"{name}{{{text}}} {value}"

    wanted = [
        sample("hyperpod_sdc_last_clean_step_lag_steps", "20.0"),
        sample("hyperpod_sdc_check_cost_ratio", "0.1", check="replay"),
        sample("hyperpod_sdc_fingerprint_kernel_nodes", "3.0", kernel="eager"),
        sample("hyperpod_sdc_gradient_tolerance", "0.0001"),
        sample("hyperpod_sdc_bit_reproducible", "0.0"),
        sample("hyperpod_sdc_replay_threshold", "0.0001", kind="gradients:5"),
        sample("hyperpod_sdc_replay_threshold", "0.0", kind="loss"),
        sample("hyperpod_sdc_replay_blind", "1.0", kind="gradients:3"),
        sample("hyperpod_sdc_replay_noise", "0.0067", kind="gradients:3"),
        sample("hyperpod_sdc_replay_noise_cap", "0.0078125"),
        sample("hyperpod_sdc_reporting_nodes", "3.0"),
    ]
    # the gauges, refreshed about once a second
    wait_for("the heartbeats' gauges", lambda: [w for w in wanted if w not in op.metrics()] == [])
    spent = time.monotonic() - started
    # 60 heartbeats; only the member Lease is written, about once a second
    assert api_calls(op) - before <= 2 * (spent + 2), (api_calls(op) - before, spent)
    # the agents go quiet
    wait_for(
        "the silence event",
        lambda: any(
            e["reason"] == "SDCAgentsSilent" and e["involved_object"]["name"] == job.name
            for e in cluster.events(namespace)
        ),
        timeout=15,
    )
    assert re.search(r"^hyperpod_sdc_silent_jobs 1\.0$", op.metrics(), re.M)
    assert post(op.url, beat(job, 0, 130), tokens[0])[0] == 202
    wait_for(
        "heard again",
        lambda: any(e["reason"] == "SDCAgentsReporting" for e in cluster.events(namespace)),
    )
    assert re.search(r"^hyperpod_sdc_silent_jobs 0\.0$", op.metrics(), re.M)
