"""The admission webhook's pure half: what a pod gets, its attestation, the JSON Patch, the
job shapes the audit cannot fully cover, and the webhook's answers to reviews."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sdc_common.names import DEFAULT_TOKEN_FILE
from sdc_operator.attestation import (
    ATTESTATION_ANNOTATION,
    CREATED_BY_ANNOTATION,
    MARKER_LABEL,
    verify_pod,
)
from sdc_operator.errors import ConfigError
from sdc_operator.injection import (
    CA_BUNDLE_ENV,
    INJECTION_ANNOTATION,
    OPERATOR_URL_ENV,
    TOKEN_DIR,
    TOKEN_FILE_ENV,
    TOKEN_PATH,
    Wiring,
    attest,
    json_patch,
    label_selector_string,
    restore_attestation,
    wire_pod,
)
from sdc_operator.jobshape import audit_limits
from sdc_operator.jobwatch import unguarded_pods
from sdc_operator.policy import Admission
from sdc_operator.webhook import PodWebhook, WebhookSettings

KEY = b"k" * 32
OPERATOR = "system:serviceaccount:kubeflow:training-operator"
WIRING = Wiring(operator_url="https://sdc.sdc.svc:443", token_audience="hyperpod-sdc")
JOB_UID = "3f1c-job-uid"
KUBEFLOW_LABELS = {
    "training.kubeflow.org/operator-name": "pytorchjob-controller",
    "training.kubeflow.org/job-name": "llama",
}


def stored(made: dict[str, Any]) -> dict[str, Any]:
    """``made`` as the API server stores it, its creation time set."""
    out = copy.deepcopy(made)
    out["metadata"]["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return out


def pod(**containers: list[dict[str, Any]]) -> dict[str, Any]:
    """A pod as Kubeflow's training operator submits it: ``containers`` name -> env."""
    return {
        "metadata": {
            "name": "llama-worker-0",
            "namespace": "ml",
            "labels": dict(KUBEFLOW_LABELS),
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": "llama",
                    "uid": JOB_UID,
                    "controller": True,
                }
            ],
        },
        "spec": {
            "initContainers": [{"name": "fetch", "image": "busybox"}],
            "containers": [
                {"name": name, "image": "train:1", **({"env": env} if env else {})}
                for name, env in (containers or {"pytorch": []}).items()
            ],
        },
    }


def apply_patch(doc: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 for the operations and pointers the webhook emits."""
    doc = copy.deepcopy(doc)
    for op in patch:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            index = int(last)
            if op["op"] == "remove":
                del target[index]
            elif op["op"] == "replace":
                target[index] = op["value"]
            else:
                target.insert(index, op["value"])
        elif op["op"] == "remove":
            del target[last]
        elif op["op"] == "replace":
            assert last in target, op
            target[last] = op["value"]
        else:
            target[last] = op["value"]
    return doc


def record(wired: dict[str, Any]) -> dict[str, list[str]]:
    return dict(json.loads(wired["metadata"]["annotations"][INJECTION_ANNOTATION]))


def test_the_token_is_mounted_where_the_agent_looks_without_being_told() -> None:
    # The env names themselves are sdc_common's (tests/unit/test_common.py: none is copied).
    assert f"{TOKEN_DIR}/{TOKEN_PATH}" == DEFAULT_TOKEN_FILE
    assert DEFAULT_TOKEN_FILE == "/var/run/secrets/hyperpod-sdc/token"


def test_an_opted_in_pod_gets_exactly_the_wiring() -> None:
    before = pod(pytorch=[{"name": "A", "value": "1"}])
    after = wire_pod(before, WIRING)
    (container,) = after["spec"]["containers"]
    ref = {"apiVersion": "v1", "fieldPath": "metadata.name"}
    assert container["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": ref}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {**ref, "fieldPath": "spec.nodeName"}}},
        {"name": OPERATOR_URL_ENV, "value": "https://sdc.sdc.svc:443"},
        {"name": TOKEN_FILE_ENV, "value": "/var/run/secrets/hyperpod-sdc/token"},
        {"name": CA_BUNDLE_ENV, "value": "/etc/hyperpod-sdc/ca/ca.crt"},
        {"name": "A", "value": "1"},  # the pod's own, after ours: it may refer to them
    ]
    assert container["volumeMounts"] == [
        {
            "name": "hyperpod-sdc-token",
            "mountPath": "/var/run/secrets/hyperpod-sdc",
            "readOnly": True,
        },
        {"name": "hyperpod-sdc-ca", "mountPath": "/etc/hyperpod-sdc/ca", "readOnly": True},
    ]
    assert after["spec"]["volumes"] == [
        {
            "name": "hyperpod-sdc-token",
            "projected": {
                "sources": [
                    {
                        "serviceAccountToken": {
                            "audience": "hyperpod-sdc",
                            "expirationSeconds": 3600,
                            "path": "token",
                        }
                    }
                ],
                "defaultMode": 0o644,
            },
        },
        {"name": "hyperpod-sdc-ca", "configMap": {"name": "hyperpod-sdc-ca", "defaultMode": 0o644}},
    ]
    assert after["spec"]["initContainers"] == before["spec"]["initContainers"]
    assert record(after)["kept"] == [] and len(record(after)["added"]) == 9
    # nothing else changed
    for part in (after, before):
        part["spec"].pop("volumes", None)
        part["metadata"].pop("annotations", None)
        for c in part["spec"]["containers"]:
            c.pop("volumeMounts", None)
            c["env"] = [e for e in c.get("env", []) if e["name"] == "A"]
    assert after == before


def test_the_pods_own_values_win_and_the_pod_says_so() -> None:
    own_node = {"name": "NODE_NAME", "value": "from-the-user"}
    before = pod(pytorch=[own_node])
    before["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "my-ca", "mountPath": "/etc/hyperpod-sdc/ca"}
    ]
    before["spec"]["volumes"] = [{"name": "hyperpod-sdc-token", "emptyDir": {}}]
    after = wire_pod(before, WIRING)
    (container,) = after["spec"]["containers"]
    assert [e for e in container["env"] if e["name"] == "NODE_NAME"] == [own_node]
    assert [m["name"] for m in container["volumeMounts"]] == ["my-ca", "hyperpod-sdc-token"]
    # the pod's own token volume is kept; no CA volume, since nothing mounts it
    assert after["spec"]["volumes"] == [{"name": "hyperpod-sdc-token", "emptyDir": {}}]
    assert record(after)["kept"] == [
        "pytorch/env/NODE_NAME",
        "pytorch/volumeMount/hyperpod-sdc-ca",
        "volume/hyperpod-sdc-token",
    ]


def test_containers_by_name_and_idempotence() -> None:
    before = pod(pytorch=[], sidecar=[])
    named = Wiring(**{**_fields(WIRING), "containers": ("pytorch",)})
    after = wire_pod(before, named)
    assert "env" in after["spec"]["containers"][0] and "env" not in after["spec"]["containers"][1]
    assert all(a.startswith(("pytorch/", "volume/")) for a in record(after)["added"])
    again = wire_pod(after, named)
    assert again == after  # the record of what was added stays
    nobody = wire_pod(before, Wiring(**{**_fields(WIRING), "containers": ("absent",)}))
    assert "volumes" not in nobody["spec"] and record(nobody) == {"added": [], "kept": []}
    plain = wire_pod(before, Wiring(**{**_fields(WIRING), "ca_configmap": None}))
    assert CA_BUNDLE_ENV not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}
    assert [v["name"] for v in plain["spec"]["volumes"]] == ["hyperpod-sdc-token"]


def _fields(wiring: Wiring) -> dict[str, Any]:
    return {f: getattr(wiring, f) for f in wiring.__slots__}


def test_the_patch_turns_the_pod_into_the_wired_pod() -> None:
    for before in (pod(), pod(pytorch=[{"name": "A", "value": "1"}], other=[])):
        before["metadata"]["annotations"] = {"keep/me": "x", ATTESTATION_ANNOTATION: "copied"}
        after = wire_pod(attest(before, "someone", [OPERATOR]), WIRING)
        patch = json_patch(before, after)
        assert apply_patch(before, patch) == after
        assert {
            "op": "remove",
            "path": "/metadata/annotations/hyperpod-sdc.dev~1attestation",
        } in patch
    bare = pod()
    after = attest(bare, OPERATOR, [OPERATOR])
    assert [op["path"] for op in json_patch(bare, after)] == [
        "/metadata/labels/hyperpod-sdc.dev~1attested",
        "/metadata/annotations",
    ]
    assert apply_patch(bare, json_patch(bare, after)) == after
    assert json_patch(after, after) == []


def test_attestation_for_the_trusted_creator_only() -> None:
    made = attest(pod(), OPERATOR, [OPERATOR])
    annotations = made["metadata"]["annotations"]
    assert annotations[CREATED_BY_ANNOTATION] == OPERATOR
    assert verify_pod(stored(made), {OPERATOR}) == (
        True,
        f"pod ml/llama-worker-0 was created by {OPERATOR}",
    )
    assert made["metadata"]["labels"][MARKER_LABEL] == "true"
    # someone else's pod carrying a copied marker (and a legacy attestation) loses them
    forged = copy.deepcopy(pod())
    forged["metadata"]["annotations"] = {**annotations, ATTESTATION_ANNOTATION: "v2:1:x"}
    forged["metadata"]["labels"] = dict(made["metadata"]["labels"])
    stripped = attest(forged, "system:serviceaccount:ml:default", [OPERATOR])
    assert CREATED_BY_ANNOTATION not in stripped["metadata"]["annotations"]
    assert ATTESTATION_ANNOTATION not in stripped["metadata"]["annotations"]
    assert MARKER_LABEL not in stripped["metadata"]["labels"]
    assert stripped["metadata"]["labels"] == KUBEFLOW_LABELS
    # no controlling owner: nothing to attest
    orphan = pod()
    orphan["metadata"]["ownerReferences"] = []
    assert MARKER_LABEL not in attest(orphan, OPERATOR, [OPERATOR])["metadata"]["labels"]


def test_an_update_never_writes_or_keeps_a_new_attestation() -> None:
    made = attest(pod(), OPERATOR, [OPERATOR])
    tampered = copy.deepcopy(made)
    tampered["metadata"]["annotations"][CREATED_BY_ANNOTATION] = "someone-else"
    assert (
        restore_attestation(tampered, made, old_was_seen=True)["metadata"]["annotations"]
        == (made["metadata"]["annotations"])
    )
    del tampered["metadata"]["labels"][MARKER_LABEL]
    restored = restore_attestation(tampered, made, old_was_seen=True)
    assert restored["metadata"]["labels"] == made["metadata"]["labels"]
    # a pod the webhook never saw created (unlabelled then) keeps nothing when relabelled
    relabelled = restore_attestation(made, made, old_was_seen=False)
    assert CREATED_BY_ANNOTATION not in relabelled["metadata"]["annotations"]
    assert MARKER_LABEL not in relabelled["metadata"]["labels"]


def test_label_selector_strings() -> None:
    assert label_selector_string({"matchLabels": {"b": "2", "a": "1"}}) == "a=1,b=2"
    expressions = [
        {"key": "k", "operator": "In", "values": ["y", "x"]},
        {"key": "n", "operator": "NotIn", "values": ["z"]},
        {"key": "e", "operator": "Exists"},
        {"key": "d", "operator": "DoesNotExist"},
    ]
    assert label_selector_string({"matchExpressions": expressions}) == (
        "k in (x,y),n notin (z),e,!d"
    )


def job(replicas: dict[str, int], nproc: Any = None, gpus: dict[str, int] | None = None) -> dict:
    specs = {}
    for name, count in replicas.items():
        container: dict[str, Any] = {"name": "pytorch"}
        if gpus and name in gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus[name]}}
        specs[name] = {"replicas": count, "template": {"spec": {"containers": [container]}}}
    spec: dict[str, Any] = {"pytorchReplicaSpecs": specs}
    if nproc is not None:
        spec["nprocPerNode"] = nproc
    return {"spec": spec}


def test_what_the_audit_cannot_do_for_small_or_uneven_jobs() -> None:
    assert audit_limits(job({"Master": 1, "Worker": 2}, nproc="8")) == []
    assert audit_limits(job({"Master": 1, "Worker": 2}, gpus={"Master": 8, "Worker": 8})) == []
    (two,) = audit_limits(job({"Master": 1, "Worker": 1}, nproc=8))
    assert "2 nodes" in two and "third node" in two
    (one,) = audit_limits(job({"Master": 1}))
    assert "1 node" in one and "agreement" in one
    (uneven,) = audit_limits(job({"Master": 1, "Worker": 3}, gpus={"Master": 4, "Worker": 8}))
    assert "uneven" in uneven and "Master: 4, Worker: 8" in uneven
    hyperpod = {"spec": {"nprocPerNode": "auto", "replicaSpecs": [{"name": "pods", "replicas": 2}]}}
    assert "2 nodes" in audit_limits(hyperpod)[0]


def test_unguarded_pods_are_the_jobs_live_unwired_selected_ones() -> None:
    selectors = [{"matchLabels": {"training.kubeflow.org/operator-name": "pytorchjob-controller"}}]
    wired = wire_pod(pod(), WIRING)
    missed = pod()
    missed["metadata"]["name"] = "llama-worker-1"
    done = copy.deepcopy(missed)
    done["metadata"]["name"], done["status"] = "llama-worker-2", {"phase": "Succeeded"}
    other_job = copy.deepcopy(missed)
    other_job["metadata"]["name"] = "other"
    other_job["metadata"]["ownerReferences"][0]["uid"] = "another"
    unselected = copy.deepcopy(missed)
    unselected["metadata"]["name"], unselected["metadata"]["labels"] = "hand-made", {}
    pods = [wired, missed, done, other_job, unselected]
    assert unguarded_pods(pods, JOB_UID, selectors) == ["llama-worker-1"]


def test_settings_from_env_name_the_variable() -> None:
    settings = WebhookSettings.from_env(
        {
            "HYPERPOD_SDC_INJECT_OPERATOR_URL": "https://sdc.sdc.svc:443",
            "HYPERPOD_SDC_INJECT_CONTAINERS": "pytorch",
            "HYPERPOD_SDC_WEBHOOK_POD_SELECTORS": '[{"matchLabels": {"a": "b"}}]',
        }
    )
    assert settings.webhook_pod_selectors == ({"matchLabels": {"a": "b"}},)
    bad = [
        ("HYPERPOD_SDC_INJECT_OPERATOR_URL", "sdc.svc"),
        ("HYPERPOD_SDC_INJECT_TOKEN_EXPIRATION_SECONDS", "60"),
        ("HYPERPOD_SDC_INJECT_TOKEN_EXPIRATION_SECONDS", "soon"),
        ("HYPERPOD_SDC_WEBHOOK_POD_SELECTORS", "[{}]"),
        ("HYPERPOD_SDC_WEBHOOK_POD_SELECTORS", "{not json"),
        ("HYPERPOD_SDC_JOB_SWEEP_SECONDS", "0"),
    ]
    for name, value in bad:
        with pytest.raises(ConfigError, match=name):
            WebhookSettings.from_env({name: value})


class FakeLookups:
    def __init__(self, job: dict[str, Any] | None, admitted: bool = True) -> None:
        self._job = job
        self._admitted = admitted
        self.calls = 0

    async def job(self, namespace: str, owner: dict[str, Any]) -> dict[str, Any] | None:
        self.calls += 1
        return self._job

    async def admission(self, namespace: str) -> Admission:
        return Admission(self._admitted, "manual", False, ("p",) if self._admitted else (), "why")


def webhook(lookups: FakeLookups) -> PodWebhook:
    settings = WebhookSettings(inject_operator_url="https://sdc.sdc.svc:443", tls_ca_file="/ca.crt")
    return PodWebhook(
        settings,
        lookups,  # type: ignore[arg-type]
        token_audience="hyperpod-sdc",
        trusted_creators=lambda: (OPERATOR,),
        registry=CollectorRegistry(),
    )


def review(obj: Any, operation: str = "CREATE", kind: str = "Pod", **extra: Any) -> dict:
    return {
        "uid": "req-1",
        "kind": {"group": "", "version": "v1", "kind": kind},
        "operation": operation,
        "namespace": "ml",
        "userInfo": {"username": OPERATOR},
        "object": obj,
        **extra,
    }


def answer(hook: PodWebhook, req: dict[str, Any]) -> tuple[dict[str, Any], str, dict | None]:
    response, outcome = asyncio.run(hook.review(req))
    patched = None
    if "patch" in response:
        patched = apply_patch(req["object"], json.loads(base64.b64decode(response["patch"])))
    return response, outcome, patched


ENABLED_JOB = {"metadata": {"uid": JOB_UID, "annotations": {"hyperpod-sdc.dev/enabled": "true"}}}


def test_reviews_wire_only_opted_in_admitted_jobs() -> None:
    response, outcome, patched = answer(webhook(FakeLookups(ENABLED_JOB)), review(pod()))
    assert response["allowed"] is True and response["uid"] == "req-1"
    assert outcome == "injected" and patched is not None
    assert INJECTION_ANNOTATION in patched["metadata"]["annotations"]
    assert verify_pod(stored(patched), {OPERATOR})[0]
    off = {"metadata": {"uid": JOB_UID, "annotations": {"hyperpod-sdc.dev/enabled": "false"}}}
    replaced = {"metadata": {**ENABLED_JOB["metadata"], "uid": "a-new-job-of-the-same-name"}}
    for lookups in (
        FakeLookups(off),
        FakeLookups(ENABLED_JOB, admitted=False),
        FakeLookups(None),
        FakeLookups(replaced),
    ):
        response, outcome, patched = answer(webhook(lookups), review(pod()))
        assert outcome == "untouched" and patched is not None  # attested, not wired
        assert INJECTION_ANNOTATION not in patched["metadata"]["annotations"]


def test_reviews_of_other_things_are_allowed_unchanged() -> None:
    lookups = FakeLookups(ENABLED_JOB)
    hook = webhook(lookups)
    for req in (
        review(pod(), kind="Service"),
        review(pod(), operation="DELETE"),
        review("not an object"),
        review(pod(), subResource="status"),
    ):
        assert answer(hook, req) == ({"uid": "req-1", "allowed": True}, "untouched", None)
    assert lookups.calls == 0
    made = attest(pod(), OPERATOR, [OPERATOR])
    changed = copy.deepcopy(made)
    changed["metadata"]["annotations"][ATTESTATION_ANNOTATION] = "v1:forged"
    _, outcome, patched = answer(hook, review(changed, operation="UPDATE", oldObject=made))
    assert patched is not None and outcome == "untouched"
    assert patched["metadata"]["annotations"] == made["metadata"]["annotations"]


class FailingLookups(FakeLookups):
    def __init__(self, how: str) -> None:
        super().__init__(ENABLED_JOB)
        self.how = how

    async def job(self, namespace: str, owner: dict[str, Any]) -> dict[str, Any] | None:
        if self.how == "slow":
            await asyncio.sleep(5)
        raise RuntimeError("the API server is away")


@pytest.mark.parametrize("how", ["slow", "failing"])
def test_a_failed_lookup_still_strips_a_copied_attestation(how: str) -> None:
    """Wiring needs lookups; the attestation does not. A hand-made pod carrying a copied
    attestation must lose it even when the lookups time out or fail (the pod is allowed,
    unwired, under either failure policy)."""
    forged = attest(pod(), OPERATOR, [OPERATOR])
    req = {**review(forged), "userInfo": {"username": "alice"}}
    response, outcome = asyncio.run(webhook(FailingLookups(how)).review(req, budget=0.2))
    assert response["allowed"] is True and outcome == "error"
    patched = apply_patch(forged, json.loads(base64.b64decode(response["patch"])))
    assert CREATED_BY_ANNOTATION not in patched["metadata"].get("annotations", {})
    assert MARKER_LABEL not in patched["metadata"]["labels"]
    assert INJECTION_ANNOTATION not in patched["metadata"].get("annotations", {})
    # and the trusted creator's pod keeps its fresh attestation though it is not wired
    response, outcome = asyncio.run(webhook(FailingLookups(how)).review(review(pod()), 0.2))
    patched = apply_patch(pod(), json.loads(base64.b64decode(response["patch"])))
    assert outcome == "error" and verify_pod(stored(patched), {OPERATOR})[0]
