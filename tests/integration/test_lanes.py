"""Verdicts first (docs/operator.md, "Who may report"): a burst of heartbeats that arrives
with an audit's verdicts does not delay containment. The real operator, the real API
server, every agent on its own connection with the agent's timeout and back-off
(tests/integration/storm.py).

At the defaults (replay every 50 steps, a heartbeat every 100) every other audit meets
every node's heartbeat. Before: at 2,048 nodes, with elected reporters, containment took
6.0 s with the heartbeats and 0.06 s without (docs/operator.md, "Scale and memory").
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sdc_harness.cluster import Cluster, OperatorProcess

from .storm import Contained, burst, elected, heartbeats, job_of, summary, tokens, verdicts
from .test_scale import STORM_SETTINGS

NODES = 96


def refusals(op: OperatorProcess, reason: str) -> float:
    line = f'hyperpod_sdc_refusals_total{{reason="{reason}"}} '
    found = [ln for ln in op.metrics().splitlines() if ln.startswith(line)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


# timing: containment with and without the burst asserted within 1.5 s (the clean run on this
# machine: about 0.1 s), the burst's heartbeats all delivered within the senders' 120 s
@pytest.mark.timing
@pytest.mark.slow  # 12 to 17 s loaded: 96 nodes and 192 tokens made, two storms
def test_a_heartbeat_burst_does_not_delay_containment(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job, reporting = job_of(cluster, namespace, NODES)
    # a shed heartbeat is told to come back after 1.5-3 s (Retry-After; 5-10 s by default),
    # and its sender waits that long (or its back-off, if longer), as the Reporter does: the
    # burst is delivered about 3 s after the verdicts' quiet (5 s) ends, by 8 s after the
    # release. (With 1-2 s, each sender was shed once more and the back-off's doubling tail
    # ended the burst 12 s after it, in some runs 13.)
    op = start_operator(**STORM_SETTINGS, log_level="WARNING", heartbeat_retry_after_seconds="1.5")
    warm, _ = burst(op.url, heartbeats(job), reporting)  # the reporters' tokens reviewed
    assert summary(warm)["delivered"] == NODES, summary(warm)

    # the clean run: the elected reporters' verdicts alone
    reporters = elected(NODES, 10)
    watcher = Contained(cluster, namespace, step=15)
    senders, released = burst(
        op.url, verdicts(job, reporters, 10, 15), [reporting[i] for i in reporters]
    )
    clean_at = watcher.wait(30)
    assert clean_at is not None, "the clean run was not contained within 30 s"
    clean = clean_at - released
    assert clean < 1.5, f"the clean run was contained {clean:.2f} s after"
    shed_before = refusals(op, "shed")

    # the same with every node's heartbeat, twice, on new tokens (a TokenReview each, as
    # after the kubelet rotated them), released with the verdicts
    reporters = elected(NODES, 50)
    fresh = tokens(cluster, namespace, job.pods) * 2
    beats = heartbeats(job) * 2
    watcher = Contained(cluster, namespace, step=115)
    senders, released = burst(
        op.url,
        verdicts(job, reporters, 50, 115) + beats,
        [reporting[i] for i in reporters] + fresh,
        retry_after=True,
    )
    contained = watcher.wait(30)
    got = summary(senders[: len(reporters)]), summary(senders[len(reporters) :])
    shed = refusals(op, "shed") - shed_before
    print(
        f"\nclean run: contained after {clean:.2f} s; with the burst: after "
        f"{contained and contained - released} s with {len(beats)} "
        f"heartbeats ({shed:.0f} shed); verdicts {got[0]}; heartbeats {got[1]}"
    )
    assert contained is not None, "not contained within 30 s"
    assert contained - released < 1.5, f"contained {contained - released:.2f} s after"
    assert got[0]["first_attempt_outcomes"] == {"202": len(reporters)}, got[0]
    assert shed > 0, "no heartbeat was shed: the burst did not meet the verdicts"
    assert got[1]["delivered"] == len(beats), got[1]  # shed, not lost
