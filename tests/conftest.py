"""Tiers: every test is marked with its folder (unit, operator, chart, distributed,
integration, e2e), so a tier is a marker expression (see scripts/test.sh --fast)."""

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
