"""A flood of bogus tokens from 30 addresses does not delay a real incident, and costs the
API server at most one TokenReview per distinct token.

The suite floods for 4 s; bench/operator_flood.py gives the 30 s figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from sdc_harness.cluster import Cluster, OperatorProcess, post, wait_for

from .flood import Flood, bogus_token, token_reviews
from .test_containment import incident_in, make_job, verdict

RATE = 1000.0
SECONDS = 4.0
DISTINCT = 200


# timing: containment under the flood asserted < 2 s after the second report (about 0.3 s unloaded)
@pytest.mark.timing
def test_a_bogus_token_flood_does_not_delay_containment(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    tokens = [cluster.token(namespace, pod) for pod in job.pods]
    reviews_before = token_reviews(cluster)
    flood = Flood(op.url, RATE, [bogus_token() for _ in range(DISTINCT)])
    flood.start()
    # each bogus token answered twice on average (their reviews made): the flood at its full
    # cost before the reports, not after a fixed time
    wait_for("the flood under way", lambda: flood.answered() >= 2 * DISTINCT or None, 30)
    from sdc_agent.protocol import encode_report

    for reporter in (0, 2):
        status, answer, _ = post(op.url, encode_report(verdict(job, reporter)), tokens[reporter])
        assert status == 202, answer
    second = time.monotonic()
    incident = incident_in(cluster, namespace, "Contained", timeout=10)
    contained = time.monotonic() - second
    # the flood goes on for SECONDS in all: the review cache holds over it
    time.sleep(max(0.0, flood.started + SECONDS - time.monotonic()))
    got = flood.stop()
    reviews = token_reviews(cluster) - reviews_before
    print(f"flood {got}; contained {contained:.2f} s after the second report; {reviews} reviews")
    assert got["rate_achieved"] > 0.5 * RATE, got  # the machine could drive the flood
    assert set(got["answers"]) <= {"401", "429"}, got
    assert contained < 2.0, f"contained {contained:.2f} s after the second report"
    # one review per distinct bogus token at most, plus the two real tokens
    assert reviews <= DISTINCT + 2, reviews
    assert incident["status"]["node"] == job.node_name(1)
    log = op.log()
    assert " ERROR " not in log and "Traceback" not in log


# timing: containment asserted < 2 s after the second report (about 0.3 s unloaded)
@pytest.mark.timing
def test_new_bogus_tokens_from_a_few_sources_leave_the_review_budget_to_new_agents(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Every request of the flood carries a token never seen before, from 12 addresses:
    each address may cause a few reviews a second, so the flood cannot spend the shared
    budget (before: 12 addresses drained it, and a never-seen real agent waited up to
    24.7 s). The job's agents, never seen before either, are answered at once and the
    incident is contained within 2 s of the second verdict."""
    from sdc_agent.protocol import encode_report

    job = make_job(cluster, namespace)
    # a budget the flood could spend in well under a second without the per-source limit
    op = start_operator(token_review_burst="200")
    tokens = [cluster.token(namespace, pod) for pod in job.pods]
    flood = Flood(op.url, 1500.0, [bogus_token() for _ in range(40_000)], sources=12)
    flood.start()
    # the flood limited (its addresses past their few reviews a second), then a second more
    # of it: 1,500 new tokens, the 200-review budget spent seven times over without the
    # per-source limit
    wait_for("a 429 to the flood", lambda: flood.statuses["429"] or None, 30)
    time.sleep(1.0)
    answers = []
    for reporter in (0, 2):
        answers.append(post(op.url, encode_report(verdict(job, reporter)), tokens[reporter]))
    second = time.monotonic()
    incident_in(cluster, namespace, "Contained", timeout=10)
    contained = time.monotonic() - second
    got = flood.stop()
    print(f"flood {got}; contained {contained:.2f} s after the second report")
    # the machine drove the flood past twice the shared budget's refill (200 reviews a
    # second, the default): without the per-source limit it would have spent the
    # 200-review burst within the second before the agents report. (Not its 1,500 a
    # second: with the other core busy the flood and the operator share one, and the flood
    # sends only as fast as it is answered; 430-510 a second in loaded repeats.)
    assert got["rate_achieved"] > 2 * 200.0, got
    assert "429" in got["answers"], got  # the flood was limited ...
    # ... and the agents were not: their first try was accepted
    assert [a[0] for a in answers] == [202, 202], answers
    assert contained < 2.0, f"contained {contained:.2f} s after the second report"
    log = op.log()
    assert " ERROR " not in log and "Traceback" not in log
