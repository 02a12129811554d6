#!/usr/bin/env bash
# Installs what the tests need, then runs lint, types and every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh agent,operator,test,dev
export PYTHONHASHSEED=0
echo "== ruff" && .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy" && .venv/bin/mypy
echo "== pytest" && .venv/bin/python -m pytest "$@"
