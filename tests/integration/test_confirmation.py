"""The confirmation run against the real API server, with the operator as a real process:
the pod made once (a restart in the middle makes no second), its result recorded
(``Confirmed`` True, False, Unknown with the reason), and ``auto-replace-confirmed``
replacing only the confirmed node (the loopback SageMaker counts the calls).

The bundles are written by the stand-in training script of the confirmation's own tests
(tests/unit/training_script.py: a real audit-like flow on the CPU); the pods are run by
a stand-in kubelet (scripts/sdc_harness/kubelet.py) as local processes of
``python -m sdc_agent.confirm``, with the emulated broken GPU
(``HYPERPOD_SDC_FAULTS``) where the node is the faulty one."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiException

from sdc_agent.protocol import VerdictReport
from sdc_harness import kubelet
from sdc_harness.cluster import Cluster, OperatorProcess, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_operator.cli import render_describe

from .test_containment import Job, make_job, send, verdict

ROOT = Path(__file__).resolve().parents[2]
TRAINING_SCRIPT = ROOT / "tests" / "unit" / "training_script.py"
# tests/unit/training_script.py's emulated broken GPU (rank 3, from step 23)
FAULT = "rank=3,step=23,site=forward,kind=relative,persistent=true,index=all"
CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared checkpoint volume (a hostPath here), with one bundle in it."""
    root = tmp_path_factory.mktemp("fsx")
    done = subprocess.run(
        [sys.executable, str(TRAINING_SCRIPT), str(root / "run"), "pickle"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "sidecar")},
    )
    assert done.returncode == 0, done.stderr
    return root


def bundle_in(checkpoints: Path) -> str:
    (found,) = (checkpoints / "run" / "ckpt" / "sdc-evidence").iterdir()
    return str(found)


def with_volume(cluster: Cluster, job: Job, mount: Path) -> None:
    """The job's containers mount the checkpoint volume (where the agent writes bundles)."""
    container = {
        "name": "pytorch",
        "image": "example.com/train:1",
        "env": [{"name": "A", "value": "1"}],
        "volumeMounts": [{"name": "checkpoints", "mountPath": str(mount)}],
    }
    template = {
        "spec": {
            "containers": [container],
            "volumes": [{"name": "checkpoints", "hostPath": {"path": str(mount)}}],
        }
    }
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org",
        "v1",
        job.namespace,
        "pytorchjobs",
        job.name,
        {
            "spec": {
                "pytorchReplicaSpecs": {
                    "Master": {"template": template},
                    "Worker": {"template": template},
                }
            }
        },
    )


def with_bundle(report: VerdictReport, bundle: str | None) -> VerdictReport:
    return dataclasses.replace(report, bundle=bundle, corroborated=True)


def contain(cluster: Cluster, op: OperatorProcess, job: Job, bundle: str | None) -> None:
    for reporter in (0, 2):
        code = send(cluster, op, job, reporter, with_bundle(verdict(job, reporter), bundle))[0]
        assert code == 202


def incident_of(cluster: Cluster, namespace: str, job: str) -> dict[str, Any] | None:
    found = [i for i in cluster.incidents(namespace) if i["spec"]["job"]["name"] == job]
    return found[0] if found else None


def confirmed(cluster: Cluster, namespace: str, job: str, timeout: float = 30) -> dict[str, Any]:
    """The job's incident once its confirmation has a result."""

    def done() -> dict[str, Any] | None:
        found = incident_of(cluster, namespace, job)
        outcome = ((found or {}).get("status") or {}).get("confirmation", {}).get("outcome")
        return found if outcome in ("confirmed", "not-confirmed", "unknown") else None

    return wait_for(f"the confirmation of {job}", done, timeout=timeout)


def condition(incident: dict[str, Any]) -> tuple[str, str, str]:
    c = next(c for c in incident["status"]["conditions"] if c["type"] == "Confirmed")
    return c["status"], c["reason"], c["message"]


def pods_for(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    return [
        p
        for p in kubelet.confirmation_pods(cluster, namespace)
        if p["metadata"]["labels"].get("hyperpod-sdc.dev/job") == job
    ]


def one_pod(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    return wait_for(
        f"the confirmation pod of {job}",
        lambda: next(iter(pods_for(cluster, namespace, job)), None),
    )


def rewrite_status(
    cluster: Cluster, namespace: str, job: str, change: Callable[[dict[str, Any]], None]
) -> None:
    """The job's incident's status as ``change`` makes it, written back (what a crash of
    the operator at some point leaves)."""
    incident = incident_of(cluster, namespace, job)
    assert incident is not None
    change(incident["status"])
    cluster.custom.replace_namespaced_custom_object_status(
        "hyperpod-sdc.dev",
        "v1alpha1",
        namespace,
        "sdcincidents",
        incident["metadata"]["name"],
        incident,
    )


def confirmation_forgotten(cluster: Cluster, namespace: str, job: str) -> None:
    """The incident's confirm-node action set back to Pending and its result removed: what a
    crash between creating the pod and recording the result leaves."""

    def forget(status: dict[str, Any]) -> None:
        entry = next(a for a in status["actions"] if a["action"] == "confirm-node")
        entry["result"] = "Pending"
        status.pop("confirmation")

    rewrite_status(cluster, namespace, job, forget)


def events(cluster: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.events(namespace) if e["reason"] == reason]


def test_confirmed_once_across_a_restart_and_recorded(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
    tmp_path: Path,
) -> None:
    job = make_job(cluster, namespace)
    with_volume(cluster, job, checkpoints)
    bundle = bundle_in(checkpoints)
    op = start_operator()
    contain(cluster, op, job, bundle)
    pod = one_pod(cluster, namespace, "train")
    assert kubelet.pinned_node(pod) == job.node_name(1)
    assert pod["spec"]["containers"][0]["args"][0] == bundle
    owner = pod["metadata"]["ownerReferences"][0]
    incident = incident_of(cluster, namespace, "train")
    assert incident is not None and owner["uid"] == incident["metadata"]["uid"]
    wait_for(
        "Confirmed=Unknown (Running)",
        lambda: condition(incident_of(cluster, namespace, "train") or {})[1] == "Running",
    )
    # The operator dies after creating the pod; its successor finds the action recorded
    # Pending (as if the result had never been written) and the pod already there.
    op.kill()
    confirmation_forgotten(cluster, namespace, "train")
    op = start_operator()
    wait_for(
        "the action verified",
        lambda: (
            next(
                a
                for a in (incident_of(cluster, namespace, "train") or {})["status"]["actions"]
                if a["action"] == "confirm-node"
            )["result"]
            == "Succeeded"
        ),
    )
    assert len(pods_for(cluster, namespace, "train")) == 1
    started = next(
        a
        for a in (incident_of(cluster, namespace, "train") or {})["status"]["actions"]
        if a["action"] == "confirm-node"
    )
    assert "found" in started["message"] and started["intent"]["pod"] == pod["metadata"]["name"]
    # The stand-in kubelet runs it on the faulty node, where the emulated GPU is broken.
    assert kubelet.run(cluster, pod, tmp_path / "pod", {"HYPERPOD_SDC_FAULTS": FAULT}) == 3
    incident = confirmed(cluster, namespace, "train")
    status_, reason, message = condition(incident)
    assert (status_, reason) == ("True", "Reproduced")
    assert f"GPU 0 (local rank 1) of node {job.node_name(1)} reproduced it" in message
    record = incident["status"]["confirmation"]
    assert (record["outcome"], record["exitCode"], record["node"]) == (
        "confirmed",
        3,
        job.node_name(1),
    )
    assert record["pod"] == pod["metadata"]["name"] and record["bundle"] == bundle
    (gpu,) = record["gpus"]
    assert (gpu["index"], gpu["localRank"], gpu["result"]) == (0, 1, "reproduces")
    assert gpu["seconds"] > 0
    # the manual policy: nothing else happens, a person decides
    assert incident["status"]["phase"] in ("Contained", "Resumed")
    assert not [a for a in incident["status"]["actions"] if a["action"].endswith("place-node")]
    wait_for("the Event", lambda: events(cluster, namespace, "SDCConfirmed"))
    wait_for(
        "the metric",
        lambda: 'hyperpod_sdc_confirmations_total{outcome="confirmed"} 1.0' in op.metrics(),
    )
    table = cluster.kubectl("get", "sdci", "-n", namespace)
    assert "CONFIRMED" in table.splitlines()[0] and "confirmed" in table.splitlines()[1]
    # kubectl sdc describe reads the same fields
    described = render_describe(incident, [])
    assert "Confirmed=True (Reproduced)" in described
    assert f"outcome confirmed on node {job.node_name(1)}" in described
    assert any(
        line.split()[:4] == ["0", "1", "-", "reproduces"] for line in described.splitlines()
    ), described
    assert f"bundle: {bundle}" in described
    assert len(pods_for(cluster, namespace, "train")) == 1


def test_two_incidents_of_one_node_share_one_confirmation_pod(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
    tmp_path: Path,
) -> None:
    """The job caught twice before its suspension lands (step 15, then 25): two incidents
    accuse one node. Each confirmation pod asks for every GPU of the node, so a second pod
    would never start (it ended ``Unknown/NotStarted``): the second incident shares the
    first's pod, and the one run's result is recorded for both."""
    job = make_job(cluster, namespace)
    with_volume(cluster, job, checkpoints)
    bundle = bundle_in(checkpoints)
    op = start_operator()
    for step in (15, 25):
        for reporter in (0, 2):
            report = dataclasses.replace(verdict(job, reporter), step=step)
            assert send(cluster, op, job, reporter, with_bundle(report, bundle))[0] == 202

    def both_running() -> list[dict[str, Any]] | None:
        found = [
            i
            for i in cluster.incidents(namespace)
            if (i.get("status") or {}).get("confirmation", {}).get("outcome") == "running"
        ]
        return found if len(found) == 2 else None

    running = wait_for("both confirmations running", both_running)
    (pod,) = pods_for(cluster, namespace, "train")
    records = [i["status"]["confirmation"] for i in running]
    assert {(r["pod"], r["podUid"]) for r in records} == {
        (pod["metadata"]["name"], pod["metadata"]["uid"])
    }
    (sharer,) = [i for i in running if i["status"]["confirmation"].get("sharedFrom")]
    (owner,) = [i for i in running if i is not sharer]
    assert sharer["status"]["confirmation"]["sharedFrom"] == owner["metadata"]["name"]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    shared = next(a for a in sharer["status"]["actions"] if a["action"] == "confirm-node")
    assert "shares the confirmation pod" in shared["message"], shared
    assert kubelet.run(cluster, pod, tmp_path / "pod", {"HYPERPOD_SDC_FAULTS": FAULT}) == 3

    def both_confirmed() -> list[dict[str, Any]] | None:
        found = [
            i
            for i in cluster.incidents(namespace)
            if (i.get("status") or {}).get("confirmation", {}).get("outcome") == "confirmed"
        ]
        return found if len(found) == 2 else None

    for incident in wait_for("both confirmed", both_confirmed):
        assert condition(incident)[:2] == ("True", "Reproduced")
        assert incident["status"]["confirmation"]["podUid"] == pod["metadata"]["uid"]
    assert len(pods_for(cluster, namespace, "train")) == 1


def result_recorded_before_the_delete(cluster: Cluster, namespace: str, job: str) -> None:
    """What an operator that gave the pod up and died before deleting it leaves: the
    result (``Unknown/NotStarted``) recorded, the pod still there."""
    why = "not started 300 s after it was created (phase Pending)"

    def give_up(status: dict[str, Any]) -> None:
        status["confirmation"] = {
            **status["confirmation"],
            "outcome": "unknown",
            "reason": why,
            "finishedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (said,) = [c for c in status["conditions"] if c["type"] == "Confirmed"]
        said.update(status="Unknown", reason="NotStarted", message=why)

    rewrite_status(cluster, namespace, job, give_up)


def test_a_pod_left_by_a_crash_after_its_result_was_recorded_is_deleted_once_on_restart(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
) -> None:
    """The operator recorded that it gave a confirmation pod up and died before deleting
    it: the pod, scheduled on the quarantined node, would hold its GPUs until its deadline.
    The next operator deletes it at its start, once (by its uid: one DELETE, and the
    pod, Terminating with no kubelet here, is not deleted again at the next passes),
    while another job's confirmation pod that its incident still reads is left alone.
    Without the sweep the pod stays."""
    bundle = bundle_in(checkpoints)
    jobs = [make_job(cluster, namespace, name) for name in ("train", "other")]
    op = start_operator()
    for job in jobs:
        with_volume(cluster, job, checkpoints)
        contain(cluster, op, job, bundle)
    pods = {job.name: one_pod(cluster, namespace, job.name) for job in jobs}

    def running(name: str) -> bool:
        status = (incident_of(cluster, namespace, name) or {}).get("status") or {}
        return bool(status.get("confirmation", {}).get("podUid"))

    for job in jobs:
        wait_for(f"{job.name}'s confirmation running", functools.partial(running, job.name))
    left = pods["train"]
    kubelet.bind(cluster, left, kubelet.pinned_node(left))  # scheduled: it holds the GPUs
    op.kill()
    result_recorded_before_the_delete(cluster, namespace, "train")
    op = start_operator()

    def deleted() -> bool:
        found = pods_for(cluster, namespace, "train")
        return not found or all(p["metadata"].get("deletionTimestamp") for p in found)

    wait_for("the left-over confirmation pod deleted", deleted)
    (terminating,) = pods_for(cluster, namespace, "train")  # no kubelet: Terminating
    assert terminating["metadata"]["uid"] == left["metadata"]["uid"]
    op.resynced(2)  # two more whole passes, each with its sweep
    deletes = [
        float(line.rsplit(" ", 1)[1])
        for line in op.metrics().splitlines()
        if line.startswith("hyperpod_sdc_api_requests_total{")
        and all(f'{k}="{v}"' in line for k, v in (("verb", "delete"), ("resource", "pods")))
    ]
    assert sum(deletes) == 1, deletes
    assert "its result is recorded" in op.log()
    (still,) = pods_for(cluster, namespace, "other")
    assert still["metadata"]["uid"] == pods["other"]["metadata"]["uid"]
    assert not still["metadata"].get("deletionTimestamp")
    other = incident_of(cluster, namespace, "other")
    assert other is not None and other["status"]["confirmation"]["outcome"] == "running"


def test_a_tenants_look_alike_pod_under_our_name_is_not_adopted(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
) -> None:
    """With the operator down, a tenant deletes the confirmation pod and makes one of its
    name: owned by the incident, the same images, command, arguments and node, and one
    more env variable (the emulated broken GPU, so that it "reproduces" the fault and
    exits 3: confirmed, and under auto-replace-confirmed the node is replaced). The
    restarted operator, finding the create refused (409), compares the whole spec with
    its own as the API server would store it: ``Confirmed=Unknown`` (``NameTaken``), and
    the pod's exit is never read. (Comparing images, commands and arguments only, as
    before, adopted it.)"""
    job = make_job(cluster, namespace)
    with_volume(cluster, job, checkpoints)
    op = start_operator()
    contain(cluster, op, job, bundle_in(checkpoints))
    pod = one_pod(cluster, namespace, "train")
    # The crash comes after the pod is recorded (confirmation_forgotten removes the record):
    # killed between the create and the record, there would be no record to remove.
    wait_for(
        "Confirmed=Unknown (Running)",
        lambda: condition(incident_of(cluster, namespace, "train") or {})[1] == "Running",
    )
    op.kill()
    meta = pod["metadata"]
    cluster.core.delete_namespaced_pod(meta["name"], namespace, grace_period_seconds=0)
    wait_for("the pod gone", lambda: not pods_for(cluster, namespace, "train"))
    spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
    spec["containers"][0]["env"].append({"name": "HYPERPOD_SDC_FAULTS", "value": FAULT})
    keep = ("name", "labels", "annotations", "ownerReferences")
    body = {"metadata": {k: meta[k] for k in keep if k in meta}, "spec": spec}
    cluster.core.create_namespaced_pod(namespace, body)
    confirmation_forgotten(cluster, namespace, "train")
    start_operator()
    incident = confirmed(cluster, namespace, "train")
    status_, reason, message = condition(incident)
    assert (status_, reason) == ("Unknown", "NameTaken"), message
    assert "spec.containers is not ours" in message, message
    assert "podUid" not in incident["status"]["confirmation"]


def test_a_confirmation_pod_whose_image_a_tenant_patched_is_not_believed(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
) -> None:
    """A tenant with patch on pods swaps the image of the operator's own confirmation pod
    (an image's the one field of a pod's spec that may change) for one that exits 3
    "confirmed": the result is read only while the pod runs the images recorded when it
    was created, so ``Confirmed=Unknown`` (``PodChanged``). The clean run of the same pod is
    test_confirmed_once_across_a_restart_and_recorded (its images recorded and believed)."""
    job = make_job(cluster, namespace)
    with_volume(cluster, job, checkpoints)
    op = start_operator()
    contain(cluster, op, job, bundle_in(checkpoints))
    pod = one_pod(cluster, namespace, "train")
    wait_for(
        "Confirmed=Unknown (Running)",
        lambda: condition(incident_of(cluster, namespace, "train") or {})[1] == "Running",
    )
    running = incident_of(cluster, namespace, "train") or {}
    assert running["status"]["confirmation"]["images"] == {
        "confirm": pod["spec"]["containers"][0]["image"]
    }
    cluster.core.patch_namespaced_pod(
        pod["metadata"]["name"],
        namespace,
        [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil.example/ok:1"}],
    )
    exited = {"terminated": {"exitCode": 3, "message": "{}", "finishedAt": "2026-01-01T00:00:00Z"}}
    failed = {"phase": "Failed", "containerStatuses": [kubelet.container_status(exited)]}
    try:  # the swapped image runs and exits "confirmed"...
        kubelet.bind(cluster, pod, kubelet.pinned_node(pod))
        kubelet.set_status(cluster, pod, failed)
    except ApiException as exc:  # ...unless the operator saw the patch first and deleted the pod
        if exc.status not in (404, 409):
            raise
    incident = confirmed(cluster, namespace, "train")
    status_, reason, message = condition(incident)
    assert (status_, reason) == ("Unknown", "PodChanged"), message
    assert "its images were changed since it was created (confirm)" in message


def test_auto_replace_confirmed_replaces_only_the_confirmed_node(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
    checkpoints: Path,
    tmp_path: Path,
) -> None:
    """Two jobs, one bundle each: on the faulty job's node the fault comes back
    (confirmed: replaced); the other job's node computes the reference (not confirmed:
    a person decides, no call)."""
    bad = make_job(cluster, namespace, "bad", labels=CLUSTER_LABEL)
    good = make_job(cluster, namespace, "good", labels=CLUSTER_LABEL)
    for job in (bad, good):
        with_volume(cluster, job, checkpoints)
    cluster.admit(namespace, remediationPolicy="auto-replace-confirmed")
    op = start_operator(extra_env=sagemaker.env(), remediation_policy="auto-replace-confirmed")
    bundle = bundle_in(checkpoints)
    contain(cluster, op, bad, bundle)
    contain(cluster, op, good, bundle)
    op.resynced(2)  # two whole resyncs: nothing is replaced before a confirmation says so
    assert sagemaker.calls == []
    assert (
        kubelet.run(
            cluster,
            one_pod(cluster, namespace, "bad"),
            tmp_path / "bad",
            {"HYPERPOD_SDC_FAULTS": FAULT},
        )
        == 3
    )
    assert kubelet.run(cluster, one_pod(cluster, namespace, "good"), tmp_path / "good") == 0
    assert condition(confirmed(cluster, namespace, "bad"))[:2] == ("True", "Reproduced")
    not_confirmed = confirmed(cluster, namespace, "good")
    assert condition(not_confirmed)[:2] == ("False", "NotReproduced")
    wait_for(
        "the replacement",
        lambda: (incident_of(cluster, namespace, "bad") or {})["status"]["phase"] == "Remediated",
    )
    op.resynced(2)  # nothing else is replaced
    assert sagemaker.calls == [
        ("BatchReplaceClusterNodes", {"ClusterName": "ml-cluster", "NodeIds": [bad.instance(1)]})
    ]
    good_incident = incident_of(cluster, namespace, "good")
    assert good_incident is not None and good_incident["status"]["phase"] in (
        "Contained",
        "Resumed",
    )
    (said,) = [
        e
        for e in events(cluster, namespace, "SDCNotConfirmed")
        if e["involved_object"]["name"] == good_incident["metadata"]["name"]
    ]
    assert "a person decides: kubectl sdc approve|release" in said["message"]
    metrics = op.metrics()
    assert 'hyperpod_sdc_confirmations_total{outcome="confirmed"} 1.0' in metrics
    assert 'hyperpod_sdc_confirmations_total{outcome="not-confirmed"} 1.0' in metrics


def _unschedulable(cluster: Cluster, pod: dict[str, Any]) -> None:
    kubelet.set_status(
        cluster,
        pod,
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/4 nodes are available: 1 Insufficient nvidia.com/gpu",
                }
            ],
        },
    )


def _image_pull(cluster: Cluster, pod: dict[str, Any]) -> None:
    kubelet.bind(cluster, pod, kubelet.pinned_node(pod))
    state = {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}
    kubelet.set_status(
        cluster, pod, {"phase": "Pending", "containerStatuses": [kubelet.container_status(state)]}
    )


def _deadline(cluster: Cluster, pod: dict[str, Any]) -> None:
    kubelet.bind(cluster, pod, kubelet.pinned_node(pod))
    kubelet.set_status(
        cluster,
        pod,
        {
            "phase": "Failed",
            "reason": "DeadlineExceeded",
            "message": "Pod was active on the node longer than the specified deadline",
        },
    )


@pytest.mark.parametrize(
    ("what", "reason", "said", "deleted"),
    [
        (_unschedulable, "Unschedulable", "Insufficient nvidia.com/gpu", True),
        (_image_pull, "ImagePullFailed", "ImagePullBackOff", True),
        (_deadline, "Timeout", "longer than the specified deadline", False),
    ],
)
def test_a_confirmation_that_cannot_run_says_why_and_changes_nothing_else(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
    what: Callable[[Cluster, dict[str, Any]], None],
    reason: str,
    said: str,
    deleted: bool,
) -> None:
    job = make_job(cluster, namespace)
    with_volume(cluster, job, checkpoints)
    op = start_operator(confirmation_start_seconds="2", remediation_policy="auto-replace-confirmed")
    contain(cluster, op, job, bundle_in(checkpoints))
    pod = one_pod(cluster, namespace, "train")
    what(cluster, pod)
    incident = confirmed(cluster, namespace, "train")
    status, got, message = condition(incident)
    assert (status, got) == ("Unknown", reason) and said in message
    assert incident["status"]["confirmation"]["outcome"] == "unknown"
    if deleted:  # given up: it must not start later and take the GPUs (a pod bound to a
        # node stays Terminating until its kubelet says it stopped: there is none here)
        wait_for(
            "the pod deleted",
            lambda: all(
                p["metadata"].get("deletionTimestamp")
                for p in pods_for(cluster, namespace, "train")
            ),
        )
    # nothing else changes: still quarantined, no remediation, a person decides
    assert incident["status"]["phase"] in ("Contained", "Resumed")
    assert [a["action"] for a in incident["status"]["actions"]][-1] in (
        "confirm-node",
        "resume-job",
    )
    node = cluster.get_node(job.node_name(1))
    assert node["metadata"]["labels"].get("hyperpod-sdc.dev/suspect") == "true"
    wait_for(
        "the metric",
        lambda: 'hyperpod_sdc_confirmations_total{outcome="unknown"} 1.0' in op.metrics(),
    )


def test_no_bundle_and_a_bundle_off_the_volumes_are_unknown_without_a_pod(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    checkpoints: Path,
) -> None:
    plain = make_job(cluster, namespace, "plain")
    mounted = make_job(cluster, namespace, "mounted")
    with_volume(cluster, mounted, checkpoints)
    op = start_operator()
    contain(cluster, op, plain, None)
    contain(cluster, op, mounted, "/elsewhere/sdc-evidence/run-1-15-r3")
    status, reason, message = condition(confirmed(cluster, namespace, "plain"))
    assert (status, reason) == ("Unknown", "NoBundle") and "named no evidence bundle" in message
    status, reason, message = condition(confirmed(cluster, namespace, "mounted"))
    assert (status, reason) == ("Unknown", "CannotConfirm")
    assert "on none of the training container's volumes" in message
    assert kubelet.confirmation_pods(cluster, namespace) == []
    json.dumps(op.metrics())  # the operator is still serving
