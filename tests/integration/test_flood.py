"""A flood of bogus tokens from 30 addresses does not delay a real incident, and costs the
API server at most one TokenReview per distinct token.

The suite floods for 8 s; bench/operator_flood.py gives the 30 s figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .cluster import Cluster, OperatorProcess, post
from .flood import Flood, bogus_token, token_reviews
from .test_containment import incident_in, make_job, verdict

RATE = 1000.0
SECONDS = 8.0
DISTINCT = 200


def test_a_bogus_token_flood_does_not_delay_containment(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    tokens = [cluster.token(namespace, pod) for pod in job.pods]
    reviews_before = token_reviews(cluster)
    flood = Flood(op.url, RATE, [bogus_token() for _ in range(DISTINCT)])
    flood.start()
    time.sleep(SECONDS / 2)
    from sdc_agent.protocol import encode_report

    for reporter in (0, 2):
        status, answer, _ = post(op.url, encode_report(verdict(job, reporter)), tokens[reporter])
        assert status == 202, answer
    second = time.monotonic()
    incident = incident_in(cluster, namespace, "Contained", timeout=10)
    contained = time.monotonic() - second
    time.sleep(max(0.0, SECONDS / 2 - contained))
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
