#!/usr/bin/env bash
# Installs what the tests need, then runs lint, types and every test: the full suite, what
# CI runs (.ci/run) and what to run before landing a change.
#
#   scripts/test.sh --fast [PYTEST ARGS]
#
# is the tier to run between changes, under 3 minutes on 2 cores: lint (no mypy) and the
# tests marked by FAST_TIER below: unit, operator and chart tests that are not slow, the
# three-rank world of tests/distributed/test_checks.py (every short fault scenario and the
# bit-identity check against plain DDP) and the eight integration tests marked fast.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=false
if [[ "${1:-}" == "--fast" ]]; then
    fast=true
    shift
fi
scripts/bootstrap.sh agent,operator,test,dev
export PYTHONHASHSEED=0
# One command per line: under `set -e` a failure inside an `a && b` list does not stop
# the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if ! $fast; then
    echo "== mypy"
    .venv/bin/mypy
fi
# The operator's integration tests need a real API server: built once (about 5 minutes on
# 2 cores) and cached under ~/.cache/hyperpod-sdc.
echo "== kube-apiserver"
scripts/kube-apiserver.sh build
# The chart's alert rules are checked with promtool, from Debian's prometheus package (cached).
echo "== promtool"
scripts/promtool.sh >/dev/null || echo "promtool unavailable: tests/chart/test_dashboard.py says why"
echo "== pytest"
if $fast; then
    # Markers: pyproject.toml; tests/conftest.py marks every test with its folder.
    FAST_TIER="(unit or operator or chart or fast) and not slow"
    exec .venv/bin/python -m pytest -m "$FAST_TIER" "$@"
fi
.venv/bin/python -m pytest "$@"
