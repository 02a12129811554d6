"""Tiers: every test is marked with its folder (unit, operator, chart, distributed,
integration, e2e), so a tier is a marker expression (see scripts/test.sh --fast); and with
its xdist group (below). Files with a slow test come first (below)."""

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
    # The full suite's parallel pass (scripts/test.sh: --dist loadfile --no-loadscope-reorder)
    # hands whole files to its processes in this order: the files with a slow test first, so
    # that none of them starts last and runs on alone while the other processes are done
    # (xdist's default order, by number of tests, started the e2e demo's two tests last).
    # A stable sort: the other files, and each file's tests, keep their order.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
