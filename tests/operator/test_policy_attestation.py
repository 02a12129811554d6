"""Admin opt-in (SDCPolicy) and pod attestation: pure decisions."""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import pytest

from sdc_operator.attestation import (
    ATTESTATION_ANNOTATION,
    CREATED_BY_ANNOTATION,
    WINDOW_SECONDS,
    attestation_for,
    sign,
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


def attested(p: dict[str, Any], username: str = OPERATOR) -> dict[str, Any]:
    out = copy.deepcopy(p)
    value = attestation_for(KEY, out, username)
    assert value is not None
    out["metadata"]["annotations"] = {
        ATTESTATION_ANNOTATION: value,
        CREATED_BY_ANNOTATION: username,
    }
    return out


def test_an_attested_pod_verifies() -> None:
    genuine, why = verify_pod(KEY, attested(pod()), {OPERATOR})
    assert genuine, why


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
def test_forged_attestations_fail(forgery: str) -> None:
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
    genuine, why = verify_pod(key, p, trusted)
    assert not genuine
    assert why


def test_generate_name_pods_verify_under_their_final_name() -> None:
    submitted = pod(name=None, generateName="train-worker-")
    p = attested(submitted)
    p["metadata"]["name"] = "train-worker-x7k2p"
    assert verify_pod(KEY, p, {OPERATOR})[0]


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        sign(b"short", "ml", "p", "u", OPERATOR, 0)
