"""Helpers of the drill-based tests: run named scenarios, read what every rank saw."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sdc_agent.drill import Drill, DrillRank, run_drill


def run_scenarios(
    nodes: Sequence[str], scenarios: Mapping[str, Drill]
) -> dict[str, list[DrillRank]]:
    """Every scenario, one after the other in one set of processes: ``{name: [rank]}``."""
    names = list(scenarios)
    out = run_drill(nodes, [scenarios[n] for n in names])
    return dict(zip(names, out, strict=True))


def agreed(ranks: list[DrillRank]) -> DrillRank:
    """The ranks' common view (they decide from the same gathered tables)."""
    for r in ranks[1:]:
        assert r.verdicts == ranks[0].verdicts, "ranks disagree on the verdicts"
        assert r.applied == ranks[0].applied
    return ranks[0]


def accusations(r: DrillRank) -> list[dict[str, Any]]:
    return [v for v in r.verdicts if v["suspect_ranks"]]
