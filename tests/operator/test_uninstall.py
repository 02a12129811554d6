"""The uninstall clean-up's pure half: which nodes and jobs are left, why, and the commands."""

from __future__ import annotations

from typing import Any

from sdc_operator.names import INCIDENT_ANNOTATION, PRIOR_CORDON_ANNOTATION, SUSPECT_KEY
from sdc_operator.nodes import quarantine_patch
from sdc_operator.uninstall import plan, release_commands, render_plan


def node(name: str, *, cordoned: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {}, "annotations": {}, **extra},
        "spec": {"unschedulable": cordoned, "taints": [{"key": "other", "effect": "NoExecute"}]},
    }


def quarantined(base: dict[str, Any], incident: str) -> dict[str, Any]:
    patch = quarantine_patch(base, incident)
    assert patch is not None
    out = {**base, "spec": {**base["spec"], **patch["spec"]}}
    meta = base["metadata"]
    out["metadata"] = {
        **meta,
        "labels": {**meta["labels"], **patch["metadata"]["labels"]},
        "annotations": {**meta["annotations"], **patch["metadata"]["annotations"]},
    }
    return out


def incident(name: str, phase: str, job: str = "train") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": name},
        "spec": {
            "job": {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job},
            "lastCleanStep": 10,
        },
        "status": {"phase": phase},
    }


def test_the_commands_undo_only_what_we_did() -> None:
    ours = quarantined(node("n1"), "team-a/i1")
    assert release_commands(ours) == (
        f"kubectl taint node n1 {SUSPECT_KEY}-",
        f"kubectl label node n1 {SUSPECT_KEY}-",
        f"kubectl annotate node n1 {INCIDENT_ANNOTATION}-",
        "kubectl uncordon n1",
    )
    before = quarantined(node("n2", cordoned=True), "team-a/i1")  # cordoned before us
    assert before["metadata"]["annotations"][PRIOR_CORDON_ANNOTATION] == "true"
    assert release_commands(before)[-1] == (
        f"kubectl annotate node n2 {INCIDENT_ANNOTATION}- {PRIOR_CORDON_ANNOTATION}-"
    )


def test_the_plan_lists_our_nodes_and_the_jobs_open_incidents_hold() -> None:
    nodes = [
        quarantined(node("n1"), "team-a/i1"),
        node("n2", cordoned=True),  # someone else's cordon: not ours, not listed
        quarantined(node("n3"), "team-a/gone"),
    ]
    incidents = [incident("i1", "Contained"), incident("i2", "Released", job="other")]
    jobs = {
        ("team-a", "PyTorchJob", "train"): {"spec": {"runPolicy": {"suspend": True}}},
        ("team-a", "PyTorchJob", "other"): {"spec": {"runPolicy": {"suspend": True}}},
    }
    p = plan(nodes, incidents, jobs, [("team-a", "hyperpod-sdc-ca")], [])
    assert [(n.name, n.incident) for n in p.nodes] == [("n1", "team-a/i1"), ("n3", "team-a/gone")]
    assert "phase Contained" in p.nodes[0].why and "no longer exists" in p.nodes[1].why
    # the released incident no longer holds its job: only i1's is listed
    assert [(j.name, j.incident) for j in p.jobs] == [("train", "team-a/i1")]
    assert p.jobs[0].resume == (
        "kubectl patch pytorchjobs.kubeflow.org train -n team-a --type merge -p "
        """'{"spec":{"runPolicy":{"suspend":false}}}'""",
    )
    assert p.incidents == 2
    text = render_plan(p, released=False, dry_run=False)
    assert "LEFT QUARANTINED" in text and "kubectl uncordon n1" in text
    assert "jobs LEFT SUSPENDED" in text and "kept 2 SDCIncident(s)" in text
    assert "nodes to release:" in render_plan(p, released=True, dry_run=True)
