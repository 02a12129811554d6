"""``kubectl sdc`` (the ``kubectl-sdc`` entry point, and through kubectl's plugin lookup)
against the real API server: incidents and Events created directly, as the operator writes
them; one test with the operator running, where ``approve`` leads to the replacement.

Most commands run the CLI's ``main`` in this process, with its own kubeconfig as
``KUBECONFIG`` would give it (a process of its own costs 0.7 s of CPU, kubernetes' import,
each time: 30 of them in this file); the installed entry point runs as a process of its own
in ``test_bad_usage``, and through kubectl's plugin lookup in
``test_through_kubectl_and_the_contexts_namespace``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from sdc_harness.cluster import KUBECTL, Cluster, OperatorProcess, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_operator.incidents import JobRef, incident_name, new_incident
from sdc_operator.names import ACTION_ANNOTATION

from .test_containment import Job, incident_in, make_job, verdict
from .test_remediation import CLUSTER_LABEL, contain

GROUP, VERSION, PLURAL = "hyperpod-sdc.dev", "v1alpha1", "sdcincidents"
CLI = Path(sys.executable).parent / "kubectl-sdc"


def sdc(
    cluster: Cluster, *args: str, plugin: bool = False, process: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the CLI with ``KUBECONFIG`` set to the cluster's: ``kubectl sdc ...``
    (``plugin``), ``kubectl-sdc ...`` (``process``), or else its ``main`` here."""
    if not (plugin or process):
        return _in_process(cluster, list(args))
    assert CLI.is_file(), f"{CLI} is missing: the [project.scripts] entry is not installed"
    env = {
        **os.environ,
        "KUBECONFIG": cluster.kubeconfig,
        "PATH": f"{CLI.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    command = [KUBECTL, "sdc", *args] if plugin else [str(CLI), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def _in_process(cluster: Cluster, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``sdc_operator.cli.main(args)`` as the entry point runs it, its output captured. The
    kubeconfig ``KUBECONFIG`` names is read where the kubernetes client keeps it (from the
    env as it is imported), and the client's default configuration, which the CLI sets,
    is put back after."""
    import contextlib
    import io

    from kubernetes import client
    from kubernetes.config import kube_config

    from sdc_operator import cli

    out, err = io.StringIO(), io.StringIO()
    default = client.Configuration.get_default_copy()
    location = kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = cluster.kubeconfig
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(args)
            except SystemExit as exc:  # argparse's refusals
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = location
        client.Configuration.set_default(default)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


_BASE = datetime.now(timezone.utc)


@pytest.fixture(autouse=True)
def story_clock() -> None:
    """One base time per test: the timestamps of one story never straddle a second
    differently, and all come after the incident's creationTimestamp."""
    global _BASE
    _BASE = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=1)


def at(seconds: float) -> str:
    """A time ``seconds`` into the story (after any incident's creationTimestamp)."""
    return (_BASE + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, status: str, reason: str, message: str, when: str) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
    }


def action(name: str, target: str, result: str, message: str, when: str) -> dict[str, Any]:
    return {"action": name, "target": target, "result": result, "message": message, "at": when}


def record(
    cluster: Cluster,
    job: Job,
    *,
    phase: str,
    quarantined: bool = True,
    extra_actions: tuple[dict[str, Any], ...] = (),
    extra_conditions: tuple[dict[str, Any], ...] = (),
    annotation: str | None = None,
) -> dict[str, Any]:
    """An incident as the operator leaves it in ``phase`` (nodes 0 and 2 reported node 1's
    second GPU)."""
    report = verdict(job, 0)
    ref = JobRef(
        job.body["apiVersion"],
        job.body["kind"],
        job.namespace,
        job.name,
        job.body["metadata"]["uid"],
    )
    name = incident_name(ref, report)
    body = new_incident(ref, name, report)
    if annotation is not None:
        body["metadata"]["annotations"] = {ACTION_ANNOTATION: annotation}
    created = cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, job.namespace, PLURAL, body
    )
    # The story starts at the incident's creation, whenever that came: under load the
    # namespace and the job can take seconds, and a report at story_clock's "1 s" then
    # came before the incident was recorded.
    global _BASE
    created_at = datetime.strptime(created["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    _BASE = max(_BASE, created_at.replace(tzinfo=timezone.utc) + timedelta(seconds=1))
    suspect = job.node_name(1)
    actions = [
        action(
            "suspend-job",
            f"PyTorchJob {job.namespace}/{job.name}",
            "Succeeded",
            "set runPolicy.suspend=true",
            at(3),
        )
    ]
    if quarantined:
        actions.append(
            action("quarantine-node", suspect, "Succeeded", "cordoned; taint ...", at(3))
        )
    contained = (
        condition(
            "Contained",
            "True",
            "NodeQuarantined",
            f"job stopped; node(s) {suspect} cordoned and tainted",
            at(3),
        )
        if quarantined
        else condition(
            "Contained",
            "True",
            "Storm",
            "job stopped; suspects on 3 nodes at once: no node was quarantined",
            at(3),
        )
    )
    created["status"] = {
        "phase": phase,
        "node": suspect,
        "instanceId": job.instance(1),
        "ranks": "3",
        "suspects": [
            {
                "rank": 3,
                "localRank": 1,
                "pod": job.pods[1],
                "node": suspect,
                "instanceId": job.instance(1),
                "gpuUUID": "GPU-5d6e0c1a-0000-0000-0000-000000000001",
            }
        ],
        "reports": [
            {
                "node": job.node_name(r),
                "pod": job.pods[r],
                "rank": 2 * r,
                "receivedAt": at(1 + r / 2),
                "classification": "rank",
                "localized": True,
                "suspectRanks": [3],
            }
            for r in (0, 2)
        ],
        "conditions": [
            condition("Detected", "True", "ReplayCheck", report.message, at(2)),
            contained,
            *extra_conditions,
        ],
        "actions": actions + list(extra_actions),
    }
    return cluster.custom.replace_namespaced_custom_object_status(
        GROUP, VERSION, job.namespace, PLURAL, name, created
    )


def event(
    cluster: Cluster, namespace: str, obj: dict[str, Any], reason: str, message: str, when: str
) -> None:
    meta = obj["metadata"]
    cluster.core.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": f"{meta['name']}.{reason.lower()}-{time.monotonic_ns()}"},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", "v1"),
                "kind": obj.get("kind", "Node"),
                "name": meta["name"],
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": "Warning",
            "firstTimestamp": when,
            "lastTimestamp": when,
            "count": 1,
            "source": {"component": "hyperpod-sdc-operator"},
        },
    )


def annotation_of(cluster: Cluster, incident: dict[str, Any]) -> str | None:
    meta = incident["metadata"]
    got = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, meta["namespace"], PLURAL, meta["name"]
    )
    return (got["metadata"].get("annotations") or {}).get(ACTION_ANNOTATION)


@pytest.mark.fast
def test_describe_prints_the_timeline_in_order(cluster: Cluster, namespace: str) -> None:
    job = make_job(cluster, namespace)
    incident = record(cluster, job, phase="Contained")
    name = incident["metadata"]["name"]
    event(cluster, namespace, incident, "Detected", "rank(s) 3 computed wrong results", at(2))
    event(cluster, namespace, job.body, "SDCJobSuspended", "set runPolicy.suspend=true", at(3))
    node = {"kind": "Node", "metadata": {"name": job.node_name(1)}}
    event(
        cluster,
        "default",
        node,
        "SDCNodeQuarantined",
        "cordoned; taint hyperpod-sdc.dev/suspect",
        at(4),
    )
    other = {"kind": "Node", "metadata": {"name": job.node_name(0)}}
    event(cluster, "default", other, "SDCNodeQuarantined", "not a suspect node", at(4))

    done = sdc(cluster, "describe", name, "-n", namespace)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"Incident:    {namespace}/{name}" in out
    assert "Window:      steps (10, 15]" in out and "Phase:       Contained" in out
    assert (
        f"rank 3 (local rank 1, GPU GPU-5d6e0c1a-0000-0000-0000-000000000001) pod {job.pods[1]}"
        in out
    )
    timeline = out.split("Timeline (UTC):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    kinds = [line.split()[1] for line in timeline]
    assert kinds == [
        "recorded",
        "report",  # at 1 s
        "report",  # 2 s
        "condition",  # Detected, 2 s
        "event",  # Detected, 2 s
        "action",  # suspend, 3 s
        "action",  # quarantine, 3 s
        "condition",  # Contained, 3 s
        "event",  # SDCJobSuspended, 3 s
        "event",  # SDCNodeQuarantined, 4 s
    ], timeline
    text = "\n".join(timeline)
    assert f"report from node {job.node_name(0)}" in text
    assert "Detected=True (ReplayCheck)" in text
    assert f"quarantine-node {job.node_name(1)}: Succeeded" in text
    assert f"SDCJobSuspended on PyTorchJob {job.name}" in text
    assert f"SDCNodeQuarantined on Node {job.node_name(1)}" in text
    assert "not a suspect node" not in out, "only the suspect nodes' Events"
    assert '"mismatches": []' in out  # the evidence
    assert f"kubectl sdc approve {name} -n {namespace} --action replace" in out
    assert f"kubectl sdc release {name} -n {namespace}" in out
    assert "Confirmation:\n  (none)" in out

    as_json = sdc(cluster, "describe", f"{namespace}/{name}", "-o", "json")
    assert as_json.returncode == 0, as_json.stderr
    parsed = json.loads(as_json.stdout)
    assert parsed["incident"]["metadata"]["name"] == name
    assert [e["kind"] for e in parsed["timeline"]] == kinds


def test_approve_records_the_decision_once_and_refuses_to_change_a_pending_one(
    cluster: Cluster, namespace: str
) -> None:
    job = make_job(cluster, namespace)
    incident = record(cluster, job, phase="Resumed")
    name = incident["metadata"]["name"]
    done = sdc(cluster, "approve", name, "-n", namespace)
    assert done.returncode == 0, done.stderr
    assert f"recorded {ACTION_ANNOTATION}=replace" in done.stdout
    assert f"replace node {job.node_name(1)}" in done.stdout
    assert annotation_of(cluster, incident) == "replace"
    again = sdc(cluster, "approve", name, "-n", namespace, "--action", "replace")
    assert again.returncode == 0 and "already recorded" in again.stdout
    reboot = sdc(cluster, "approve", name, "-n", namespace, "--action", "reboot")
    assert reboot.returncode == 1
    assert "another decision is pending" in reboot.stderr and "--overwrite" in reboot.stderr
    assert annotation_of(cluster, incident) == "replace"
    forced = sdc(cluster, "approve", name, "-n", namespace, "--action", "reboot", "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert annotation_of(cluster, incident) == "reboot"
    reasons = [
        e["reason"] for e in cluster.events(namespace) if e["involved_object"]["name"] == name
    ]
    assert reasons.count("SDCReviewDecision") == 2


def tenant_kubeconfig(cluster: Cluster, namespace: str, path: Path) -> str:
    """A namespace admin of ``namespace`` for incidents (the ServiceAccount ``worker`` with
    get, list and patch on sdcincidents and create on Events there), nothing cluster-wide."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rules = [
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list"]},
    ]
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "sdc"}, "rules": rules})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "sdc"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sdc"},
            "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": namespace}],
        },
    )
    return cluster.kubeconfig_for(namespace, "worker", path)


def test_under_cluster_approvals_approve_records_on_the_policy(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """``approvals: cluster``: the operator reads a decision only from the admitting
    policy's ``approve.hyperpod-sdc.dev/<uid>`` (the incident's annotation is ignored).
    ``kubectl sdc approve`` by a cluster admin writes it there (it wrote the ignored
    annotation before, and said the operator would act); ``--overwrite`` and the pending
    check read the policy's decision."""
    cluster.admit(namespace, approvals="cluster")
    job = make_job(cluster, namespace)
    incident = record(cluster, job, phase="Contained")
    name, uid = incident["metadata"]["name"], incident["metadata"]["uid"]
    policy = f"admit-{namespace}"

    def approved() -> str | None:
        got = cluster.custom.get_cluster_custom_object(GROUP, VERSION, "sdcpolicies", policy)
        return (got["metadata"].get("annotations") or {}).get(f"approve.hyperpod-sdc.dev/{uid}")

    # A tenant may not read the policies: it cannot tell, writes the incident's annotation
    # (what counts under approvals: namespace) and is told that here it does not count.
    tenant = tenant_kubeconfig(cluster, namespace, tmp_path / "tenant")
    told = sdc(cluster, "approve", name, "-n", namespace, "--kubeconfig", tenant)
    assert told.returncode == 0, told.stderr
    assert "the SDCPolicies could not be read" in told.stderr, told.stderr
    assert "a cluster admin decides" in told.stderr
    assert annotation_of(cluster, incident) == "replace" and approved() is None
    # The cluster admin: on the policy, where the operator reads it.
    done = sdc(cluster, "approve", name, "-n", namespace, "--action", "reboot")
    assert done.returncode == 0, done.stderr
    assert f"recorded approve.hyperpod-sdc.dev/{uid}=reboot on SDCPolicy {policy}" in done.stdout
    assert approved() == "reboot" and annotation_of(cluster, incident) == "replace"
    again = sdc(cluster, "approve", name, "-n", namespace, "--action", "reboot")
    assert again.returncode == 0 and "already recorded" in again.stdout
    replace = sdc(cluster, "approve", name, "-n", namespace)
    assert replace.returncode == 1 and "another decision is pending" in replace.stderr
    assert f"approve.hyperpod-sdc.dev/{uid}=reboot" in replace.stderr
    forced = sdc(cluster, "release", name, "-n", namespace, "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert approved() == "release"


@pytest.mark.parametrize(
    ("phase", "quarantined", "remediated", "decision", "words"),
    [
        ("WaitingForAgreement", False, None, "replace", "waiting for agreement"),
        ("Detected", False, None, "replace", "still in progress"),
        ("Transient", False, None, "replace", "held (Transient"),
        ("AwaitingEvidence", False, None, "release", "held (AwaitingEvidence"),
        ("NotHardware", False, None, "release", "does not accuse hardware"),
        ("DryRun", False, None, "replace", "dry-run"),
        ("Released", True, None, "replace", "already released"),
        ("Contained", False, None, "replace", "no node was quarantined (Contained: Storm"),
        ("Remediated", True, "ReplaceRequested", "release", "replacement was already requested"),
        ("Remediated", True, "RebootRequested", "reboot", "a reboot was already requested"),
    ],
)
def test_decisions_that_make_no_sense_are_refused_and_change_nothing(
    cluster: Cluster,
    namespace: str,
    phase: str,
    quarantined: bool,
    remediated: str | None,
    decision: str,
    words: str,
) -> None:
    job = make_job(cluster, namespace)
    extra_actions: tuple[dict[str, Any], ...] = ()
    extra_conditions: tuple[dict[str, Any], ...] = ()
    if remediated is not None:
        kind = "replace" if remediated == "ReplaceRequested" else "reboot"
        extra_actions = (action(f"{kind}-node", job.node_name(1), "Succeeded", "accepted", at(5)),)
        extra_conditions = (condition("Remediated", "True", remediated, "accepted", at(5)),)
        annotation: str | None = kind
    else:
        annotation = None
    incident = record(
        cluster,
        job,
        phase=phase,
        quarantined=quarantined,
        extra_actions=extra_actions,
        extra_conditions=extra_conditions,
        annotation=annotation,
    )
    before = incident["metadata"]["resourceVersion"]
    args = ("approve", "--action", decision) if decision != "release" else ("release",)
    done = sdc(cluster, args[0], incident["metadata"]["name"], "-n", namespace, *args[1:])
    assert done.returncode == 1, done.stdout
    assert "refused" in done.stderr and words in done.stderr, done.stderr
    meta = incident["metadata"]
    now = cluster.custom.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, meta["name"]
    )
    assert now["metadata"]["resourceVersion"] == before


def test_release_after_a_reboot(cluster: Cluster, namespace: str) -> None:
    job = make_job(cluster, namespace)
    incident = record(
        cluster,
        job,
        phase="Remediated",
        extra_actions=(action("reboot-node", job.node_name(1), "Succeeded", "accepted", at(5)),),
        extra_conditions=(condition("Remediated", "True", "RebootRequested", "accepted", at(5)),),
        annotation="reboot",
    )
    done = sdc(cluster, "release", incident["metadata"]["name"], "-n", namespace)
    assert done.returncode == 0, done.stderr
    assert annotation_of(cluster, incident) == "release"


def test_through_kubectl_and_the_contexts_namespace(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    job = make_job(cluster, namespace)
    incident = record(cluster, job, phase="Contained")
    name = incident["metadata"]["name"]
    done = sdc(cluster, "describe", name, "-n", namespace, plugin=True)
    assert done.returncode == 0, done.stderr
    assert f"Incident:    {namespace}/{name}" in done.stdout
    missing = sdc(cluster, "describe", name)  # the context's namespace: default
    assert missing.returncode == 1
    assert f"incident default/{name} not found" in missing.stderr
    # A kubeconfig whose context names the namespace, given with --kubeconfig.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        Path(cluster.kubeconfig)
        .read_text()
        .replace(
            "context: {cluster: local, user: admin}",
            f"context: {{cluster: local, user: admin, namespace: {namespace}}}",
        )
    )
    assert f"namespace: {namespace}" in kubeconfig.read_text()
    found = sdc(cluster, "describe", name, "--kubeconfig", str(kubeconfig))
    assert found.returncode == 0, found.stderr


def test_bad_usage(cluster: Cluster) -> None:
    done = sdc(cluster, "approve", "x", "--action", "explode", process=True)
    assert done.returncode == 2 and "invalid choice" in done.stderr
    assert sdc(cluster, "approve", "x", "--action", "explode").returncode == 2


def test_approve_leads_the_operator_to_replace_the_node(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    op = start_operator(extra_env=sagemaker.env())
    contain(cluster, op, job)
    incident = incident_in(cluster, namespace, "Contained")
    name = incident["metadata"]["name"]
    op.resynced()  # a whole resync: the manual policy waits for a person
    assert sagemaker.calls == []
    described = sdc(cluster, "describe", name, "-n", namespace)
    assert "SDCNodeQuarantined on Node" in described.stdout, described.stdout
    done = sdc(cluster, "approve", name, "-n", namespace, "--action", "replace")
    assert done.returncode == 0, done.stderr

    def remediated() -> dict[str, Any] | None:
        found = [
            i for i in cluster.incidents(namespace) if i["status"].get("phase") == "Remediated"
        ]
        return found[0] if found else None

    wait_for("phase Remediated", remediated)
    op.resynced()  # nothing is called again
    assert sagemaker.calls == [
        ("BatchReplaceClusterNodes", {"ClusterName": "ml-cluster", "NodeIds": [job.instance(1)]})
    ]
    after = sdc(cluster, "describe", name, "-n", namespace)
    assert "replace-node" in after.stdout and "SDCReviewDecision" in after.stdout
    refused = sdc(cluster, "release", name, "-n", namespace)
    assert refused.returncode == 1 and "replacement was already requested" in refused.stderr
