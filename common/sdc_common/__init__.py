"""hyperpod-sdc's shared, torch-free half: what the agent and the operator both need.

- :mod:`sdc_common.protocol`: the wire protocol (reports, their parser and JSON Schema);
- :mod:`sdc_common.names`: environment variable names, the API group, labels, taints and
  annotations users see, and the confirmation's exit codes;
- :mod:`sdc_common.errors`: :class:`~sdc_common.errors.ProtocolError` and its base.

It imports nothing beyond the standard library: the operator's image has no torch, and the
agent's training image need not have kopf or kubernetes. ``sdc_agent`` and
``sdc_operator`` never import each other; both import this (a test keeps it so).
"""

__all__: list[str] = []
