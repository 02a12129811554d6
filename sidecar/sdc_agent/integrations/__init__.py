"""Integrations of the Guard with training frameworks that own the loop.

``sdc_agent.integrations.huggingface``: a ``transformers.TrainerCallback``.
"""

__all__: list[str] = []
