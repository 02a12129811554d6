"""Two operator replicas: both serve and record, the elected one acts; the leader killed
in the middle of an incident, the standby takes over within the Lease and two retries (with
a 3 s Lease: 4.2 s, asserted within 8.2 s; 11 s with the default 8 s) and finishes it, each
action once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from kubernetes import client

from sdc_harness.cluster import OPERATOR_NAMESPACE, Cluster, OperatorProcess, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker

from .test_containment import make_job, send, verdict

CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}
REPLACE = "BatchReplaceClusterNodes"


def leads(op: OperatorProcess) -> bool:
    return "hyperpod_sdc_leader 1.0" in op.metrics()


def election_requests(op: OperatorProcess) -> float:
    """Requests of the replica's leader election (a standby reads the Lease each round)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in op.metrics().splitlines()
        if line.startswith("hyperpod_sdc_api_requests_total{") and 'client="election"' in line
    )


LEASE_SECONDS = 3.0
"""The replicas' Lease here (the default is 8 s): the takeover is due that long plus two
retries of a fifth of it after the kill, as with the default (docs/operator.md, "Replicas")."""
TAKEOVER_DUE = LEASE_SECONDS + 2 * LEASE_SECONDS / 5


# timing: takeover is due 4.2 s after the kill (3 s Lease, two retries of 0.6 s); asserted
# < 8.2 s: 4 s margin (with the default 8 s Lease it was due at 11 s and asserted < 15 s)
@pytest.mark.timing
def test_the_standby_records_and_takes_over_within_the_lease_finishing_the_incident_once(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    cluster.admit(namespace, remediationPolicy="auto-replace")
    called, answer = threading.Event(), threading.Event()

    def hold(operation: str, params: dict[str, Any]) -> None:
        if operation == REPLACE:
            called.set()
            answer.wait(30)

    fake = FakeSageMaker(on_call=hold)
    try:
        settings: dict[str, Any] = {
            "extra_env": fake.env(),
            "remediation_policy": "auto-replace",
            "lease_seconds": str(LEASE_SECONDS),
        }
        first = start_operator(**settings)
        wait_for("a leader", lambda: leads(first))
        second = start_operator(**settings)
        rounds = election_requests(second)
        wait_for(
            "two election rounds of the standby", lambda: election_requests(second) >= rounds + 2
        )
        assert not leads(second)
        # one report to each replica: the standby's is recorded, not lost
        assert send(cluster, first, job, 0, verdict(job, 0))[0] == 202
        status, body, _ = send(cluster, second, job, 2, verdict(job, 2))
        assert (status, body["phase"]) == (202, "Detected"), body
        assert called.wait(30), "the leader never asked SageMaker to replace the node"
        actions = cluster.incidents(namespace)[0]["status"]["actions"]
        assert [a["action"] for a in actions][:2] == ["suspend-job", "quarantine-node"]
        first.kill()  # SIGKILL with the replace in flight
        killed = time.monotonic()
        answer.set()
        wait_for("the standby to lead", lambda: leads(second), timeout=20)
        took_over = time.monotonic() - killed
        incident = wait_for(
            "Remediated",
            lambda: next(
                (
                    i
                    for i in cluster.incidents(namespace)
                    if i["status"].get("phase") == "Remediated"
                ),
                None,
            ),
        )
        second.resynced(2)
    finally:
        answer.set()
        fake.stop()
    assert fake.invalid == []
    assert took_over < TAKEOVER_DUE + 4, f"the standby took over after {took_over:.1f} s"
    assert fake.count(REPLACE) == 1
    results = [(a["action"], a["result"]) for a in incident["status"]["actions"]]
    assert results.count(("replace-node", "Succeeded")) == 1
    assert results.count(("suspend-job", "Succeeded")) == 1
    assert results.count(("quarantine-node", "Succeeded")) == 1
    print(f"standby took over {took_over:.1f} s after the leader was killed")


def gauge(op: OperatorProcess, name: str) -> float | None:
    for line in op.metrics().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def test_a_replica_that_steps_down_stops_exporting_the_leader_gauges(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The Lease is taken from the leader (as a partition would leave it, or another
    replica): it steps down and no longer exports its count of quarantined nodes, so
    ``max(hyperpod_sdc_quarantined_nodes) > 0`` does not fire for ever on a former leader.
    When it leads again it counts anew."""
    job = make_job(cluster, namespace)
    op = start_operator(lease_seconds="2")
    wait_for("a leader", lambda: leads(op))
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    wait_for("the node counted", lambda: (gauge(op, "hyperpod_sdc_quarantined_nodes") or 0) >= 1)
    leases = client.CoordinationV1Api(cluster.api)
    now = datetime.now(timezone.utc)
    leases.patch_namespaced_lease(
        f"leader-{namespace}",
        OPERATOR_NAMESPACE,
        {"spec": {"holderIdentity": "someone-else", "renewTime": now, "leaseDurationSeconds": 3}},
    )
    wait_for("the leader to step down", lambda: "hyperpod_sdc_leader 0.0" in op.metrics(), 10)
    assert gauge(op, "hyperpod_sdc_quarantined_nodes") is None
    assert gauge(op, "hyperpod_sdc_silent_jobs") is None
    wait_for("it leads again", lambda: leads(op), timeout=20)
    wait_for(
        "the node counted again",
        lambda: (gauge(op, "hyperpod_sdc_quarantined_nodes") or 0) >= 1,
        timeout=10,
    )
