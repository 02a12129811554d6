#!/usr/bin/env bash
# Installs what the tests need, then runs lint, types and every test: the full suite, what
# CI runs (.ci/run) and what to run before landing a change.
#
#   scripts/test.sh --fast [PYTEST ARGS]
#
# is the tier to run between changes, under 3 minutes on 2 cores: lint (no mypy) and the
# tests selected by the --fast branch below: unit, operator and chart tests that are not slow, the
# three-rank world of tests/distributed/test_checks.py (every short fault scenario and the
# bit-identity check against plain DDP) and the eight integration tests marked fast.
# Extra arguments go to pytest; with any, the full suite is one pass of exactly them.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=false
if [[ "${1:-}" == "--fast" ]]; then
    fast=true
    shift
fi
scripts/bootstrap.sh agent,operator,test,dev
export PYTHONHASHSEED=0
# The project's own modules compiled once, not in each of the suite's processes (a shell
# that sets PYTHONDONTWRITEBYTECODE, as this machine's does, has every process compile them
# again; __pycache__ is ignored by git).
unset PYTHONDONTWRITEBYTECODE
# One command per line: under `set -e` a failure inside an `a && b` list does not stop
# the script.
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if ! $fast && [[ $# -gt 0 ]]; then
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
# Test processes (pytest-xdist): most of the suite waits (process start-ups, the operator's
# resyncs), so more processes than cores pay. Each process has its own API server, ports and
# temporary directories; a file's tests stay in one process (--dist loadfile: the
# module-scoped worlds and operators are built once). Files are handed out in the order
# tests/conftest.py sorts them, the files with a slow test first (--no-loadscope-reorder:
# xdist's own order, most tests first, left the long files of few tests to the end).
workers="${HYPERPOD_SDC_TEST_WORKERS:-4}"
# Two passes: the tests selected by the marker expression $1 (empty: all) that are not
# marked timing, spread over the processes; then those marked timing (deadlines, lease
# renewals, probabilistic detection) one at a time, so that their stated margins hold on a
# machine no other test loads.
two_passes() {
    local selected="${1:+($1) and }" status=0
    shift
    .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder \
        -m "${selected}not timing" "$@" \
        || status=$?
    # mypy runs beside the timing tests (about a minute of one core): they wait more than
    # they compute, and keep their margins with the other core busy (what
    # scripts/loaded_repeats.py checks).
    local types
    types="$(mktemp)"
    .venv/bin/mypy >"$types" 2>&1 &
    local mypy_pid=$!
    echo "== pytest: the timing tests, one at a time (mypy beside them)"
    .venv/bin/python -m pytest -m "${selected}timing" "$@" || status=$?
    echo "== mypy"
    wait "$mypy_pid" || status=$?
    cat "$types"
    rm -f "$types"
    return "$status"
}
if $fast; then
    # Markers: pyproject.toml; tests/conftest.py marks every test with its folder, and
    # with an xdist group: a file's tests in one process, and the eight integration tests
    # all in one, sharing one API server.
    .venv/bin/python -m pytest -n "${HYPERPOD_SDC_TEST_WORKERS:-2}" --dist loadgroup \
        -m "(unit or operator or chart or fast) and not slow" "$@"
elif [[ $# -gt 0 ]]; then
    # A selection of the caller's: one pass, as given (add -n N to spread it).
    .venv/bin/python -m pytest "$@"
else
    two_passes ""
fi
