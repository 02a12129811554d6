"""Verdicts and heartbeats reach a real HTTP server; the local policy when they cannot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from sdc_agent.drill import Drill, run_drill
from sdc_agent.faults import FaultSpec
from sdc_agent.launch import free_port
from sdc_agent.protocol import HeartbeatReport, VerdictReport
from tests.unit.test_reporter import Operator

# slow: six-rank worlds reporting to a loopback operator (20 s to 80 s each on 2 cores)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
FAULT = FaultSpec(
    rank=3, step=4, site="forward", kind="relative", persistent=True, target="3", index=None
)
CONFIG = {"replay_every": 1, "weights_every": 1, "fingerprint_backend": "eager"}


def test_each_node_reports_the_verdict_with_the_suspects_identity(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-service-account-token")
    port = free_port()
    operator = Operator(port)
    env = {
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{port}",
        "HYPERPOD_SDC_TOKEN_FILE": str(token),
        "HYPERPOD_SDC_HEARTBEAT_EVERY": "2",
    }
    try:
        (ranks,) = run_drill(NODES, [Drill(steps=5, faults=(FAULT,), config=CONFIG)], env=env)
    finally:
        operator.stop()
    verdicts = [r for _, r in operator.received if isinstance(r, VerdictReport)]
    # Steps 4 and 5 fail the audit; every node's first rank reports each, nobody else.
    assert Counter((v.step, v.reporter.node) for v in verdicts) == {
        (s, n): 1 for s in (4, 5) for n in ("n0", "n1", "n2")
    }
    assert {v.reporter.rank for v in verdicts} == {0, 2, 4}
    first = verdicts[0]
    assert (first.check, first.classification, first.last_clean_step) == ("replay", "rank", 3)
    (suspect,) = first.suspects
    assert (suspect.rank, suspect.node, suspect.local_rank, suspect.pod) == (3, "n1", 1, "pod-n1")
    heartbeats = [r for _, r in operator.received if isinstance(r, HeartbeatReport)]
    assert sorted((h.step, h.reporter.rank) for h in heartbeats) == [
        (s, r) for s in (2, 4) for r in (0, 2, 4)
    ]
    assert all(h.check_seconds["replay"] > 0 for h in heartbeats)
    assert all(
        headers["Authorization"] == "Bearer a-service-account-token"
        for headers, _ in operator.received
    )
    assert ranks[0].stopped is None


def test_an_unreachable_operator_stops_training_on_every_rank() -> None:
    env = {
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",  # nobody listens
        "HYPERPOD_SDC_TOKEN_FILE": "",
        "HYPERPOD_SDC_REPORT_DEADLINE_SECONDS": "0.5",
    }
    (ranks,) = run_drill(NODES, [Drill(steps=400, faults=(FAULT,), config=CONFIG)], env=env)
    stops = {r.stopped.split(":")[0] if r.stopped else None for r in ranks}
    assert len(stops) == 1, "every rank must stop at the same step"
    (where,) = stops
    assert where is not None, "training went on although no verdict was delivered"
    stopped_at = int(where.split()[1])
    assert 4 < stopped_at < 400
    assert "could not be delivered" in (ranks[0].stopped or "")
    # Nothing was applied after the fault: every audited step failed.
    assert not any(ranks[0].applied[3:])


def test_continue_policy_trains_on() -> None:
    env = {
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",
        "HYPERPOD_SDC_TOKEN_FILE": "",
        "HYPERPOD_SDC_REPORT_DEADLINE_SECONDS": "0.1",
        "HYPERPOD_SDC_UNREACHABLE_POLICY": "continue",
    }
    (ranks,) = run_drill(NODES[:3], [Drill(steps=30, config=CONFIG)], env=env)
    assert all(r.stopped is None for r in ranks)
    assert len(ranks[0].applied) == 30


def _restore_and_mark(rank: int, world: int, root: str) -> tuple[bool, bool]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import Guard, GuardConfig

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 2))
    guard = Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=GuardConfig(fingerprint_backend="eager"),
    )
    guard.restore(20, location=f"{root}/step_20.pt")
    results = (False, False)
    if rank == 0:
        for step in (20, 21):
            (Path(root) / f"step_{step}.pt").write_bytes(b"weights")
        results = (
            guard.mark_checkpoint(Path(root) / "step_20.pt"),  # the current step
            guard.mark_checkpoint(Path(root) / "step_21.pt", 21),
        )
    guard.close()
    return results


def test_restore_and_mark_checkpoint_tell_the_operator(tmp_path: Path) -> None:
    from sdc_agent.launch import spawn_local
    from sdc_agent.protocol import CheckpointReport, ResumeReport

    port = free_port()
    operator = Operator(port)
    try:
        results = spawn_local(
            _restore_and_mark,
            ["n0", "n0", "n1"],
            (str(tmp_path),),
            env={
                "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{port}",
                "HYPERPOD_SDC_TOKEN_FILE": "",
            },
        )
    finally:
        operator.stop()
    assert results[0] == (True, False)  # step 20 is the restored, trusted step; 21 is not yet
    resumes = sorted(
        (r.reporter.node, r.step, r.location)
        for _, r in operator.received
        if isinstance(r, ResumeReport)
    )
    assert resumes == [("n0", 20, f"{tmp_path}/step_20.pt"), ("n1", 20, f"{tmp_path}/step_20.pt")]
    checkpoints = sorted(
        (r.step, r.verified) for _, r in operator.received if isinstance(r, CheckpointReport)
    )
    assert checkpoints == [(20, True), (21, False)]
    assert (tmp_path / "step_20.pt.sdc.json").exists()


def test_three_elected_nodes_report_a_verdict_and_every_node_its_heartbeat() -> None:
    port = free_port()
    operator = Operator(port)
    env = {
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{port}",
        "HYPERPOD_SDC_TOKEN_FILE": "",
        "HYPERPOD_SDC_HEARTBEAT_EVERY": "2",
    }
    nodes = ["n0", "n1", "n2", "n3"]
    fault = FaultSpec(
        rank=2, step=2, site="forward", kind="relative", persistent=True, target="3", index=None
    )
    try:
        run_drill(nodes, [Drill(steps=2, faults=(fault,), config=CONFIG)], env=env)
    finally:
        operator.stop()
    verdicts = [r for _, r in operator.received if isinstance(r, VerdictReport)]
    # Rank 2 (n2) was replayed by rank 3 (n3) and replayed rank 1 (n1): those first, then
    # n0; never n2 itself.
    assert sorted(v.reporter.node for v in verdicts) == ["n0", "n1", "n3"]
    heartbeats = [r for _, r in operator.received if isinstance(r, HeartbeatReport)]
    assert sorted(h.reporter.node for h in heartbeats) == nodes
    run_ids = {
        r.run_id for _, r in operator.received if isinstance(r, VerdictReport | HeartbeatReport)
    }
    assert len(run_ids) == 1 and None not in run_ids
    beat = heartbeats[0]
    assert beat.fingerprint_kernel == "eager"
    assert beat.bit_reproducible is True and beat.gradient_tolerance == 0.0
    # per kind: the loss first, every kind compared bit for bit, none blind, fp32's cap
    assert beat.replay_kinds[0].kind == "loss" and len(beat.replay_kinds) > 2
    assert {(k.threshold, k.noise, k.blind) for k in beat.replay_kinds} == {(0.0, 0.0, False)}
    assert beat.replay_dtype == "float32" and beat.replay_cap is not None
    assert beat.interval_seconds is not None and beat.interval_seconds > 0
    assert all(v.corroborated is True and v.transient is False for v in verdicts)
