#!/usr/bin/env bash
# Installs what the tests need, then runs lint, types and every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh agent,operator,test,dev
export PYTHONHASHSEED=0
# One command per line: under `set -e` a failure inside an `a && b` list does not stop
# the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
# The operator's integration tests need a real API server: built once (about 5 minutes on
# 2 cores) and cached under ~/.cache/hyperpod-sdc.
echo "== kube-apiserver"
scripts/kube-apiserver.sh build
# The chart's alert rules are checked with promtool, from Debian's prometheus package (cached).
echo "== promtool"
scripts/promtool.sh >/dev/null || echo "promtool unavailable: tests/chart/test_dashboard.py says why"
echo "== pytest"
.venv/bin/python -m pytest "$@"
