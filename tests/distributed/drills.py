"""What the drill-based tests share: one spawn for many scenarios, and reading its results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sdc_agent.drill import Drill, DrillRank, run_drill


def run_scenarios(
    nodes: Sequence[str], scenarios: Mapping[str, Drill]
) -> dict[str, list[DrillRank]]:
    """Every scenario in one spawn of ``len(nodes)`` ranks, by name."""
    names = list(scenarios)
    out = run_drill(list(nodes), [scenarios[n] for n in names])
    return dict(zip(names, out, strict=True))


def agreed(ranks: list[DrillRank]) -> DrillRank:
    """Rank 0's result, after checking every rank reached the same verdicts and steps."""
    for r in ranks[1:]:
        assert r.verdicts == ranks[0].verdicts, "ranks disagree on the verdicts"
        assert r.applied == ranks[0].applied, "ranks disagree on which steps were applied"
    return ranks[0]


def accusations(r: DrillRank) -> list[dict[str, Any]]:
    """The verdicts that name a suspect."""
    return [v for v in r.verdicts if v["suspect_ranks"]]
