#!/usr/bin/env bash
# The main demo, end to end on one machine: a real Kubernetes API server, the operator and
# a 6-rank DDP job (CPU, gloo) that opts in with one annotation (the operator's webhook wires
# its pods), with a corrupting GPU on one node: detected, localized,
# contained, resumed from a clean checkpoint, finished with the weights of a clean run; the
# node confirmed by the operator's confirmation pod and replaced (auto-replace-confirmed).
# Extra arguments go to scripts/e2e_demo.py (--keep DIR keeps the logs; --layout hsdp runs the
# job as HSDP, replicate 3 x shard 2, examples/train_fsdp.py: detected, contained, resumed).
#
# The agent alone, without Kubernetes: .venv/bin/python -m sdc_agent.demo
set -euo pipefail
cd "$(dirname "$0")/.."
# test: helm-python-sdk renders the chart's webhook configuration, which the demo registers
scripts/bootstrap.sh agent,operator,test
scripts/kube-apiserver.sh build >/dev/null  # the first time only: about 5.5 minutes, cached
# the project's modules, and any the bootstrap did not compile, compiled once (not in each
# of the demo's processes where the shell sets PYTHONDONTWRITEBYTECODE)
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python scripts/e2e_demo.py "$@"
