"""Node writes keep what other writers did: a taint or a cordon added between the
operator's read and its patch survives, and a release keeps another writer's cordon.

The first tests drive the operator's own node code (``sdc_operator.actions``) in this
process against the real API server, with a read made stale on purpose; the last runs the
operator as a process and another controller tainting the node the moment the job stops.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from sdc_harness.cluster import Cluster, OperatorProcess, wait_for
from sdc_operator import incidents, times
from sdc_operator.actions import Actions
from sdc_operator.caches import Caches
from sdc_operator.incidents import JobRef, ResolvedSuspect, Rules
from sdc_operator.kube import Endpoint, Kube
from sdc_operator.names import PRIOR_CORDON_ANNOTATION, SUSPECT_KEY
from sdc_operator.settings import OperatorSettings

from .test_containment import Job, make_job, send, verdict

FOREIGN = {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"}
MERGE = "application/merge-patch+json"


@pytest.fixture
def endpoint(cluster: Cluster) -> Endpoint:
    return Endpoint.load(cluster.kubeconfig)


def incident_for(job: Job) -> dict[str, Any]:
    """An agreed, corroborated incident accusing the job's second node."""
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", job.namespace, job.name, meta["uid"])
    suspect = ResolvedSuspect(3, 1, job.pods[1], job.node_name(1), job.instance(1))
    status: dict[str, Any] = {}
    for reporter in (0, 2):
        status, _ = incidents.fold_report(
            status,
            verdict(job, reporter),
            reporter_pod=job.pods[reporter],
            reporter_node=job.node_name(reporter),
            suspects=[suspect],
            needed=2,
            received_at=times.now_iso(),
        )
    name = incidents.incident_name(ref, verdict(job, 0))
    body = incidents.new_incident(ref, name, verdict(job, 0))
    return {**body, "status": status}


async def _with_actions(endpoint: Endpoint, job: Job, fn: Callable[[Actions, Caches], Any]) -> Any:
    kube = Kube(endpoint, name="test")
    caches = Caches(kube, [job.namespace])
    settings = OperatorSettings(max_quarantined_nodes="100%")

    async def no_event(*_: Any) -> None:
        return None

    try:
        return await fn(Actions(kube, caches, settings, None, no_event), caches)
    finally:
        await kube.close()


def other_writer_taints_and_cordons(cluster: Cluster, node: str) -> None:
    current = cluster.get_node(node)
    taints = [*(current["spec"].get("taints") or []), FOREIGN]
    cluster.core.patch_node(
        node, {"spec": {"taints": taints, "unschedulable": True}}, _content_type=MERGE
    )


def test_a_taint_and_cordon_added_after_our_read_survive_and_the_release_keeps_the_cordon(
    cluster: Cluster, namespace: str, endpoint: Endpoint
) -> None:
    job = make_job(cluster, namespace)
    node = job.node_name(1)
    incident = incident_for(job)
    stale = cluster.get_node(node)  # what the operator's cache holds
    other_writer_taints_and_cordons(cluster, node)  # ... changed before its patch

    async def quarantine_then_release(actions: Actions, caches: Caches) -> tuple[Any, Any]:
        caches.nodes.upsert(stale)
        first = await actions.take(incident, incidents.Action("quarantine-node", node), Rules())
        incident["status"] = first.apply(
            incident["status"], incidents.Action("quarantine-node", node)
        )
        second = await actions.take(incident, incidents.Action("release-node", node), Rules())
        return first, second

    first, second = asyncio.run(_with_actions(endpoint, job, quarantine_then_release))
    assert first.result == "Succeeded", first.message
    assert "cordoned already" in first.message
    assert second.result == "Succeeded", second.message
    released = cluster.get_node(node)
    assert FOREIGN in released["spec"]["taints"]
    assert not any(t["key"] == SUSPECT_KEY for t in released["spec"]["taints"])
    assert released["spec"].get("unschedulable") is True  # the other writer's cordon
    assert SUSPECT_KEY not in (released["metadata"].get("labels") or {})
    assert PRIOR_CORDON_ANNOTATION not in (released["metadata"].get("annotations") or {})


@pytest.mark.fast
def test_quarantine_keeps_a_taint_added_after_our_read(
    cluster: Cluster, namespace: str, endpoint: Endpoint
) -> None:
    job = make_job(cluster, namespace)
    node = job.node_name(1)
    incident = incident_for(job)
    stale = cluster.get_node(node)
    cluster.core.patch_node(node, {"spec": {"taints": [FOREIGN]}}, _content_type=MERGE)

    async def quarantine(actions: Actions, caches: Caches) -> Any:
        caches.nodes.upsert(stale)
        return await actions.take(incident, incidents.Action("quarantine-node", node), Rules())

    outcome = asyncio.run(_with_actions(endpoint, job, quarantine))
    assert outcome.result == "Succeeded"
    taints = cluster.get_node(node)["spec"]["taints"]
    assert FOREIGN in taints
    assert {"key": SUSPECT_KEY, "value": "true", "effect": "NoSchedule"} in taints


@pytest.mark.parametrize("recordoned", [True, False], ids=["cordoned-again", "untouched"])
def test_release_keeps_a_cordon_someone_else_made_after_the_quarantine(
    cluster: Cluster, namespace: str, endpoint: Endpoint, recordoned: bool
) -> None:
    """A person uncordons and cordons the node again while it is quarantined: the cordon
    is theirs now (the node's managedFields say so), and a release keeps it."""
    job = make_job(cluster, namespace)
    node = job.node_name(1)
    incident = incident_for(job)
    action = incidents.Action("quarantine-node", node)

    async def quarantine(actions: Actions, caches: Caches) -> Any:
        outcome = await actions.take(incident, action, Rules())
        incident["status"] = outcome.apply(incident["status"], action)
        return outcome

    async def release(actions: Actions, caches: Caches) -> Any:
        return await actions.take(incident, incidents.Action("release-node", node), Rules())

    assert asyncio.run(_with_actions(endpoint, job, quarantine)).result == "Succeeded"
    if recordoned:
        cluster.kubectl("uncordon", node)
        cluster.kubectl("cordon", node)
    assert asyncio.run(_with_actions(endpoint, job, release)).result == "Succeeded"
    assert bool(cluster.get_node(node)["spec"].get("unschedulable")) is recordoned


def add_taint_like_a_controller(cluster: Cluster, node: str, taint: dict[str, str]) -> None:
    """Add ``taint`` the way a controller does: read, patch with the read's
    resourceVersion as a precondition, and on a conflict (someone wrote in between: here,
    the operator) read again and retry."""
    for _ in range(20):
        current = cluster.get_node(node)
        taints = [*(current["spec"].get("taints") or []), taint]
        try:
            cluster.core.patch_node(
                node,
                {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                 "spec": {"taints": taints}},
                _content_type=MERGE,
            )  # fmt: skip
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError(f"node {node}: 20 conflicts in a row adding a taint")


def test_another_controllers_taint_right_after_the_job_stops_survives(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The attack run's race: a taint added within milliseconds of containment starting
    (here: the moment the job's suspension shows on the watch), five times."""
    op = start_operator()
    for trial in range(5):
        job = make_job(cluster, namespace, f"race{trial}")
        node = job.node_name(1)
        watching = threading.Event()
        tainted = threading.Event()
        failures: list[BaseException] = []

        def tainter(
            job: Job = job, node: str = node, delay: float = 0.02 * (trial % 3),
            watching: threading.Event = watching, tainted: threading.Event = tainted,
            failures: list[BaseException] = failures,
        ) -> None:  # fmt: skip
            try:
                w = watch.Watch()
                for event in w.stream(
                    cluster.custom.list_namespaced_custom_object,
                    "kubeflow.org",
                    "v1",
                    namespace,
                    "pytorchjobs",
                    field_selector=f"metadata.name={job.name}",
                    timeout_seconds=30,
                ):
                    watching.set()  # the job's ADDED event: the watch is open
                    if event["object"]["spec"].get("runPolicy", {}).get("suspend"):
                        time.sleep(delay)
                        add_taint_like_a_controller(cluster, node, FOREIGN)
                        tainted.set()
                        w.stop()
                        return
            except BaseException as exc:  # reaches the test below, not the thread's void
                failures.append(exc)
                watching.set()

        thread = threading.Thread(target=tainter)
        thread.start()
        assert watching.wait(30), f"trial {trial}: the other controller's watch never opened"
        for reporter in (0, 2):
            assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
        thread.join(30)
        assert not thread.is_alive(), f"trial {trial}: the other controller never saw the stop"
        if failures:
            raise AssertionError(f"trial {trial}: the other controller failed") from failures[0]
        assert tainted.is_set()

        def quarantined(n: str = node) -> bool:
            return SUSPECT_KEY in (cluster.get_node(n)["metadata"].get("labels") or {})

        wait_for("the quarantine", quarantined)
        taints = cluster.get_node(node)["spec"]["taints"]
        assert FOREIGN in taints, f"trial {trial}: the other controller's taint was lost"
    assert len(cluster.incidents(namespace)) == 5
