#!/usr/bin/env bash
# Creates .venv (once) and installs the project with the extras given as arguments,
# pinned by constraints.txt (torch==2.13.0 is the CPU build). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-agent}"
if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-${extras//,/-}"
if [[ ! -f "$stamp" ]]; then
    log=.venv/install.log
    if ! .venv/bin/python -m pip install -c constraints.txt -e ".[${extras}]" >"$log" 2>&1; then
        cat "$log" >&2
        echo "bootstrap: installing .[${extras}] failed (log above, kept in $log)" >&2
        exit 1
    fi
    .venv/bin/python -c "import torch, sdc_agent" # fail here, not in the middle of a test
    touch "$stamp"
fi
