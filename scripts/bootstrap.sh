#!/usr/bin/env bash
# Creates .venv (once) and installs the project with the extras given as arguments,
# pinned by constraints.txt (torch==2.13.0 is the CPU build). Safe to run repeatedly.
#
# Installs with uv where it can (every extra: 34 s to 102 s on a loaded fresh clone, against
# pip's 325 s), with pip's own configuration (scripts/uv_pip.py: the same indexes,
# find-links and constraints), and uv into .venv as well, for tests/chart. uv itself is installed once with
# pip into ${HYPERPOD_SDC_CACHE:-~/.cache/hyperpod-sdc}. Where uv can't be installed or
# can't reproduce pip's configuration, or HYPERPOD_SDC_PIP=1, pip installs, as before.
# Bytecode: without .pyc files, where PYTHONDONTWRITEBYTECODE is set (this machine's shell
# sets it), every process compiles torch's sources again (`import torch` took 7.5 s against
# 3.9 s, loaded), in each of the suite's hundreds of processes. scripts/compile_imports.py
# imports what the demo and the tests import with bytecode written, once: about 3,900 files,
# not every one of the 13,600 installed (uv's --compile-bytecode: 52 s on a loaded fresh clone).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-agent}"
uv_version=0.13.8
if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
stamp=".venv/.installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-${extras//,/-}"
# uv, once per machine (a standalone binary, installed by .venv's pip): echoes its path,
# or nothing where it can't be installed
uv_binary() {
    local dir="${HYPERPOD_SDC_CACHE:-$HOME/.cache/hyperpod-sdc}/uv-$uv_version"
    if [[ ! -x "$dir/bin/uv" ]]; then
        rm -rf "$dir.$$"
        if ! .venv/bin/python -m pip install -q --target "$dir.$$" "uv==$uv_version" >/dev/null 2>&1; then
            rm -rf "$dir.$$"
            return 0
        fi
        mkdir -p "$(dirname "$dir")"
        mv -T "$dir.$$" "$dir" 2>/dev/null || rm -rf "$dir.$$" # another bootstrap's won
    fi
    echo "$dir/bin/uv"
}
if [[ ! -f "$stamp" ]]; then
    log=.venv/install.log
    uv=""
    if [[ "${HYPERPOD_SDC_PIP:-}" != 1 ]]; then
        uv="$(uv_binary)"
    fi
    installed=false
    if [[ -n "$uv" ]]; then
        if .venv/bin/python scripts/uv_pip.py .venv/bin/python "$uv" .venv/bin/python \
            -c constraints.txt -e ".[${extras}]" "uv==$uv_version" \
            >"$log" 2>&1; then
            installed=true
        else
            echo "bootstrap: uv did not install .[${extras}] (log: $log.uv); pip installs" >&2
            mv "$log" "$log.uv"
        fi
    fi
    if ! $installed && ! .venv/bin/python -m pip install -c constraints.txt -e ".[${extras}]" >"$log" 2>&1; then
        cat "$log" >&2
        echo "bootstrap: installing .[${extras}] failed (log above, kept in $log)" >&2
        exit 1
    fi
    # fails here, naming the module, not in the middle of a test
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python scripts/compile_imports.py "$extras"
    touch "$stamp"
fi
