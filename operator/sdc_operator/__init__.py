"""hyperpod-sdc operator: turns the agent's verdicts into contained incidents, restarts the
job from a clean checkpoint, and remediates the node after review (docs/operator.md).

Run it with ``python -m sdc_operator``. Never imports torch, nor the agent: what both sides
need (the wire protocol, environment names, labels, exit codes) is the torch-free
``sdc_common``. The pure decisions live in
``incidents``, ``jobs`` and ``nodes``; ``engine``, ``intake`` and ``handlers`` talk to
Kubernetes and AWS.
"""

__all__: list[str] = []
