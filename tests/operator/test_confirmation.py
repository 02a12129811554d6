"""The confirmation run's pure half: the pod, what its state means, and what follows."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from sdc_operator import confirmation, incidents
from sdc_operator.actions import Actions
from sdc_operator.caches import project_pod
from sdc_operator.errors import ApiError, ConfigError
from sdc_operator.incidents import Action, Rules
from sdc_operator.jobs import job_owner
from sdc_operator.names import SUSPECT_KEY
from sdc_operator.policy import POLICY_CAUTION, namespace_admission
from sdc_operator.settings import OperatorSettings

BUNDLE = "/fsx/ckpt/sdc-evidence/run-7-1200-r3"
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)
AT = "2026-12-01T12:00:00Z"


def job() -> dict[str, Any]:
    container = {
        "name": "pytorch",
        "image": "example.com/train:7",
        "imagePullPolicy": "IfNotPresent",
        "env": [{"name": "HYPERPOD_SDC_BUNDLE_FACTORY", "value": "train:build"}],
        "envFrom": [{"configMapRef": {"name": "settings"}}],
        "resources": {"limits": {"nvidia.com/gpu": 8}},
        "volumeMounts": [{"name": "fsx", "mountPath": "/fsx"}],
    }
    sidecar = {"name": "logger", "image": "example.com/log:1", "volumeMounts": []}
    template = {
        "metadata": {"labels": {"hyperpod-sdc.dev/inject": "true"}},
        "spec": {
            "serviceAccountName": "trainer",
            "imagePullSecrets": [{"name": "registry"}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "containers": [sidecar, container],
            "volumes": [
                {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx"}},
                {"name": "logs", "emptyDir": {}},
            ],
        },
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "job-uid"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {"template": template},
                "Worker": {"template": template},
            }
        },
    }


def incident(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "llama-1200-3f9a0b1c", "uid": "inc-uid"},
        "spec": {
            "job": {
                "apiVersion": "kubeflow.org/v1",
                "kind": "PyTorchJob",
                "name": "llama",
                "uid": "job-uid",
            },
            "check": "replay",
            "detectionStep": 1200,
            "lastCleanStep": 1150,
            **spec,
        },
        "status": status if status is not None else quarantined(),
    }


def quarantined(node: str = "node-b", phase: str = "Resumed") -> dict[str, Any]:
    return {
        "phase": phase,
        "node": node,
        "suspects": [{"rank": 3, "localRank": 1, "pod": "llama-worker-0", "node": node}],
        "actions": [
            {
                "action": "suspend-job",
                "target": "PyTorchJob ml/llama",
                "result": "Succeeded",
                "at": AT,
            },
            {"action": "quarantine-node", "target": node, "result": "Succeeded", "at": AT},
            {
                "action": "resume-job",
                "target": "PyTorchJob ml/llama",
                "result": "Succeeded",
                "at": AT,
            },
        ],
        "conditions": [
            {"type": "Contained", "status": "True", "reason": "NodeQuarantined", "message": ""}
        ],
    }


# -- the pod ----------------------------------------------------------------------------------


def test_the_pod_is_pinned_tolerant_owned_and_runs_the_confirmation() -> None:
    body, why = confirmation.pod_body(
        incident(bundle=BUNDLE), job(), "node-b", BUNDLE, repeat=5, deadline_seconds=1800
    )
    assert body is not None, why
    meta, spec = body["metadata"], body["spec"]
    assert meta["name"] == confirmation.pod_name(incident(), "node-b") and len(meta["name"]) <= 63
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "hyperpod-sdc.dev/v1alpha1",
            "kind": "SDCIncident",
            "name": "llama-1200-3f9a0b1c",
            "uid": "inc-uid",
            "controller": True,
        }
    ]
    # not a training pod: owned by no job, and none of the labels the webhook selects by
    assert job_owner(body) is None
    assert set(meta["labels"]) == {
        "hyperpod-sdc.dev/confirmation",
        "hyperpod-sdc.dev/incident",
        "hyperpod-sdc.dev/job",
    }
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}
        ]
    }
    keys = {t["key"] for t in spec["tolerations"]}
    assert {SUSPECT_KEY, "node.kubernetes.io/unschedulable", "nvidia.com/gpu"} == keys
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 1800
    assert spec["serviceAccountName"] == "trainer"
    assert spec["automountServiceAccountToken"] is False  # it has nothing to ask the API
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert [v["name"] for v in spec["volumes"]] == ["fsx"]  # only what the container mounts
    (container,) = spec["containers"]
    assert container["image"] == "example.com/train:7"
    assert container["command"] == ["python", "-m", "sdc_agent.confirm"]
    assert container["args"][0] == BUNDLE
    assert container["args"][1:3] == ["--repeat", "5"]
    assert container["args"][-2:] == ["--termination-log", "/dev/termination-log"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert container["envFrom"] == [{"configMapRef": {"name": "settings"}}]
    env = {e["name"]: e for e in container["env"]}
    assert env["HYPERPOD_SDC_BUNDLE_FACTORY"]["value"] == "train:build"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert container["volumeMounts"] == [{"name": "fsx", "mountPath": "/fsx"}]
    # deterministic: the same incident and node give the same pod, another node another
    again, _ = confirmation.pod_body(
        incident(bundle=BUNDLE), job(), "node-b", BUNDLE, repeat=5, deadline_seconds=1800
    )
    assert again == body
    assert confirmation.pod_name(incident(), "node-c") != meta["name"]


def test_an_image_override_replaces_the_jobs_image() -> None:
    body, _ = confirmation.pod_body(
        incident(), job(), "node-b", BUNDLE, repeat=3, deadline_seconds=60, image="ex.com/c:1"
    )
    assert body is not None
    (container,) = body["spec"]["containers"]
    assert container["image"] == "ex.com/c:1" and "imagePullPolicy" not in container


@pytest.mark.parametrize(
    ("bundle", "problem"),
    [
        ("relative/sdc-evidence/x", "not absolute"),
        ("/tmp/sdc-evidence/x", "on none of the training container's volumes"),
        ("/fsx/../etc/sdc-evidence", "on none of the training container's volumes"),
        ("/fsx/x\nmore", "not a plain path"),
        ("/fsxother/x", "on none of the training container's volumes"),
    ],
)
def test_a_bundle_the_pod_cannot_read_is_refused(bundle: str, problem: str) -> None:
    body, why = confirmation.pod_body(
        incident(), job(), "node-b", bundle, repeat=3, deadline_seconds=60
    )
    assert body is None and problem in why


def test_the_master_template_for_a_master_suspect() -> None:
    spec = job()
    spec["spec"]["pytorchReplicaSpecs"]["Master"] = copy.deepcopy(
        spec["spec"]["pytorchReplicaSpecs"]["Master"]
    )
    spec["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][1]["image"] = (
        "m"
    )
    master = confirmation.training_template(spec, "llama-master-0")
    assert master is not None and master["spec"]["containers"][1]["image"] == "m"
    worker = confirmation.training_template(spec, "llama-worker-3")
    assert worker is not None and worker["spec"]["containers"][1]["image"] == "example.com/train:7"


# -- reading the pod --------------------------------------------------------------------------

RUNNING = confirmation.running_record("sdc-confirm-x", "node-b", BUNDLE, AT)


def pod(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "sdc-confirm-x"}, "spec": {"nodeName": "node-b"}, "status": status}


def terminated(code: int, message: str, **more: Any) -> dict[str, Any]:
    state = {"terminated": {"exitCode": code, "message": message, "finishedAt": AT, **more}}
    return pod(
        phase="Failed" if code else "Succeeded",
        containerStatuses=[{"name": "confirm", "state": state}],
    )


def summary(outcome: str, *gpus: tuple[int, str]) -> str:
    return json.dumps(
        {
            "outcome": outcome,
            "reason": "GPU 1: loss bits differ",
            "dcgmi": "skipped",
            "seconds": 4.5,
            "gpus": [
                {"index": i, "local_rank": i, "uuid": f"GPU-{i}", "result": r, "seconds": 1.5}
                for i, r in gpus
            ],
        }
    )


def judge(
    p: dict[str, Any] | None, now: datetime = NOW
) -> tuple[str, str, str, dict[str, Any]] | None:
    return confirmation.judge(RUNNING, p, now, start_seconds=600, deadline_seconds=3600)


def test_the_exit_code_and_the_summary_give_the_outcome() -> None:
    found = judge(terminated(3, summary("confirmed", (0, "does-not-reproduce"), (1, "reproduces"))))
    assert found is not None
    outcome, reason, message, record = found
    assert (outcome, reason) == ("confirmed", "Reproduced")
    assert "GPU 1 (local rank 1, GPU-1) of node node-b" in message
    assert record["gpus"][1] == {
        "result": "reproduces",
        "index": 1,
        "localRank": 1,
        "uuid": "GPU-1",
        "seconds": 1.5,
    }
    assert record["exitCode"] == 3 and record["pod"] == "sdc-confirm-x"
    found = judge(terminated(0, summary("not-confirmed", (0, "does-not-reproduce"))))
    assert found is not None and found[:2] == ("not-confirmed", "NotReproduced")
    found = judge(terminated(4, summary("unknown", (0, "could-not-run"))))
    assert found is not None and found[:2] == ("unknown", "Inconclusive")


def test_a_gpu_that_could_not_run_keeps_its_reason() -> None:
    said = json.loads(summary("unknown", (0, "does-not-reproduce"), (1, "could-not-run")))
    said["gpus"][1]["why"] = "recomputing failed: RuntimeError: CUDA error: ECC"
    found = judge(terminated(4, json.dumps(said)))
    assert found is not None
    gpus = found[3]["gpus"]
    assert gpus[1]["why"] == "recomputing failed: RuntimeError: CUDA error: ECC"
    assert "why" not in gpus[0]


def test_a_crash_or_a_lying_message_is_unknown() -> None:
    found = judge(terminated(1, "Traceback (most recent call last): ImportError: no torch"))
    assert (
        found is not None and found[:2] == ("unknown", "CouldNotRun") and "ImportError" in found[2]
    )
    # exit 0 says not-confirmed; a summary that says otherwise is not believed either way
    found = judge(terminated(0, summary("confirmed", (0, "reproduces"))))
    assert found is not None and found[:2] == ("unknown", "UnreadableResult")
    found = judge(terminated(3, "not json"))
    assert found is not None and found[:2] == ("unknown", "UnreadableResult")


def test_a_pod_that_does_not_start_is_given_up_with_the_reason() -> None:
    pending = pod(
        phase="Pending",
        conditions=[
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes: Insufficient nvidia.com/gpu",
            }
        ],
    )
    assert judge(pending, NOW + timedelta(seconds=599)) is None  # still within its start time
    found = judge(pending, NOW + timedelta(seconds=601))
    assert found is not None and found[:2] == ("unknown", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in found[2]
    pulling = pod(
        phase="Pending",
        containerStatuses=[
            {
                "name": "confirm",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "denied"}},
            }
        ],
    )
    found = judge(pulling, NOW + timedelta(seconds=601))
    assert found is not None and found[:2] == ("unknown", "ImagePullFailed")


def test_a_pod_made_again_under_our_name_is_not_believed() -> None:
    """A tenant deletes the confirmation pod and makes one of the same name that exits 3
    with a summary of its own: the result is read only from the pod the operator made."""
    pinned = confirmation.running_record("sdc-confirm-x", "node-b", BUNDLE, AT, "u-ours")
    forged = terminated(3, summary("confirmed", (1, "reproduces")))
    forged["metadata"]["uid"] = "u-theirs"
    judged = confirmation.judge(pinned, forged, NOW, start_seconds=600, deadline_seconds=3600)
    assert judged is not None and judged[:2] == ("unknown", "PodReplaced")
    forged["metadata"]["uid"] = "u-ours"
    judged = confirmation.judge(pinned, forged, NOW, start_seconds=600, deadline_seconds=3600)
    assert judged is not None and judged[0] == "confirmed"


def test_a_pod_whose_image_was_patched_is_not_believed() -> None:
    """A tenant with patch on pods changes the image of the operator's own pod (to one that
    exits 3 'confirmed'), or adds an ephemeral container, or patches and patches back (the
    container restarted): the result is not the operator's."""
    images = {"confirm": "example.com/train:7"}
    pinned = confirmation.running_record("sdc-confirm-x", "node-b", BUNDLE, AT, "u-ours", images)

    def ran(image: str, **more: Any) -> dict[str, Any]:
        found = terminated(3, summary("confirmed", (1, "reproduces")))
        found["metadata"]["uid"] = "u-ours"
        found["spec"]["containers"] = [{"name": "confirm", "image": image}]
        found["spec"].update(more)
        return found

    def judged(p: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]] | None:
        return confirmation.judge(pinned, p, NOW, start_seconds=600, deadline_seconds=3600)

    clean = judged(ran("example.com/train:7"))  # the clean path: believed
    assert clean is not None and clean[0] == "confirmed" and clean[3]["podUid"] == "u-ours"
    swapped = judged(ran("evil.example.com/always-confirmed:1"))
    assert swapped is not None and swapped[:2] == ("unknown", "PodChanged")
    assert "images were changed" in swapped[2] and "confirm" in swapped[2]
    debug = judged(ran("example.com/train:7", ephemeralContainers=[{"name": "dbg"}]))
    assert debug is not None and debug[:2] == ("unknown", "PodChanged")
    restarted = ran("example.com/train:7")
    restarted["status"]["containerStatuses"][0]["restartCount"] = 1
    found = judged(restarted)
    assert found is not None and found[:2] == ("unknown", "PodChanged")
    # The cache keeps what this is read from, for confirmation pods only.
    full = ran("example.com/train:7", ephemeralContainers=[{"name": "dbg", "image": "x"}])
    full["metadata"]["labels"] = {confirmation.CONFIRMATION_LABEL: "true"}
    full["status"]["containerStatuses"][0]["restartCount"] = 2
    kept = project_pod(full)
    assert kept["spec"]["containers"] == [{"name": "confirm", "image": "example.com/train:7"}]
    assert kept["spec"]["ephemeralContainers"] == [{"name": "dbg", "image": "x"}]
    assert kept["status"]["containerStatuses"][0]["restartCount"] == 2
    del full["metadata"]["labels"]
    assert "containers" not in project_pod(full)["spec"]


def test_not_reproduced_counts_only_where_the_suspects_gpu_ran() -> None:
    """The pod asks for the node's GPUs; the device plugin numbers them from 0 in the pod,
    so the suspect's GPU is matched by its UUID: a run on other GPUs (or one where the
    suspect's could not run) is Unknown, never a false "not confirmed"."""
    suspect = {"localRank": 1, "gpuUUID": "GPU-1", "node": "node-b"}

    def with_gpus(*gpus: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]] | None:
        text = json.dumps(
            {"outcome": "not-confirmed", "reason": "all equal", "dcgmi": "skipped", "gpus": gpus}
        )
        return confirmation.judge(
            RUNNING,
            terminated(0, text),
            NOW,
            start_seconds=600,
            deadline_seconds=3600,
            suspects=[suspect],
        )

    # clean path: the suspect's GPU ran (by UUID, at another index in the pod)
    ran = with_gpus(
        {"index": 0, "local_rank": 0, "uuid": "GPU-7", "result": "does-not-reproduce"},
        {"index": 1, "local_rank": 1, "uuid": "GPU-1", "result": "does-not-reproduce"},
    )
    assert ran is not None and ran[:2] == ("not-confirmed", "NotReproduced")
    # other GPUs than the suspect's, the local rank matching: Unknown
    other = with_gpus(
        {"index": 0, "local_rank": 0, "uuid": "GPU-6", "result": "does-not-reproduce"},
        {"index": 1, "local_rank": 1, "uuid": "GPU-7", "result": "does-not-reproduce"},
    )
    assert other is not None and other[:2] == ("unknown", "SuspectGPUNotRun")
    assert "the suspect's GPU GPU-1 was not among those the confirmation ran on" in other[2]
    could_not = with_gpus(
        {"index": 1, "local_rank": 1, "uuid": "GPU-1", "result": "could-not-run", "why": "Xid 79"}
    )
    assert could_not is not None and could_not[:2] == ("unknown", "SuspectGPUNotRun")
    assert "could not run: Xid 79" in could_not[2]
    assert could_not[3]["gpus"][0]["why"] == "Xid 79"  # the reason is kept
    # no UUIDs reported (CUDA not initialized): by local rank
    by_rank = with_gpus({"index": 1, "local_rank": 1, "result": "does-not-reproduce"})
    assert by_rank is not None and by_rank[0] == "not-confirmed"
    missing = with_gpus({"index": 0, "local_rank": 0, "result": "does-not-reproduce"})
    assert missing is not None and missing[:2] == ("unknown", "SuspectGPUNotRun")


def test_timeouts_and_a_vanished_pod() -> None:
    deadline = pod(
        phase="Failed",
        reason="DeadlineExceeded",
        message="Pod was active on the node longer than the specified deadline",
    )
    found = judge(deadline)
    assert found is not None and found[:2] == ("unknown", "Timeout")
    running = pod(
        phase="Running",
        containerStatuses=[{"name": "confirm", "state": {"running": {"startedAt": AT}}}],
    )
    assert judge(running, NOW + timedelta(seconds=3600)) is None
    found = judge(running, NOW + timedelta(seconds=3600 + 61))
    assert found is not None and found[:2] == ("unknown", "Timeout")
    assert judge(None, NOW + timedelta(seconds=10)) is None  # the cache may not have it yet
    found = judge(None, NOW + timedelta(seconds=31))
    assert found is not None and found[:2] == ("unknown", "PodGone")
    elsewhere = pod(phase="Running")
    elsewhere["spec"]["nodeName"] = "node-z"
    found = judge(elsewhere)
    assert found is not None and found[:2] == ("unknown", "WrongNode")


# -- what follows -----------------------------------------------------------------------------


def finished(status: dict[str, Any], outcome: str, node: str = "node-b") -> dict[str, Any]:
    entry, condition = confirmation.record(outcome, "R", "m", {"node": node, "pod": "p"}, AT)
    status = copy.deepcopy(status)
    status["confirmation"] = entry
    incidents.set_condition(status, *condition, AT)
    return status


CONFIRMED_POLICY = Rules(remediation_policy="auto-replace-confirmed")


def test_confirmation_is_planned_once_quarantined_with_a_bundle() -> None:
    with_bundle = incident(bundle=BUNDLE)
    assert incidents.next_action(with_bundle, Rules()) == Action("confirm-node", "node-b")
    assert incidents.next_action(with_bundle, Rules(confirmation=False)) is None
    no_bundle = incident()
    assert incidents.next_action(no_bundle, Rules()) is None
    assert incidents.needs_bundle_note(no_bundle, Rules())
    # a bundle another report named counts as well
    status = quarantined()
    status["reports"] = [
        {"node": "node-a", "receivedAt": AT},
        {"node": "node-c", "receivedAt": AT, "bundle": BUNDLE},
    ]
    assert incidents.next_action(incident(status), Rules()) == Action("confirm-node", "node-b")
    # not quarantined: nothing to confirm on
    held = quarantined(phase="Contained")
    held["actions"] = held["actions"][:1]
    held["conditions"][0]["reason"] = "JobStoppedNotLocalized"
    assert incidents.next_action(incident(held, bundle=BUNDLE), Rules()) is None
    # while it runs the incident stays open (its deadline is checked at every resync)
    running = incident(bundle=BUNDLE)
    running["status"]["actions"].append(
        {"action": "confirm-node", "target": "node-b", "result": "Succeeded", "at": AT}
    )
    running["status"]["confirmation"] = dict(RUNNING)
    assert incidents.next_action(running, Rules()) is None
    assert incidents.pending_actions(running, Rules())


def test_auto_replace_confirmed_replaces_only_the_confirmed_node() -> None:
    status = quarantined()
    status["actions"].append(
        {"action": "confirm-node", "target": "node-b", "result": "Succeeded", "at": AT}
    )
    yes = incident(finished(status, "confirmed"), bundle=BUNDLE)
    assert incidents.next_action(yes, CONFIRMED_POLICY) == Action("replace-node", "node-b")
    assert incidents.next_action(yes, Rules()) is None  # manual still waits for a person
    for outcome in ("not-confirmed", "unknown"):
        other = incident(finished(status, outcome), bundle=BUNDLE)
        assert incidents.next_action(other, CONFIRMED_POLICY) is None, outcome
        assert not incidents.pending_actions(other, CONFIRMED_POLICY)
    # a person's decision wins over the policy's
    released = incident(finished(status, "confirmed"), bundle=BUNDLE)
    released["metadata"]["annotations"] = {"hyperpod-sdc.dev/action": "release"}
    assert incidents.next_action(released, CONFIRMED_POLICY) == Action("release-node", "node-b")
    # a node confirmed, then replaced: nothing more (the confirmation is not run again)
    replaced = copy.deepcopy(yes)
    replaced["status"]["actions"].append(
        {"action": "replace-node", "target": "node-b", "result": "Succeeded", "at": AT}
    )
    replaced["status"]["phase"] = "Remediated"
    assert incidents.next_action(replaced, CONFIRMED_POLICY) is None


def test_auto_replace_confirmed_is_the_most_cautious_after_manual() -> None:
    assert POLICY_CAUTION == ("manual", "auto-replace-confirmed", "auto-reboot", "auto-replace")
    policies = [
        {
            "metadata": {"name": "a"},
            "spec": {"namespaces": ["ml"], "remediationPolicy": "auto-reboot"},
        },
        {
            "metadata": {"name": "b"},
            "spec": {"namespaces": ["ml"], "remediationPolicy": "auto-replace-confirmed"},
        },
    ]
    assert namespace_admission(policies, "ml", {}).remediation_policy == "auto-replace-confirmed"
    assert (
        OperatorSettings.from_env(
            {"HYPERPOD_SDC_REMEDIATION_POLICY": "auto-replace-confirmed"}
        ).remediation_policy
        == "auto-replace-confirmed"
    )


def test_confirmation_settings_are_checked() -> None:
    s = OperatorSettings.from_env(
        {
            "HYPERPOD_SDC_CONFIRMATION": "false",
            "HYPERPOD_SDC_CONFIRMATION_REPEAT": "5",
            "HYPERPOD_SDC_CONFIRMATION_DEADLINE_SECONDS": "90",
            "HYPERPOD_SDC_CONFIRMATION_IMAGE": "ex.com/c:1",
        }
    )
    assert (s.confirmation, s.confirmation_repeat, s.confirmation_deadline_seconds) == (
        False,
        5,
        90.0,
    )
    assert s.confirmation_image == "ex.com/c:1" and Rules.of(s).confirmation is False
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_CONFIRMATION_REPEAT: must be >= 1"):
        OperatorSettings.from_env({"HYPERPOD_SDC_CONFIRMATION_REPEAT": "0"})
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_CONFIRMATION_START_SECONDS: must be > 0"):
        OperatorSettings.from_env({"HYPERPOD_SDC_CONFIRMATION_START_SECONDS": "0"})


# -- creating the pod (Actions, against a stand-in for the API client) ------------------------


class _Kube:
    """Answers ``create`` with ``error`` (or the body), ``get`` with ``existing``."""

    def __init__(self, error: ApiError | None = None, existing: dict[str, Any] | None = None):
        self.error, self.existing = error, existing
        self.created: list[dict[str, Any]] = []

    async def get_object(self, *_: Any) -> dict[str, Any]:
        return job()

    async def create(
        self, _v: str, _p: str, _ns: str, body: dict[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        if dry_run:  # as the API server would store it: here, as sent, with a name
            meta = {k: v for k, v in body["metadata"].items() if k != "generateName"}
            return {**copy.deepcopy(body), "metadata": {**meta, "name": "generated"}}
        if self.error is not None:
            raise self.error
        self.created.append(body)
        uid = f"pod-uid-{len(self.created)}"
        return {**body, "metadata": {**body["metadata"], "creationTimestamp": AT, "uid": uid}}

    async def get(self, *_: Any) -> dict[str, Any]:
        assert self.existing is not None
        return self.existing


class _Pods:
    def __init__(self, pods: Sequence[dict[str, Any]] = ()) -> None:
        self.pods = list(pods)

    def upsert(self, pod: dict[str, Any]) -> None:
        self.pods.append(pod)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next(
            (
                p
                for p in self.pods
                if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name)
            ),
            None,
        )


class _Incidents:
    def __init__(self, incidents: list[dict[str, Any]]) -> None:
        self.incidents = incidents

    def values(self) -> list[dict[str, Any]]:
        return self.incidents

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next(
            (
                i
                for i in self.incidents
                if (i["metadata"]["namespace"], i["metadata"]["name"]) == (namespace, name)
            ),
            None,
        )


def start(
    kube: _Kube, others: Sequence[dict[str, Any]] = (), pods: Sequence[dict[str, Any]] = ()
) -> Any:
    async def emit(*_: Any) -> None:
        pass

    nodes = type("N", (), {"get": lambda self, namespace, name: None})()
    caches: Any = type(
        "C", (), {"pods": _Pods(pods), "nodes": nodes, "incidents": _Incidents(list(others))}
    )()
    actions = Actions(kube, caches, OperatorSettings(), None, emit)  # type: ignore[arg-type]
    return asyncio.run(
        actions.take(incident(bundle=BUNDLE), Action("confirm-node", "node-b"), Rules())
    )


def test_the_pod_is_created_once_and_a_conflict_finds_it_or_says_whose_it_is() -> None:
    kube = _Kube()
    made = start(kube)
    assert made.result == "Succeeded" and made.condition[:3] == ("Confirmed", "Unknown", "Running")
    assert made.fields["confirmation"]["outcome"] == "running" and len(kube.created) == 1
    body = kube.created[0]
    ours = copy.deepcopy(body)
    ours["metadata"].update(uid="u-1")
    ours["spec"]["nodeName"] = "node-b"  # the scheduler put it there
    found = start(_Kube(ApiError(409, "exists"), ours))
    assert found.result == "Succeeded" and found.message.startswith("found")
    assert found.fields["confirmation"]["podUid"] == "u-1"  # the result is read from it only
    theirs = copy.deepcopy(ours)
    theirs["metadata"]["ownerReferences"] = [{"uid": "someone"}]
    # a tenant's pod of our name, owned by the incident (its uid is no secret), that
    # differs anywhere that matters: not ours either
    container = ours["spec"]["containers"][0]
    changes: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
        (lambda p: p["spec"]["containers"][0].update(image="tenant.example/yes:1"), "containers"),
        (lambda p: p["spec"]["containers"][0]["env"].append({"name": "X", "value": "1"}), ""),
        (lambda p: p["spec"]["containers"][0].update(envFrom=[{"secretRef": {"name": "s"}}]), ""),
        (lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), ""),
        (lambda p: p["spec"].update(securityContext={"runAsUser": 0}), "securityContext"),
        (lambda p: p["spec"].update(serviceAccountName="tenant-admin"), "serviceAccountName"),
        (lambda p: p["spec"].update(initContainers=[container]), "initContainers"),
        (lambda p: p["spec"].update(nodeName="node-c"), "node node-c"),
        (lambda p: p["metadata"]["labels"].update({"training.kubeflow.org/x": "y"}), "labels"),
    ]
    for change, said in [(lambda p: None, "owned"), *changes]:
        pod = copy.deepcopy(theirs if said == "owned" else ours)
        change(pod)
        taken = start(_Kube(ApiError(409, "exists"), pod))
        assert (taken.result, taken.reason) == ("Skipped", "NameTaken"), said
        assert taken.fields["confirmation"]["outcome"] == "unknown"
        assert said in taken.message, taken.message
    refused = start(_Kube(ApiError(403, "forbidden: pods create")))
    assert (refused.result, refused.condition[2]) == ("Skipped", "CouldNotCreate")
    with pytest.raises(ApiError):  # a server error is retried: the action stays Pending
        start(_Kube(ApiError(503, "unavailable")))


def test_the_pod_asks_for_every_gpu_of_the_node_so_it_gets_the_suspects() -> None:
    """The training container asks for 1 GPU of 8: a pod asking for the same could be
    handed any one of them, most likely not the suspect's (a false "not confirmed"). It
    asks for all 8, so the suspect's GPU is among those it runs on (and picks it by UUID)."""
    spec = job()
    container = spec["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][1]
    container["resources"] = {
        "limits": {"nvidia.com/gpu": 1, "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": 1, "cpu": "8"},
    }
    body, why = confirmation.pod_body(
        incident(bundle=BUNDLE),
        spec,
        "node-b",
        BUNDLE,
        repeat=5,
        deadline_seconds=1800,
        node_gpus={"nvidia.com/gpu": "8"},
    )
    assert body is not None, why
    (confirm,) = body["spec"]["containers"]
    assert confirm["resources"] == {
        "limits": {"nvidia.com/gpu": 8, "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": 8, "cpu": "8"},
    }
    # the node's allocatable unknown: the training container's request, as before
    body, _ = confirmation.pod_body(
        incident(bundle=BUNDLE), spec, "node-b", BUNDLE, repeat=5, deadline_seconds=1800
    )
    assert body is not None
    assert body["spec"]["containers"][0]["resources"] == container["resources"]


def test_one_confirmation_pod_per_node_shared_in_a_namespace_else_awaited() -> None:
    """Another incident's confirmation runs on the node (its pod asks for every GPU of it,
    so a second pod would never start): in the same namespace this incident shares that
    pod (the same pod, uid and images recorded, nothing created); in another namespace
    (another tenant's pod, volumes and ServiceAccount) it waits (Unknown: asked again),
    and creates nothing. None running there: its own pod, as before."""
    running = {
        "outcome": "running",
        "pod": "sdc-confirm-other-0123456789",
        "podUid": "pod-uid",
        "node": "node-b",
        "bundle": "/fsx/other/bundle",
        "createdAt": AT,
        "images": {"confirm": "example.com/train:1"},
    }
    other = incident({**quarantined(), "confirmation": running})
    other["metadata"] = {"namespace": "ml", "name": "llama-1100-aaaa", "uid": "other-uid"}
    pod = {"metadata": {"namespace": "ml", "name": running["pod"], "uid": "pod-uid"}}
    kube = _Kube()
    shared = start(kube, [other], [pod])
    assert shared.result == "Succeeded" and "shares the confirmation pod" in shared.message
    record = shared.fields["confirmation"]
    assert {k: record[k] for k in running} == running and record["sharedFrom"] == "llama-1100-aaaa"
    assert kube.created == []
    elsewhere = copy.deepcopy(other)
    elsewhere["metadata"]["namespace"] = "team-b"
    waits = start(
        kube, [elsewhere], [{**pod, "metadata": {**pod["metadata"], "namespace": "team-b"}}]
    )
    assert waits.result == "Unknown" and "one confirmation pod per node" in waits.message
    assert kube.created == []
    # a pod not (yet) in the cache, or another node's confirmation: not shared
    assert start(kube, [other], []).result == "Unknown" and kube.created == []
    other["status"]["confirmation"] = {**running, "node": "node-c"}
    assert start(kube, [other], [pod]).result == "Succeeded" and len(kube.created) == 1


def test_two_incidents_confirming_one_node_at_once_make_one_pod() -> None:
    """Both quarantined the node a moment apart, and neither's running record is in the
    incident cache yet: the second still sees the first's pod (what this replica created
    is remembered until the cache shows it) and shares it."""

    async def emit(*_: Any) -> None:
        pass

    kube = _Kube()
    nodes = type("N", (), {"get": lambda self, namespace, name: None})()
    caches: Any = type("C", (), {"pods": _Pods(), "nodes": nodes, "incidents": _Incidents([])})()
    actions = Actions(kube, caches, OperatorSettings(), None, emit)  # type: ignore[arg-type]
    first, second = incident(bundle=BUNDLE), incident(bundle=BUNDLE)
    second["metadata"] = {**second["metadata"], "name": "llama-1300-3f9a0b1c", "uid": "inc-2"}
    action = Action("confirm-node", "node-b")

    async def both() -> list[Any]:
        return list(
            await asyncio.gather(
                actions.take(first, action, Rules()), actions.take(second, action, Rules())
            )
        )

    made, shared = asyncio.run(both())
    assert len(kube.created) == 1
    assert made.result == shared.result == "Succeeded"
    assert shared.fields["confirmation"]["sharedFrom"] == first["metadata"]["name"]
    assert shared.fields["confirmation"]["podUid"] == made.fields["confirmation"]["podUid"]


def test_a_pod_left_running_after_every_reader_recorded_its_result_is_orphaned() -> None:
    """The operator died between recording the result and deleting the pod it gave up
    on: the pod still runs (it holds the node's GPUs until its deadline). It is deleted
    once no record reads it any more; a pod that ended, one being deleted, one a record
    still reads (running, or shared by a running incident) and one no record names yet
    (its create may be recorded Pending) are left alone."""
    pod: dict[str, Any] = {
        "metadata": {
            "namespace": "ml",
            "name": "sdc-confirm-llama-0123456789",
            "uid": "pod-uid",
            "labels": {confirmation.CONFIRMATION_LABEL: "true"},
        },
        "status": {"phase": "Pending"},
    }
    running = {"outcome": "running", "pod": pod["metadata"]["name"], "podUid": "pod-uid"}
    given_up = {**running, "outcome": "unknown", "reason": "not started 300 s after"}
    owner = incident({**quarantined(), "confirmation": given_up})
    why = confirmation.orphaned(pod, [owner])
    assert why is not None and "llama-1200-3f9a0b1c (unknown)" in why
    for phase in ("Succeeded", "Failed"):
        assert confirmation.orphaned({**pod, "status": {"phase": phase}}, [owner]) is None
    deleting = copy.deepcopy(pod)
    deleting["metadata"]["deletionTimestamp"] = AT
    assert confirmation.orphaned(deleting, [owner]) is None
    assert confirmation.orphaned(pod, []) is None  # no record reads it: not ours to judge
    still = incident({**quarantined(), "confirmation": running})
    assert confirmation.orphaned(pod, [still]) is None
    sharer = incident({**quarantined(), "confirmation": {**running, "sharedFrom": "x"}})
    sharer["metadata"] = {"namespace": "ml", "name": "llama-1300-aaaa", "uid": "inc-2"}
    assert confirmation.orphaned(pod, [owner, sharer]) is None
    sharer["status"]["confirmation"]["outcome"] = "confirmed"
    assert confirmation.orphaned(pod, [owner, sharer]) is not None
    elsewhere = copy.deepcopy(still)  # another namespace's record of the same uid: not a reader
    elsewhere["metadata"]["namespace"] = "team-b"
    assert confirmation.orphaned(pod, [owner, elsewhere]) is not None
    another = copy.deepcopy(pod)
    another["metadata"]["uid"] = "a-later-pod"  # made since under the name: no record reads it
    assert confirmation.orphaned(another, [owner]) is None
    unlabelled = copy.deepcopy(pod)
    unlabelled["metadata"]["labels"] = {}
    assert confirmation.orphaned(unlabelled, [owner]) is None


def test_a_confirmation_waiting_for_another_namespaces_pod_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Asked again every few seconds while another namespace's pod runs on the node: the
    WARNING is logged when the wait begins (and when what it waits for changes), not at
    every try."""
    from sdc_operator.actions import UNKNOWN, Outcome
    from sdc_operator.engine import IncidentEngine
    from sdc_operator.metrics import Metrics

    nothing: Any = None
    fake: Any = type("C", (), {})()
    engine = IncidentEngine(
        OperatorSettings(), Metrics(), fake, records=nothing, containment=nothing
    )
    engine.leader = True  # only a leader acts (or verifies)
    action = Action("confirm-node", "node-b")
    status = quarantined()
    status["actions"].append({"action": "confirm-node", "target": "node-b", "result": "Pending"})
    waiting = incident(status, bundle=BUNDLE)
    said = ["waiting for the confirmation pod team-b/x of incident team-b/y on node node-b"]

    async def verify(*_: Any) -> Outcome:
        return Outcome(UNKNOWN, said[0])

    engine.actions.verify = verify  # type: ignore[method-assign,assignment]

    async def tries(n: int) -> None:
        for _ in range(n):
            assert (
                await engine._act(("ml", "llama-1200-3f9a0b1c"), waiting, action, Rules()) is None
            )

    with caplog.at_level("DEBUG", logger="sdc_operator.engine"):
        asyncio.run(tries(4))
        said[0] = "waiting for the confirmation pod team-b/z of incident team-b/w on node node-b"
        asyncio.run(tries(3))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "team-b/x" in warned[0] and "team-b/z" in warned[1], warned
    assert len([r for r in caplog.records if "verifying before" in r.getMessage()]) == 7


def test_an_intent_another_leader_recorded_first_is_verified_not_overwritten_and_taken() -> None:
    """Two replicas acting at once (a handover): this one's intent write meets a conflict,
    and the incident read again holds the other's ``Pending`` entry for the same action.
    That entry is kept (not overwritten with this replica's intent) and the action is not
    taken here; the next step verifies it. Without the conflict, the same call records
    the intent and takes the action, which shows the test can fail. A replica that no
    longer leads records nothing and takes nothing."""
    from sdc_operator.actions import Outcome
    from sdc_operator.engine import IncidentEngine
    from sdc_operator.metrics import Metrics

    action = Action("confirm-node", "node-b")
    theirs = {"action": "confirm-node", "target": "node-b", "result": "Pending", "at": "t0"}

    def run(conflict: bool, leading: bool = True) -> tuple[list[str], dict[str, Any]]:
        before = incident(quarantined(), bundle=BUNDLE)
        before["metadata"]["resourceVersion"] = "1"
        stored = {"incident": copy.deepcopy(before)}
        if conflict:
            stored["incident"]["status"]["actions"].append(dict(theirs))
            stored["incident"]["metadata"]["resourceVersion"] = "2"
        cache = {"incident": before}
        taken: list[str] = []

        class Kube:
            async def replace_incident_status(self, body: dict[str, Any]) -> dict[str, Any]:
                if (
                    body["metadata"]["resourceVersion"]
                    != stored["incident"]["metadata"]["resourceVersion"]
                ):
                    raise ApiError(409, "conflict")
                stored["incident"] = copy.deepcopy(body)
                return body

            async def get_incident(self, namespace: str, name: str) -> dict[str, Any]:
                return copy.deepcopy(stored["incident"])

        class Incidents:
            def get(self, namespace: str, name: str) -> dict[str, Any]:
                return cache["incident"]

            def upsert(self, written: dict[str, Any]) -> None:
                cache["incident"] = written

        fake: Any = type("C", (), {"incidents": Incidents()})()
        kube: Any = Kube()
        engine = IncidentEngine(OperatorSettings(), Metrics(), fake, records=kube, containment=kube)
        engine.leader = True
        engine.leading = lambda: leading

        async def intent(*_: Any) -> dict[str, Any]:
            return {"mine": True}

        async def take(*_: Any) -> Outcome:
            taken.append(action.action)
            return Outcome("Failed", "stopped here")

        engine.actions.intent = intent  # type: ignore[method-assign,assignment]
        engine.actions.take = take  # type: ignore[method-assign,assignment]
        asyncio.run(engine._act(("ml", "llama-1200-3f9a0b1c"), before, action, Rules()))
        return taken, stored["incident"]

    taken, stored = run(conflict=True)
    assert taken == [] and stored["status"]["actions"][-1] == theirs
    taken, stored = run(conflict=False)
    assert taken == ["confirm-node"] and stored["status"]["actions"][-1]["result"] == "Failed"
    taken, stored = run(conflict=False, leading=False)
    assert taken == [] and stored["status"]["actions"][-1]["action"] == "resume-job"
