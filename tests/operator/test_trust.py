"""Trust, each part on its own: pods that fit their job, the policy's bound on remediation,
the token review's caches and limits, the attestation key."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from sdc_operator.attestation import load_key
from sdc_operator.auth import TokenReviewer
from sdc_operator.engine import IncidentEngine
from sdc_operator.errors import ApiError, OperatorError, Refusal
from sdc_operator.jobs import pod_fits_job
from sdc_operator.metrics import Metrics
from sdc_operator.settings import OperatorSettings

from .test_parts import BOUND, Reviews, jwt

JOB = {
    "kind": "PyTorchJob",
    "metadata": {"name": "train"},
    "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1}, "Worker": {"replicas": 3}}},
}


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "labels": labels}}


@pytest.mark.parametrize(
    ("name", "labels", "fits"),
    [
        ("train-master-0", {}, True),
        ("train-worker-2", {"training.kubeflow.org/replica-type": "worker"}, True),
        ("train-worker-3", {}, False),  # past the replica count
        ("train-launcher-0", {}, False),  # a type the job does not have
        ("evil-worker-0", {}, False),  # not named after the job
        ("train-worker-x", {}, False),
        ("train-worker-1", {"training.kubeflow.org/replica-index": "0"}, False),  # label lies
    ],
)
def test_a_pod_fits_its_job(name: str, labels: dict[str, str], fits: bool) -> None:
    assert (pod_fits_job(pod(name, **labels), JOB) is None) == fits


def test_a_hyperpod_job_pod_is_left_to_the_attestation() -> None:
    job = {"kind": "HyperPodPyTorchJob", "metadata": {"name": "hp"}, "spec": {"replicaSpecs": []}}
    assert pod_fits_job(pod("hp-anything-7"), job) is None
    assert pod_fits_job(pod("other-0"), job) is None


class FakeCaches:
    def __init__(self, policies: list[dict[str, Any]], labels: dict[str, str]) -> None:
        self.policies = type("P", (), {"values": lambda _self: policies})()
        self._labels = labels

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return self._labels


def engine(
    operator_policy: str, policies: list[dict[str, Any]], dry_run: bool = False
) -> IncidentEngine:
    settings = OperatorSettings(remediation_policy=operator_policy, dry_run=dry_run)
    fake: Any = FakeCaches(policies, {})
    nothing: Any = None
    return IncidentEngine(settings, Metrics(), fake, records=nothing, containment=nothing)


def policy(remediation: str, dry_run: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": remediation},
        "spec": {"namespaces": ["ml"], "remediationPolicy": remediation, "dryRun": dry_run},
    }


def test_the_operator_setting_is_the_upper_bound_of_every_policy() -> None:
    assert engine("manual", [policy("auto-replace")]).rules_for("ml").remediation_policy == "manual"
    bold = engine("auto-replace", [policy("auto-reboot")])
    assert bold.rules_for("ml").remediation_policy == "auto-reboot"
    assert engine("auto-replace", [policy("auto-replace")]).rules_for("ml").remediation_policy == (
        "auto-replace"
    )
    assert engine("auto-replace", [policy("auto-replace", dry_run=True)]).rules_for("ml").dry_run
    unadmitted = engine("auto-replace", [policy("auto-replace")]).rules_for("other")
    assert (unadmitted.remediation_policy, unadmitted.dry_run) == ("manual", True)


# -- token review ------------------------------------------------------------------------------


class SlowReviews(Reviews):
    async def token_review(self, token: str, audience: str) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.05)
        return self.status


def test_concurrent_requests_with_one_token_share_one_review() -> None:
    reviews = SlowReviews(BOUND)
    reviewer = TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=30)
    t = jwt()

    async def many() -> list[Any]:
        return await asyncio.gather(*(reviewer.authenticate(t) for _ in range(50)))

    identities = asyncio.run(many())
    assert {i.pod for i in identities} == {"job-worker-0"}
    assert reviews.calls == 1


def test_a_client_that_hangs_up_does_not_cancel_the_others_review() -> None:
    reviews = SlowReviews(BOUND)
    reviewer = TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=30)
    t = jwt()

    async def go() -> Any:
        first = asyncio.ensure_future(reviewer.authenticate(t))
        second = asyncio.ensure_future(reviewer.authenticate(t))
        await asyncio.sleep(0.01)
        first.cancel()
        return await second

    assert asyncio.run(go()).pod == "job-worker-0"
    assert reviews.calls == 1


def test_junk_is_refused_without_a_review_and_new_tokens_are_budgeted() -> None:
    reviews = Reviews(BOUND)
    now = [1000.0]
    reviewer = TokenReviewer(
        reviews,
        "hyperpod-sdc",
        cache_seconds=30,
        reviews_per_second=1,
        burst=2,
        clock=lambda: now[0],
    )

    def refused(token: str) -> Refusal:
        with pytest.raises(Refusal) as caught:
            asyncio.run(reviewer.authenticate(token))
        return caught.value

    assert "not a ServiceAccount token" in refused("not-a-jwt").message
    assert "expired" in refused(jwt({"exp": 999})).message
    assert "audience" in refused(jwt({"aud": ["other"]})).message
    assert reviews.calls == 0
    asyncio.run(reviewer.authenticate(jwt({"jti": "1"})))
    asyncio.run(reviewer.authenticate(jwt({"jti": "2"})))
    limited = refused(jwt({"jti": "3"}))
    assert (limited.status, limited.reason) == (429, "rate_limited")
    assert reviews.calls == 2


def test_an_accepted_review_is_not_kept_past_the_tokens_expiry() -> None:
    reviews = Reviews(BOUND)
    now = [1000.0]
    reviewer = TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=300, clock=lambda: now[0])
    t = jwt({"exp": 1010})
    asyncio.run(reviewer.authenticate(t))
    now[0] = 1005
    asyncio.run(reviewer.authenticate(t))
    assert reviews.calls == 1
    now[0] = 1011  # past exp: not from the cache, and refused by its own claim
    with pytest.raises(Refusal, match="expired"):
        asyncio.run(reviewer.authenticate(t))


def test_a_rejection_is_remembered_then_forgotten() -> None:
    reviews = Reviews({"authenticated": False, "error": "invalid bearer token"})
    now = [1000.0]
    reviewer = TokenReviewer(
        reviews, "hyperpod-sdc", cache_seconds=30, negative_seconds=60, clock=lambda: now[0]
    )
    t = jwt({"exp": 10_000})
    for at in (1000.0, 1030.0, 1059.0):
        now[0] = at
        with pytest.raises(Refusal):
            asyncio.run(reviewer.authenticate(t))
    assert reviews.calls == 1
    now[0] = 1061.0
    with pytest.raises(Refusal):
        asyncio.run(reviewer.authenticate(t))
    assert reviews.calls == 2


# -- the attestation key -----------------------------------------------------------------------


class Secrets:
    def __init__(self, existing: dict[str, Any] | None, conflict: bool = False) -> None:
        self.existing = existing
        self.conflict = conflict
        self.created: list[dict[str, Any]] = []

    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any:
        if self.existing is None:
            raise ApiError(404, "not found")
        return self.existing

    async def create(self, api_version: str, plural: str, namespace: str | None, body: Any) -> Any:
        if self.conflict:
            self.existing = {"data": {"key": base64.b64encode(b"w" * 32).decode()}}
            raise ApiError(409, "exists")
        self.created.append(body)
        return body

    async def create_once(
        self, api_version: str, plural: str, namespace: str, body: Any
    ) -> tuple[Any, bool]:
        # Effects.create_once over this fake (its 409 path reads the winner)
        try:
            return await self.create(api_version, plural, namespace, body), True
        except ApiError:
            return await self.get(api_version, plural, namespace, body["metadata"]["name"]), False


def test_the_first_replica_creates_the_key_the_others_read_it() -> None:
    fresh = Secrets(None)
    key = asyncio.run(load_key(fresh, fresh, "hyperpod-sdc", "k"))
    assert len(key.value) == 32 and len(fresh.created) == 1
    assert fresh.created[0]["metadata"] == {
        "name": "k",
        "namespace": "hyperpod-sdc",
        "labels": {"app.kubernetes.io/part-of": "hyperpod-sdc"},
    }
    raced = Secrets(None, conflict=True)  # another replica created it first
    assert asyncio.run(load_key(raced, raced, "hyperpod-sdc", "k")).value == b"w" * 32
    short = Secrets({"data": {"key": "c2hvcnQ="}})
    with pytest.raises(OperatorError, match="no usable 'key'"):
        asyncio.run(load_key(short, short, "hyperpod-sdc", "k"))
