"""Tiers: every test is marked with its folder (unit, operator, chart, distributed,
integration, e2e), so a tier is a marker expression (see scripts/test.sh --fast); and with
its xdist group (below)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "operator", "chart", "distributed", "integration", "e2e")
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(HERE).parts[0]
        except ValueError:  # not under tests/
            continue
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))
        # Under --dist loadgroup (scripts/test.sh --fast) a file's tests stay in one process,
        # as under --dist loadfile, and the integration tests all in one, sharing its API
        # server; other --dist modes ignore the mark.
        group = "integration" if folder == "integration" else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))
