"""Uninstall against the real API server (docs/operator.md, "Uninstall"): with a quarantined
node and a suspended job, ``kubectl sdc uninstall`` (the chart's pre-delete hook) leaves
exactly what the docs say: the node quarantined and listed with the commands that release
it (which do), the job suspended and listed, every incident kept, and none of the
operator's ConfigMaps or confirmation pods; with ``--stop``, as the chart's hook runs it
with its own roles, nothing is cleaned up before the operator's pods are gone."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sdc_harness.cluster import KUBECTL, Cluster, OperatorProcess
from sdc_operator.names import SUSPECT_KEY
from sdc_operator.nodes import release_patch
from sdc_operator.uninstall import CONFIRMATION_SELECTOR, MANAGED_SELECTOR
from tests.chart.test_chart import hook, render

from .test_cli import CLI, sdc
from .test_containment import Job, incident_in, make_job
from .test_install import install
from .test_remediation import contain


def quarantined(cluster: Cluster, name: str) -> bool:
    return release_patch(cluster.get_node(name)) is not None


def ours(cluster: Cluster, namespace: str) -> dict[str, list[str]]:
    """What of the operator's is left in ``namespace``."""
    found = {}
    for kind, selector in (("configmaps", MANAGED_SELECTOR), ("pods", CONFIRMATION_SELECTOR)):
        out = cluster.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json")
        # a deleted pod bound to a node stays, terminating, until its kubelet (none here)
        # confirms: deleted is deletionTimestamp set
        found[kind] = [
            f"{kind[:-1]}/{i['metadata']['name']}"
            for i in json.loads(out)["items"]
            if not i["metadata"].get("deletionTimestamp")
        ]
    return found


def contained_job(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> tuple[Job, dict[str, Any]]:
    job = make_job(cluster, namespace)
    op = start_operator()
    contain(cluster, op, job)
    incident = incident_in(cluster, namespace, "Contained")
    op.stop()  # what the hook's --stop does to the Deployment (no controller here)
    assert quarantined(cluster, job.node_name(1))
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    # the operator's objects in the tenant namespace: its CA ConfigMap, a confirmation pod
    cluster.kubectl(
        "create", "configmap", "hyperpod-sdc-ca", "-n", namespace, "--from-literal=ca.crt=x"
    )
    cluster.kubectl("label", "configmap", "hyperpod-sdc-ca", "-n", namespace, MANAGED_SELECTOR)
    cluster.pod(namespace, "sdc-confirm-x", job.node_name(1), None)
    cluster.kubectl("label", "pod", "sdc-confirm-x", "-n", namespace, CONFIRMATION_SELECTOR)
    return job, incident


def test_uninstall_leaves_the_quarantine_listed_resumes_nothing_and_keeps_incidents(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job, incident = contained_job(cluster, namespace, start_operator)
    suspect, name = job.node_name(1), incident["metadata"]["name"]

    dry = sdc(cluster, "uninstall", "--dry-run", "-o", "json")
    assert dry.returncode == 0, dry.stderr
    assert ours(cluster, namespace) == {
        "configmaps": ["configmap/hyperpod-sdc-ca"],
        "pods": ["pod/sdc-confirm-x"],
    }

    done = sdc(cluster, "uninstall", "-o", "json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan == json.loads(dry.stdout)  # the dry run said exactly this
    (node,) = [n for n in plan["nodes"] if n["name"] in {job.node_name(i) for i in range(3)}]
    assert (node["name"], node["incident"], node["released"]) == (
        suspect,
        f"{namespace}/{name}",
        False,
    )
    assert "suspected of silent data corruption" in node["why"]
    (left_job,) = [j for j in plan["jobs"] if j["namespace"] == namespace]
    assert (left_job["name"], left_job["incident"]) == (job.name, f"{namespace}/{name}")
    assert "at or before step 10" in left_job["why"]
    assert f"{namespace}/hyperpod-sdc-ca" in plan["deleted"]["configmaps"]

    # what is left is what the docs say, and nothing else
    assert quarantined(cluster, suspect)
    assert not any(quarantined(cluster, job.node_name(i)) for i in (0, 2))
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert [i["metadata"]["name"] for i in cluster.incidents(namespace)] == [name]
    assert ours(cluster, namespace) == {"configmaps": [], "pods": []}

    # the listed commands release the node, as the operator's release would
    for command in node["release"]:
        argv = shlex.split(command)
        assert argv[0] == "kubectl"
        subprocess.run(
            [KUBECTL, "--kubeconfig", cluster.kubeconfig, *argv[1:]], check=True, timeout=30
        )
    after = cluster.get_node(suspect)
    assert release_patch(after) is None and not after["spec"].get("unschedulable")
    # ... and the job's, resumes it
    (command,) = left_job["resume"]
    subprocess.run(
        [KUBECTL, "--kubeconfig", cluster.kubeconfig, *shlex.split(command)[1:]],
        check=True,
        timeout=30,
    )
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is False


def test_uninstall_release_nodes_releases_ours_only_and_still_resumes_nothing(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job, _ = contained_job(cluster, namespace, start_operator)
    suspect = job.node_name(1)
    cluster.kubectl("taint", "node", suspect, "example.com/other=x:NoSchedule")
    done = sdc(cluster, "uninstall", "--release-nodes")
    assert done.returncode == 0, done.stderr
    assert "nodes released:" in done.stdout and suspect in done.stdout
    after = cluster.get_node(suspect)
    assert release_patch(after) is None and not after["spec"].get("unschedulable")
    keys = [t["key"] for t in after["spec"]["taints"]]
    assert "example.com/other" in keys and SUSPECT_KEY not in keys  # only ours went
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert len(cluster.incidents(namespace)) == 1


@dataclass(frozen=True)
class Hook:
    namespace: str
    release: str
    kubeconfig: str
    """Acting as the hook's ServiceAccount, with only the roles the chart gives it."""
    pods: tuple[str, ...]
    """The operator's pods."""

    def run(self, *args: str) -> subprocess.Popen[str]:
        """``kubectl-sdc uninstall --stop <namespace>/<release> ARGS``, as the hook's Job."""
        env = {**os.environ, "KUBECONFIG": self.kubeconfig}
        target = f"{self.namespace}/{self.release}"
        return subprocess.Popen(
            [str(CLI), "uninstall", "--stop", target, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    def replicas(self, cluster: Cluster) -> int:
        apps = client.AppsV1Api(cluster.api)
        scale = apps.read_namespaced_deployment_scale(self.release, self.namespace)
        return int(scale.spec.replicas or 0)  # 0 is left out of the answer


def hook_installed(cluster: Cluster, tmp_path: Path, values: dict[str, Any]) -> Hook:
    """The chart installed with ``values`` (test_install.install), its uninstall hook's
    ServiceAccount and roles created as rendered, the hook's own pod as the Job controller
    would make it, and the operator's two pods as its ReplicaSet would have made them: no
    controller runs here, so nothing creates or deletes them but the test."""
    namespace, release = install(cluster, values, tmp_path)
    hooks = [
        d
        for d in render({**values, "fullnameOverride": release}, namespace=namespace, hooks=True)
        if hook(d) == "pre-delete"
    ]
    manifest = tmp_path / f"{release}-hook.yaml"
    manifest.write_text(yaml.safe_dump_all([d for d in hooks if d["kind"] != "Job"]))
    cluster.kubectl("create", "-f", str(manifest))
    # The hook's own pod, as the Job controller would make it: the chart's labels, the
    # Deployment's selector labels among them. --stop must not wait for it to go.
    (job,) = [d for d in hooks if d["kind"] == "Job"]
    template = job["spec"]["template"]
    hook_pod = {
        "metadata": {
            "name": f"{release}-uninstall-x",
            "labels": {**template["metadata"]["labels"], "job-name": job["metadata"]["name"]},
        },
        "spec": {
            "serviceAccountName": template["spec"]["serviceAccountName"],
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "containers": [{"name": "uninstall", "image": "example.com/operator:1"}],
        },
    }
    cluster.core.create_namespaced_pod(namespace, hook_pod)
    deployment = client.AppsV1Api(cluster.api).read_namespaced_deployment(release, namespace)
    labels = {**deployment.spec.selector.match_labels, "pod-template-hash": "5d8f7c9b6"}
    pods = []
    for i in range(2):
        body = {
            "metadata": {"name": f"{release}-{i}", "labels": labels},
            "spec": {
                "serviceAccountName": release,
                "automountServiceAccountToken": False,
                "containers": [{"name": "operator", "image": "example.com/operator:1"}],
            },
        }
        pods.append(cluster.core.create_namespaced_pod(namespace, body).metadata.name)
    kubeconfig = cluster.kubeconfig_for(
        namespace, f"{release}-uninstall", tmp_path / f"{release}-hook.kubeconfig"
    )
    return Hook(namespace, release, kubeconfig, tuple(pods))


@pytest.mark.slow  # the chart installed, an operator, three CLI runs: 15 to 50 s loaded
def test_the_hook_stops_the_operator_and_cleans_up_only_once_its_pods_are_gone(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], tmp_path: Path
) -> None:
    """``--stop`` as the chart's pre-delete hook runs it, as the hook's own ServiceAccount
    with the roles the chart gives it (uninstall.releaseNodes on, so that it may release
    nodes): the dry run stops nothing; the stop scales the operator's Deployment to zero
    (its scale subresource) and, while the operator's pods are there, does nothing more:
    past --stop-timeout it fails, the node still quarantined, our ConfigMap and
    confirmation pod still there. Once the pods are gone (here deleted by the test: the
    ReplicaSet controller and the kubelet that would do it do not run) the clean-up runs."""
    job, _ = contained_job(cluster, namespace, start_operator)
    suspect = job.node_name(1)
    hook_ = hook_installed(cluster, tmp_path, {"uninstall": {"releaseNodes": True}})
    assert hook_.replicas(cluster) == 2

    dry = hook_.run("--dry-run", "--release-nodes")
    out, err = dry.communicate(timeout=60)
    assert dry.returncode == 0, err
    assert "nodes to release:" in out and suspect in out
    assert hook_.replicas(cluster) == 2  # the dry run stops nothing

    early = hook_.run("--release-nodes", "--stop-timeout", "2")
    out, err = early.communicate(timeout=60)
    assert early.returncode == 1, (out, err)
    assert f"the operator {hook_.namespace}/{hook_.release} did not stop within 2 s" in err
    assert "nothing was cleaned up" in err and out == ""
    assert hook_.replicas(cluster) == 0  # the one write it made
    assert quarantined(cluster, suspect)  # not released: the operator might still act
    assert ours(cluster, namespace) == {
        "configmaps": ["configmap/hyperpod-sdc-ca"],
        "pods": ["pod/sdc-confirm-x"],
    }

    done = hook_.run("-o", "json")
    for pod in hook_.pods:  # what the ReplicaSet controller and the kubelet would do
        cluster.core.delete_namespaced_pod(pod, hook_.namespace)
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    plan = json.loads(out)
    (node,) = [n for n in plan["nodes"] if n["name"] == suspect]
    assert node["released"] is False  # the default: left quarantined, listed
    assert quarantined(cluster, suspect)
    assert ours(cluster, namespace) == {"configmaps": [], "pods": []}
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert len(cluster.incidents(namespace)) == 1
