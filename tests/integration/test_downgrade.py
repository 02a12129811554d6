"""A downgrade (``helm rollback``) against the real API server (docs/operator.md,
"Downgrade"): this release's replicas rolled back to the previous release's operator
(its own code, tests/integration/previous_release.py) with an incident in flight
(tests/integration/test_upgrade.py's roll, the other way)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sdc_harness.cluster import Cluster, OperatorProcess, wait_for

from .previous_release import THIS, Release
from .test_containment import make_job
from .test_recovery import (
    RESUME_ENV,
    checkpoint,
    condition,
    env_of,
    incident_of,
    snapshot_contain,
    waiting,
)
from .test_upgrade import continued_once, roll_both_replicas


@pytest.mark.slow  # 4 operator processes: 21 to 45 s on the loaded 2 cores
def test_a_rollback_to_the_previous_release_continues_the_incident_once_and_loses_no_report(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
    previous_release: Release,
) -> None:
    """``helm rollback``: this release's two replicas rolled to two of the previous release,
    the standby first, so that the leader, with the replace in flight, hands the Lease to
    a replica of the previous release. The incident this release started continues
    exactly once there; this release's agents, writing version 2, are refused
    it by the previous release (422 naming ``version``), write version 1 from then on and
    lose no report. The previous release is the one released (tests/integration/
    previous_release.py): its own engine reads the incident this release wrote, and its own
    effects find the SageMaker call this release made, against this release's CRDs."""
    rolled = roll_both_replicas(
        cluster,
        namespace,
        tmp_path,
        start_operator,
        old_release=THIS,
        new_release=previous_release,
        first="standby",
    )
    continued_once(rolled)
    (taker,) = rolled.leaders[1:]  # the previous release finished the incident
    assert rolled.leaders[0] == "this-0" and taker.startswith("previous-"), rolled.leaders
    assert rolled.first_versions == [2, 2, 1]  # the previous release refused 2 (422)
    assert all(v.get("2", 0) >= 1 for v in rolled.old_versions), rolled.old_versions
    for c in rolled.counters:
        assert (c["protocol_version"], c["refused"]) == (1, 0), c


@pytest.mark.slow  # two operators one after the other: 14 to 23 s on the loaded 2 cores
def test_the_previous_release_stops_at_once_a_job_this_release_was_waiting_to_stop(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    previous_release: Release,
) -> None:
    """An incident this release wrote while the stop waits for the verified snapshot (fields
    the previous release does not know: ``status.snapshot``, the ``Snapshot`` condition; the
    node quarantined, the job not stopped yet), continued by the previous release after a
    rollback: it does not wait (it has no such wait), stops the job at once, long before the
    recorded deadline, quarantines nothing again and resumes the job from its periodic
    checkpoint; what it does not know stays as this release wrote it."""
    job = make_job(cluster, namespace)
    this = start_operator(snapshot_wait_seconds="600")
    checkpoint(cluster, this, job, 5)  # the periodic one, recorded on the job
    snapshot_contain(cluster, this, job)
    started = wait_for("the wait recorded", incident_of(cluster, job, waiting))
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is False
    this.stop()  # the rollback: this release's replica terminated, the previous one started

    previous = start_operator(extra_env=previous_release.env)

    def resumed(incident: dict[str, Any]) -> bool:
        return any(
            a["action"] == "resume-job" and a.get("result") == "Succeeded"
            for a in (incident.get("status") or {}).get("actions", [])
        )

    done = wait_for("the job stopped and resumed", incident_of(cluster, job, resumed), 30)
    status = done["status"]
    assert [(a["action"], a["result"]) for a in status["actions"]] == [
        ("quarantine-node", "Succeeded"),  # this release's, not taken again
        ("suspend-job", "Succeeded"),
        ("resume-job", "Succeeded"),
    ]
    suspended_at = next(a["at"] for a in status["actions"] if a["action"] == "suspend-job")
    assert suspended_at < status["snapshot"]["deadline"]  # 600 s after the wait began
    assert status["snapshot"] == started["status"]["snapshot"]  # unread, not kept up to date
    assert condition(done, "Snapshot")["status"] == "Unknown"
    assert "lostWork" not in status
    assert status["resumeCheckpoint"]["step"] == 5  # the periodic checkpoint
    resume = [{"name": RESUME_ENV, "value": "10"}]  # at or before the last clean step
    assert env_of(cluster.get_job(namespace, job.name)) == [resume] * 2
    assert [i["metadata"]["name"] for i in cluster.incidents(namespace)] == [
        done["metadata"]["name"]
    ]
    assert "hyperpod_sdc_report_versions_total" not in previous.metrics()  # the previous one
