"""What the drill-based tests share: one spawn for many scenarios, reading its results, and
the length of their long clean runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sdc_agent.drill import Drill, DrillRank, run_drill

LONG_CLEAN_RUNS_ENV = "HYPERPOD_SDC_LONG_CLEAN_RUNS"
LONG_CLEAN_STEPS = 200
RecordProperty = Callable[[str, object], None]
"""pytest's ``record_property`` fixture."""


def clean_steps(short: int) -> int:
    """How many steps a file's long clean runs train: ``short`` in the suite, and
    :data:`LONG_CLEAN_STEPS` (the 200 that issues 13, 21 and 26 asked the clean runs to
    show) where ``HYPERPOD_SDC_LONG_CLEAN_RUNS=1``, which ``bench/clean_runs.py`` sets to
    run the same tests, with the same assertions, at that length."""
    return LONG_CLEAN_STEPS if os.environ.get(LONG_CLEAN_RUNS_ENV) == "1" else short


def trained(record_property: RecordProperty, scenario: str, r: DrillRank) -> None:
    """A long clean run's length as the ranks report it (one ``applied`` entry per step they
    trained), recorded for ``bench/clean_runs.py`` to read from the JUnit XML
    (``steps_trained:<scenario>``); where ``HYPERPOD_SDC_LONG_CLEAN_RUNS=1`` it must be
    :data:`LONG_CLEAN_STEPS`, asserted against what ran rather than :func:`clean_steps`."""
    record_property(f"steps_trained:{scenario}", len(r.applied))
    if os.environ.get(LONG_CLEAN_RUNS_ENV) == "1":
        assert len(r.applied) == LONG_CLEAN_STEPS, f"{scenario} trained {len(r.applied)} steps"


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
