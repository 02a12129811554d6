#!/usr/bin/env bash
# The local demo: DDP on 3 emulated nodes (CPU, gloo), a fault injected on one rank,
# and what the agent found. Extra arguments go to `python -m sdc_agent.demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh agent
exec .venv/bin/python -m sdc_agent.demo "$@"
