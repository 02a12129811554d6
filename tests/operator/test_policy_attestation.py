"""Admin opt-in (SDCPolicy), the creator marker and the legacy attestation: pure
decisions."""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import pytest

from sdc_operator.attestation import (
    ATTESTATION_ANNOTATION,
    CREATED_BY_ANNOTATION,
    MARKER_LABEL,
    WINDOW_SECONDS,
    creator_refusal,
    sign,
    verify_legacy,
    verify_pod,
)
from sdc_operator.policy import namespace_admission, selector_matches

KEY = b"k" * 32
OPERATOR = "system:serviceaccount:kubeflow:training-operator"


def policy(name: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": spec}


def test_no_policy_admits_nothing() -> None:
    admission = namespace_admission([], "ml", {})
    assert not admission.admitted
    assert "not admitted by any SDCPolicy" in admission.reason


def test_an_empty_policy_admits_nothing() -> None:
    assert not namespace_admission([policy("empty")], "ml", {"team": "ml"}).admitted


def test_names_and_selectors_admit() -> None:
    policies = [
        policy("by-name", namespaces=["ml"]),
        policy("by-label", namespaceSelector={"matchLabels": {"team": "research"}}),
    ]
    assert namespace_admission(policies, "ml", {}).policies == ("by-name",)
    assert namespace_admission(policies, "lab", {"team": "research"}).policies == ("by-label",)
    assert not namespace_admission(policies, "lab", {"team": "other"}).admitted


def test_the_most_cautious_policy_wins() -> None:
    policies = [
        policy("bold", namespaces=["ml"], remediationPolicy="auto-replace"),
        policy("careful", namespaceSelector={}, remediationPolicy="auto-reboot", dryRun=True),
        policy("typo", namespaces=["other"], remediationPolicy="auto-replce"),
    ]
    admission = namespace_admission(policies, "ml", {})
    assert (admission.remediation_policy, admission.dry_run) == ("auto-reboot", True)
    assert admission.policies == ("bold", "careful")
    # An unknown value never makes a policy bolder.
    assert namespace_admission(policies, "other", {}).remediation_policy == "manual"


def test_cluster_approvals_read_decisions_from_the_policy_only() -> None:
    from sdc_operator.incidents import Rules, ignored_decision, requested_remediation

    incident = {
        "metadata": {
            "name": "i",
            "namespace": "ml",
            "uid": "u-1",
            "annotations": {"hyperpod-sdc.dev/action": "replace"},  # the tenant's word
        }
    }
    # Clean path: approvals by namespace (the default) read the incident's annotation.
    tenants = namespace_admission([policy("p", namespaces=["ml"])], "ml", {})
    assert not tenants.cluster_approvals
    rules = Rules(cluster_approvals=tenants.cluster_approvals, approved=tenants.approved)
    assert requested_remediation(incident, rules) == ["replace"]
    assert ignored_decision(incident, rules) is None
    # approvals: cluster (on any admitting policy; a value we do not know counts as cluster)
    for spec in ({"approvals": "cluster"}, {"approvals": "clustr"}):
        strict = policy("strict", namespaces=["ml"], **spec)
        admission = namespace_admission([policy("p", namespaces=["ml"]), strict], "ml", {})
        assert admission.cluster_approvals
        rules = Rules(cluster_approvals=True, approved=admission.approved)
        assert requested_remediation(incident, rules) == []
        why = ignored_decision(incident, rules)
        assert why is not None and "approve.hyperpod-sdc.dev/u-1=replace" in why
    # A cluster admin's decision on an admitting policy, bound to the incident's uid.
    strict = policy("strict", namespaces=["ml"], approvals="cluster")
    strict["metadata"]["annotations"] = {
        "approve.hyperpod-sdc.dev/u-1": "reboot",
        "approve.hyperpod-sdc.dev/u-other": "release",
    }
    admission = namespace_admission([strict], "ml", {})
    rules = Rules(cluster_approvals=True, approved=admission.approved)
    assert requested_remediation(incident, rules) == ["reboot"]
    other = {"metadata": {**incident["metadata"], "uid": "u-2"}}
    assert requested_remediation(other, rules) == []
    # A policy that does not admit the namespace decides nothing for it.
    elsewhere = policy("elsewhere", namespaces=["lab"])
    elsewhere["metadata"]["annotations"] = {"approve.hyperpod-sdc.dev/u-2": "replace"}
    admission = namespace_admission([strict, elsewhere], "ml", {})
    assert "u-2" not in admission.approved


@pytest.mark.parametrize(
    ("expression", "labels", "matches"),
    [
        ({"key": "t", "operator": "In", "values": ["a"]}, {"t": "a"}, True),
        ({"key": "t", "operator": "In", "values": ["a"]}, {}, False),
        ({"key": "t", "operator": "NotIn", "values": ["a"]}, {}, True),
        ({"key": "t", "operator": "Exists"}, {"t": ""}, True),
        ({"key": "t", "operator": "DoesNotExist"}, {"t": ""}, False),
        ({"key": "t", "operator": "Gt", "values": ["1"]}, {"t": "2"}, False),
    ],
)
def test_selector_expressions(
    expression: dict[str, Any], labels: dict[str, str], matches: bool
) -> None:
    assert selector_matches({"matchExpressions": [expression]}, labels) is matches


def _iso(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def pod(**meta: Any) -> dict[str, Any]:
    base = {
        "namespace": "ml",
        "name": "train-worker-0",
        "ownerReferences": [{"uid": "job-uid", "controller": True}],
        # the API server's, moments after the webhook signed
        "creationTimestamp": _iso(time.time()),
    }
    return {"metadata": {**base, **meta}}


FAR = time.time() + 86400
"""A legacy end date well ahead."""


def attested(p: dict[str, Any], username: str = OPERATOR) -> dict[str, Any]:
    """``p`` with the v2 attestation an earlier version's webhook wrote."""
    out = copy.deepcopy(p)
    meta = out["metadata"]
    at = int(time.time())
    name = meta.get("name") or meta["generateName"]
    value = sign(KEY, meta["namespace"], name, meta["ownerReferences"][0]["uid"], username, at)
    meta["annotations"] = {ATTESTATION_ANNOTATION: value, CREATED_BY_ANNOTATION: username}
    return out


def marked(p: dict[str, Any], username: str = OPERATOR) -> dict[str, Any]:
    """``p`` with the creator marker the webhook writes now."""
    out = copy.deepcopy(p)
    out["metadata"]["labels"] = {MARKER_LABEL: "true"}
    out["metadata"]["annotations"] = {CREATED_BY_ANNOTATION: username}
    return out


def test_a_marked_pod_verifies_and_a_v2_one_only_with_the_legacy_date() -> None:
    assert verify_pod(marked(pod()), {OPERATOR}) == (
        True,
        "pod ml/train-worker-0 was created by " + OPERATOR,
    )
    legacy = attested(pod())
    genuine, why = verify_pod(legacy, {OPERATOR})
    assert not genuine and MARKER_LABEL in why
    assert verify_legacy(KEY, legacy, {OPERATOR}, FAR)[0]
    # past the end date, and for pods created after it, the v2 value counts for nothing
    genuine, why = verify_legacy(KEY, legacy, {OPERATOR}, time.time() - 1)
    assert not genuine and "no longer accepted" in why


@pytest.mark.parametrize(
    "forgery",
    ["no marker", "the label only", "untrusted creator", "no owner", "the label not true"],
)
def test_marks_that_do_not_verify(forgery: str) -> None:
    p = marked(pod())
    if forgery == "no marker":
        p = pod()
    elif forgery == "the label only":
        del p["metadata"]["annotations"]
    elif forgery == "untrusted creator":
        p = marked(pod(), "alice")
    elif forgery == "no owner":
        del p["metadata"]["ownerReferences"]
    elif forgery == "the label not true":
        p["metadata"]["labels"][MARKER_LABEL] = "yes"
    genuine, why = verify_pod(p, {OPERATOR})
    assert not genuine and why


CREATOR_CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, str, str | None]] = [
    # the webhook's own marks, by the trusted creator
    ("CREATE", marked(pod()), None, OPERATOR, None),
    # unmarked pods claim nothing, whoever writes them
    ("CREATE", pod(), None, "alice", None),
    ("UPDATE", pod(), marked(pod()), "alice", None),  # removing the marker
    # a tenant's marker (the webhook was down, or the tenant wrote it after a forged review)
    ("CREATE", marked(pod()), None, "alice", "may be set only by a trusted pod creator"),
    ("CREATE", marked(pod(), "alice"), None, "alice", "may be set only"),
    # the trusted creator's pod naming someone else
    ("CREATE", marked(pod(), "bob"), None, OPERATOR, "must name the pod's creator"),
    # an update may neither add the marker nor change the creator, whoever sends it
    ("UPDATE", marked(pod()), pod(), OPERATOR, "cannot be added"),
    ("UPDATE", marked(pod()), pod(), "alice", "cannot be added"),
    ("UPDATE", marked(pod(), "bob"), marked(pod()), "alice", "cannot be changed"),
    ("UPDATE", marked(pod()), marked(pod()), "alice", None),  # e.g. a label of its own
]
"""(operation, pod, old pod, user, part of the refusal or None): the creator check's rule,
which tests/chart also runs through the chart's ValidatingAdmissionPolicy."""


@pytest.mark.parametrize(("operation", "pod_", "old", "user", "refused"), CREATOR_CASES)
def test_the_creator_check(
    operation: str, pod_: dict[str, Any], old: dict[str, Any] | None, user: str, refused: str | None
) -> None:
    why = creator_refusal(operation, pod_, old, user, {OPERATOR})
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


@pytest.mark.parametrize(
    "forgery",
    [
        "no annotation",
        "untrusted creator",
        "moved to another pod",
        "other owner",
        "other key",
        "claims a trusted creator",
        "copied to a pod made later under the same name",
        "no creation time",
        "the previous format",
    ],
)
def test_forged_legacy_attestations_fail(forgery: str) -> None:
    trusted = {OPERATOR}
    p = attested(pod())
    key = KEY
    if forgery == "no annotation":
        p = pod()
    elif forgery == "untrusted creator":
        p = attested(pod(), "alice")
    elif forgery == "moved to another pod":
        p["metadata"]["name"] = "train-worker-9"
    elif forgery == "other owner":
        p["metadata"]["ownerReferences"][0]["uid"] = "other-job"
    elif forgery == "other key":
        key = b"x" * 32
    elif forgery == "claims a trusted creator":
        # alice's own valid attestation, relabelled as the operator's
        p = attested(pod(), "alice")
        p["metadata"]["annotations"][CREATED_BY_ANNOTATION] = OPERATOR
    elif forgery == "copied to a pod made later under the same name":
        p["metadata"]["creationTimestamp"] = _iso(time.time() + WINDOW_SECONDS + 5)
    elif forgery == "no creation time":
        del p["metadata"]["creationTimestamp"]
    elif forgery == "the previous format":
        value = p["metadata"]["annotations"][ATTESTATION_ANNOTATION]
        p["metadata"]["annotations"][ATTESTATION_ANNOTATION] = "v1:" + value.rsplit(":", 1)[1]
    genuine, why = verify_legacy(key, p, trusted, FAR)
    assert not genuine
    assert why


def test_generate_name_pods_verify_under_their_final_name() -> None:
    submitted = pod(name=None, generateName="train-worker-")
    p = attested(submitted)
    p["metadata"]["name"] = "train-worker-x7k2p"
    assert verify_legacy(KEY, p, {OPERATOR}, FAR)[0]


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        sign(b"short", "ml", "p", "u", OPERATOR, 0)
