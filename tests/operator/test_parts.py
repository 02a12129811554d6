"""Settings, rate limiter, token review and instance lookup, each on its own."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import traceback
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from sdc_operator.auth import StaticTokens, TokenReviewer
from sdc_operator.errors import ConfigError, Refusal
from sdc_operator.localize import InstanceResolver
from sdc_operator.ratelimit import RateLimiter
from sdc_operator.settings import ENV_OF_FIELD, OperatorSettings

# -- settings ------------------------------------------------------------------------------


def test_settings_defaults_are_safe() -> None:
    s = OperatorSettings.from_env({})
    assert (s.auth_mode, s.dry_run, s.agreement_nodes) == ("tokenreview", False, 2)


def test_settings_from_env() -> None:
    s = OperatorSettings.from_env(
        {
            "HYPERPOD_SDC_LISTEN_PORT": "9000",
            "HYPERPOD_SDC_DRY_RUN": "yes",
            "HYPERPOD_SDC_RATE_PER_JOB": "2.5",
            "HYPERPOD_SDC_NAMESPACES": "a, b,",
            "HYPERPOD_SDC_CLUSTER_NAME": "ml-cluster",
        }
    )
    assert (s.listen_port, s.dry_run, s.rate_per_job, s.namespaces, s.cluster_name) == (
        9000,
        True,
        2.5,
        ("a", "b"),
        "ml-cluster",
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"HYPERPOD_SDC_LISTEN_PORT": "http"},
            "HYPERPOD_SDC_LISTEN_PORT: expected an integer, got 'http'",
        ),
        ({"HYPERPOD_SDC_LISTEN_PORT": "70000"}, "HYPERPOD_SDC_LISTEN_PORT: must be a port number"),
        ({"HYPERPOD_SDC_DRY_RUN": "maybe"}, "HYPERPOD_SDC_DRY_RUN: expected true or false"),
        (
            {"HYPERPOD_SDC_AUTH_MODE": "none"},
            "HYPERPOD_SDC_AUTH_MODE: must be one of tokenreview, static",
        ),
        ({"HYPERPOD_SDC_AUTH_MODE": "static"}, "HYPERPOD_SDC_STATIC_TOKENS_FILE: is required"),
        (
            {"HYPERPOD_SDC_TLS_CERT_FILE": "/c.pem"},
            "HYPERPOD_SDC_TLS_CERT_FILE: and HYPERPOD_SDC_TLS_KEY_FILE go together",
        ),
        ({"HYPERPOD_SDC_AGREEMENT_NODES": "0"}, "HYPERPOD_SDC_AGREEMENT_NODES: must be >= 1"),
        ({"HYPERPOD_SDC_RATE_PER_JOB": "0"}, "HYPERPOD_SDC_RATE_PER_JOB: must be > 0"),
        (
            {"HYPERPOD_SDC_MAX_BODY_BYTES": "1000000"},
            "HYPERPOD_SDC_MAX_BODY_BYTES: must be between 1 and 65536",
        ),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        OperatorSettings.from_env(env)


def test_every_setting_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    missing = [name for name in ENV_OF_FIELD.values() if f"`{name}`" not in doc]
    assert not missing, f"docs/operator.md lacks {missing}"


# -- rate limiter --------------------------------------------------------------------------


def test_rate_limiter_bursts_then_refills_per_key() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.acquire("a") for _ in range(3)] == [None, None, None]
    wait = limiter.acquire("a")
    assert wait == pytest.approx(0.5)
    assert limiter.acquire("b") is None  # another job is not affected
    now[0] = 0.5
    assert limiter.acquire("a") is None
    assert limiter.acquire("a") is not None


def test_rate_limiter_memory_is_bounded() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=1.0, burst=1, clock=lambda: now[0], max_keys=10)
    for i in range(10):
        limiter.acquire(str(i))
    now[0] = 100.0  # every bucket refilled: dropped when a new key needs room
    limiter.acquire("new")
    assert len(limiter._buckets) == 1


# -- authentication ------------------------------------------------------------------------


class Reviews:
    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status
        self.calls = 0

    async def token_review(self, token: str, audience: str) -> dict[str, Any]:
        self.calls += 1
        return self.status


BOUND = {
    "authenticated": True,
    "audiences": ["hyperpod-sdc"],
    "user": {
        "username": "system:serviceaccount:ml:worker",
        "extra": {
            "authentication.kubernetes.io/pod-name": ["job-worker-0"],
            "authentication.kubernetes.io/pod-uid": ["u1"],
        },
    },
}


def jwt(claims: dict[str, Any] | None = None, header: dict[str, Any] | None = None) -> str:
    """A token shaped like a projected ServiceAccount token (its signature is not
    checked here: the API server's TokenReview does that)."""

    def part(value: Any) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    body = {"aud": ["hyperpod-sdc"], "exp": time.time() + 3600, **(claims or {})}
    return f"{part(header or {'alg': 'RS256'})}.{part(body)}.c2lnbmF0dXJl"


def test_token_review_gives_the_bound_pod_and_is_cached() -> None:
    reviews = Reviews(BOUND)
    reviewer = TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=30)
    t = jwt()
    for _ in range(3):
        identity = asyncio.run(reviewer.authenticate(t))
    assert (identity.namespace, identity.pod, identity.pod_uid) == ("ml", "job-worker-0", "u1")
    assert reviews.calls == 1
    asyncio.run(TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=0).authenticate(t))
    asyncio.run(TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=0).authenticate(t))
    assert reviews.calls == 3


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ({"authenticated": False, "error": "token expired"}, "token rejected: token expired"),
        ({**BOUND, "audiences": ["other"]}, "not meant for audience 'hyperpod-sdc'"),
        ({**BOUND, "user": {"username": "alice"}}, "alice is not a ServiceAccount"),
        ({**BOUND, "user": {"username": "system:serviceaccount:ml:worker"}}, "not bound to a pod"),
    ],
)
def test_token_review_refusals(status: dict[str, Any], message: str) -> None:
    reviews = Reviews(status)
    reviewer = TokenReviewer(reviews, "hyperpod-sdc", cache_seconds=30)
    t = jwt()

    async def twice() -> list[Refusal]:
        caught = []
        for _ in range(2):
            with pytest.raises(Refusal, match=message) as one:
                await reviewer.authenticate(t)
            caught.append(one.value)
        return caught

    for refusal in asyncio.run(twice()):
        assert (refusal.status, refusal.reason) == (401, "unauthenticated")
    assert reviews.calls == 1  # the rejection is remembered: no second review


def test_static_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# dev\nsecret-a ml/job-worker-0\n\nsecret-b ml/job-worker-1\n")
    tokens = StaticTokens(str(path))
    assert asyncio.run(tokens.authenticate("secret-b")).pod == "job-worker-1"
    with pytest.raises(Refusal, match="not in the static tokens file"):
        asyncio.run(tokens.authenticate("secret-c"))
    path.write_text("secret-a job-worker-0\n")
    with pytest.raises(ConfigError, match=r"tokens:1: expected '<token> <namespace>/<pod>'"):
        StaticTokens(str(path))


# -- instance ids --------------------------------------------------------------------------


def node(
    name: str, *, provider: str | None = None, cluster: str | None = None, dns: str | None = None
) -> dict[str, Any]:
    labels = {"sagemaker.amazonaws.com/cluster-name": cluster} if cluster else {}
    addresses = [{"type": "InternalDNS", "address": dns}] if dns else []
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"providerID": provider} if provider else {},
        "status": {"addresses": addresses},
    }


def sagemaker_stub() -> tuple[Any, Stubber]:
    sm = boto3.client(
        "sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x"
    )
    return sm, Stubber(sm)


def test_instance_id_from_provider_id_then_name_without_aws() -> None:
    resolver = InstanceResolver(lambda: pytest.fail("no AWS call expected"))
    assert asyncio.run(
        resolver.instance_id(node("n", provider="aws:///us-west-2a/i-0123456789abcdef0"))
    ) == ("i-0123456789abcdef0", "spec.providerID")
    assert asyncio.run(resolver.instance_id(node("hyperpod-i-0123456789abcdef1"))) == (
        "i-0123456789abcdef1",
        "node name",
    )
    found, why = asyncio.run(resolver.instance_id(node("ip-10-0-0-1.ec2.internal")))
    assert found is None and "HYPERPOD_SDC_CLUSTER_NAME" in why


def test_instance_id_from_list_cluster_nodes_by_private_dns_name() -> None:
    sm, stub = sagemaker_stub()
    page = {
        "ClusterNodeSummaries": [
            {
                "InstanceGroupName": "gpu",
                "InstanceId": "i-0aaaaaaaaaaaaaaa1",
                "InstanceType": "ml.p5.48xlarge",
                "LaunchTime": 0,
                "InstanceStatus": {"Status": "Running"},
                "PrivateDnsHostname": "ip-10-0-0-1.us-west-2.compute.internal",
            },
            {
                "InstanceGroupName": "gpu",
                "InstanceId": "i-0aaaaaaaaaaaaaaa2",
                "InstanceType": "ml.p5.48xlarge",
                "LaunchTime": 0,
                "InstanceStatus": {"Status": "Running"},
                "PrivateDnsHostname": "ip-10-0-0-2.us-west-2.compute.internal",
            },
        ]
    }
    stub.add_response("list_cluster_nodes", page, {"ClusterName": "ml-cluster"})
    with stub:
        resolver = InstanceResolver(lambda: sm)
        got = asyncio.run(
            resolver.instance_id(
                node("ip-10-0-0-2.us-west-2.compute.internal", cluster="ml-cluster")
            )
        )
        assert got == ("i-0aaaaaaaaaaaaaaa2", "ListClusterNodes(ml-cluster)")
        # cached: no second call (the stub would fail on one)
        got = asyncio.run(
            resolver.instance_id(
                node("other", cluster="ml-cluster", dns="ip-10-0-0-1.us-west-2.compute.internal")
            )
        )
        assert got == ("i-0aaaaaaaaaaaaaaa1", "ListClusterNodes(ml-cluster)")
        stub.assert_no_pending_responses()


def test_instance_id_lookup_failure_is_reported_not_raised() -> None:
    sm, stub = sagemaker_stub()
    stub.add_client_error("list_cluster_nodes", "ResourceNotFound", "no cluster ml-cluster")
    with stub:
        found, why = asyncio.run(
            InstanceResolver(lambda: sm, cluster_name="ml-cluster").instance_id(node("ip-1"))
        )
    assert found is None and "no cluster ml-cluster" in why


def test_a_remembered_rejection_keeps_no_request_alive() -> None:
    """Every repeat of one rejected token raises a fresh refusal: re-raising the cached one
    would chain each request's frames (its body among their locals) onto one traceback that
    the cache keeps for ``negative_seconds`` (2,000 repeats of a 64 KiB body held 132 MB)."""
    reviewer = TokenReviewer(Reviews({"authenticated": False}), "hyperpod-sdc", cache_seconds=30)
    t = jwt()

    async def request(body: bytes) -> Refusal:
        try:
            await reviewer.authenticate(t)
        except Refusal as refusal:
            return refusal
        raise AssertionError("the token was accepted")

    async def many() -> list[Refusal]:
        return [await request(bytes(1024)) for _ in range(50)]

    refusals = asyncio.run(many())
    assert len({id(r) for r in refusals}) == len(refusals)
    depths = {len(traceback.extract_tb(r.__traceback__)) for r in refusals[1:]}
    assert len(depths) == 1, depths  # a traceback that does not grow with every repeat


def test_the_series_alerts_take_the_increase_of_exist_from_the_start() -> None:
    """A counter whose first sample is already 1 shows Prometheus no increase: the first
    incident after a start (often the only one) would fire no alert."""
    from prometheus_client import generate_latest

    from sdc_operator.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    for series in (
        'hyperpod_sdc_incidents_total{check="replay",classification="rank"} 0.0',
        'hyperpod_sdc_incidents_total{check="nonfinite",classification="collective"} 0.0',
        'hyperpod_sdc_actions_total{action="resume-job",result="Skipped"} 0.0',
        'hyperpod_sdc_confirmations_total{outcome="confirmed"} 0.0',
    ):
        assert series in text, series


def _own_imports(module: Any) -> set[str]:
    import ast

    tree = ast.parse(Path(module.__file__).read_text())
    return {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module
    }


def test_the_rest_client_imports_nothing_of_the_domain() -> None:
    """kube.py is a REST client: of the operator's own modules it may use only the error
    types, the names (constants) and the API server's time format (times, which itself
    imports none of ours); never incidents, nodes or any decision."""
    import sdc_operator.kube
    import sdc_operator.times

    assert _own_imports(sdc_operator.kube) == {"errors", "names", "times"}
    assert _own_imports(sdc_operator.times) == set()


def test_the_watch_pool_has_a_connection_for_every_watch() -> None:
    """20 namespaces: 3 + 4 x 20 = 83 watches, more than the 64 connections the pool used
    to have, so 19 caches stayed stale behind the others. Each watch holds one."""
    from sdc_operator.handlers import Operator
    from sdc_operator.kube import Endpoint

    namespaces = ",".join(f"ml-{i}" for i in range(20))
    settings = OperatorSettings.from_env({"HYPERPOD_SDC_NAMESPACES": namespaces})
    operator = Operator(settings, Endpoint("https://127.0.0.1:1", False))
    watches = len(operator.caches.informers())
    assert watches == 83
    assert operator.watches.pool_size >= watches + 1
