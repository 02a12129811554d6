"""hyperpod-sdc operator: turns the agent's verdicts into contained incidents, restarts the
job from a clean checkpoint, and remediates the node after review (docs/operator.md).

Run it with ``python -m sdc_operator``. Never imports torch; of the agent it imports only the
torch-free ``sdc_agent.protocol`` (and its errors). The pure decisions live in
``incidents``, ``jobs`` and ``nodes``; ``engine``, ``intake`` and ``handlers`` talk to
Kubernetes and AWS.
"""

__all__: list[str] = []
