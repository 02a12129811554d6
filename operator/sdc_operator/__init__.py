"""hyperpod-sdc operator: turns the agent's verdicts into contained incidents.

Never imports torch; of the agent it imports only the torch-free ``sdc_agent.protocol``.
This package is being built (see the operator issue): so far it holds the pure decisions
about nodes and jobs, which the handlers will use.
"""

__all__: list[str] = []
