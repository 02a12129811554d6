"""What a Guard's verdict reports say about the verified snapshot (``snapshot_step``)."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_agent import GuardConfig
from sdc_agent.protocol import ReporterIdentity, VerdictReport, encode_report, parse_report
from sdc_agent.reporting import CHECKS, HEARTBEAT_HOLD_AFTER_VERDICT_SECONDS, GuardReporting
from sdc_agent.topology import Topology
from sdc_agent.verdict import Verdict


class Submitted:
    """Stands in for the Reporter thread: what was submitted."""

    def __init__(self) -> None:
        self.reports: list[Any] = []
        self.holds: list[float] = []

    def submit(self, report: Any) -> None:
        self.reports.append(report)

    def hold_heartbeats(self, seconds: float) -> None:
        self.holds.append(seconds)


def reporting() -> tuple[GuardReporting, Submitted]:
    # Built without __init__ (a collective); the fields step_done reads, as it sets them.
    out = GuardReporting.__new__(GuardReporting)
    topology = Topology.from_nodes(["a", "b", "c"])
    sink = Submitted()
    out.config = GuardConfig(heartbeat_every=0, verdict_reporters=0)
    out.topology = topology
    out.run_id = "run-1"
    out._replayer_of = {0: 2, 1: 0, 2: 1}
    out._me = "a"
    out.reports = True
    out.reporter = sink  # type: ignore[assignment]
    out.identity = ReporterIdentity(rank=0, node="a", pod="p-a")
    out.check_seconds = dict.fromkeys(CHECKS, 0.0)
    out._heartbeat_at = 0.0
    return out, sink


def verdict(**kw: Any) -> Verdict:
    fields: dict[str, Any] = {
        "check": "replay",
        "step": 12,
        "classification": "rank",
        "suspect_ranks": (1,),
        "suspect_nodes": ("b",),
        "localized": True,
        "last_clean_step": 8,
        "message": "rank(s) 1 computed wrong results",
        "transient": False,
        "corroborated": True,
    }
    fields.update(kw)
    return Verdict(**fields)


@pytest.mark.parametrize(
    ("v", "snapshot", "said"),
    [
        (verdict(), 8, 8),  # a persistent hardware verdict: the ranks write step 8
        (verdict(), 4, 4),  # the host copy may be older than the last clean step
        (verdict(), None, None),  # snapshots off
        (verdict(transient=True), 8, None),  # held, not applied: nothing written
        (verdict(classification="training", suspect_ranks=()), 8, None),
        (verdict(last_clean_step=6), 8, None),  # never a step past the verdict's window
    ],
)
def test_the_verdict_names_the_snapshot_the_ranks_write(
    v: Verdict, snapshot: int | None, said: int | None
) -> None:
    out, sink = reporting()
    out.step_done(
        12,
        [v],
        last_clean_step=8,
        fingerprint_kernel="eager",
        gradient_tolerance=None,
        bit_reproducible=None,
        snapshot_step=snapshot,
    )
    (report,) = sink.reports
    assert isinstance(report, VerdictReport)
    assert report.snapshot_step == said
    read = parse_report(encode_report(report))  # what the operator reads
    assert isinstance(read, VerdictReport) and read.snapshot_step == said


def test_a_step_with_a_verdict_holds_the_nodes_heartbeat_back_a_clean_step_does_not() -> None:
    """Every node sees the step's verdict, elected reporter or not: its heartbeat keeps
    away from the verdicts (held past the operator's 5 s of shedding)."""
    out, sink = reporting()
    out.config = GuardConfig(heartbeat_every=4, verdict_reporters=0)
    out._me = "c"  # not a reporter of this verdict when elected; here every node reports
    common: dict[str, Any] = {
        "last_clean_step": 8,
        "fingerprint_kernel": "eager",
        "gradient_tolerance": None,
        "bit_reproducible": None,
    }
    out.step_done(8, [], **common)
    assert sink.holds == [] and [r.kind for r in sink.reports] == ["heartbeat"]
    out.step_done(12, [verdict()], **common)
    assert sink.holds == [HEARTBEAT_HOLD_AFTER_VERDICT_SECONDS] > [5.0]
    assert [r.kind for r in sink.reports] == ["heartbeat", "verdict", "heartbeat"]
