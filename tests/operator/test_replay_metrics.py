"""The replay audit's thresholds per kind of evidence, from heartbeats to gauges: which
kind watches, its noise against the cap, which kinds are blind."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from sdc_common.protocol import HeartbeatReport, ReplayKind, ReporterIdentity
from sdc_operator.heartbeats import Heartbeats
from sdc_operator.incidents import JobRef
from sdc_operator.metrics import Metrics

JOB = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "train", "u1")


def beat(node: int, *kinds: ReplayKind) -> HeartbeatReport:
    return HeartbeatReport(
        ReporterIdentity(node * 2, f"n{node}", f"p{node}"),
        1000.0,
        120,
        100,
        replay_dtype="bfloat16",
        replay_cap=2**-7,
        replay_kinds=kinds,
    )


def samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("hyperpod_sdc_replay_"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'(job="train"|namespace="ml"),?', "", name).replace(",}", "}")
            out[name] = float(value)
    return out


def test_each_kind_shows_its_threshold_and_noise_and_a_blind_kind_loses_its_threshold() -> None:
    now = [1000.0]
    metrics = Metrics()
    beats = Heartbeats(metrics, clock=lambda: now[0])
    loss = ReplayKind("loss", 0.0, 0.0)
    beats.observe(JOB, "n0", beat(0, loss, ReplayKind("gradients:3", 1e-3, 5e-4)))
    beats.observe(JOB, "n1", beat(1, loss, ReplayKind("gradients:3", 2e-3, 1e-3)))
    beats.refresh(window=600)
    got = samples(metrics)
    assert got['hyperpod_sdc_replay_threshold{kind="gradients:3"}'] == 2e-3
    assert got['hyperpod_sdc_replay_noise{kind="gradients:3"}'] == 1e-3
    assert got['hyperpod_sdc_replay_threshold{kind="loss"}'] == 0.0
    assert got['hyperpod_sdc_replay_blind{kind="gradients:3"}'] == 0.0
    assert got["hyperpod_sdc_replay_noise_cap{}"] == 2**-7
    # node n1's layer 3 went blind: the kind is blind for the job, the loss still watches
    beats.observe(JOB, "n1", beat(1, loss, ReplayKind("gradients:3", None, 6.7e-3, True)))
    beats.refresh(window=600)
    got = samples(metrics)
    assert 'hyperpod_sdc_replay_threshold{kind="gradients:3"}' not in got
    assert got['hyperpod_sdc_replay_blind{kind="gradients:3"}'] == 1.0
    assert got['hyperpod_sdc_replay_noise{kind="gradients:3"}'] == 6.7e-3
    assert got['hyperpod_sdc_replay_threshold{kind="loss"}'] == 0.0
    # the job stops: its series go
    beats.prune(lambda _: False)
    assert samples(metrics) == {}
