"""The errors of the shared half (re-exported by ``sdc_agent.errors``)."""

from __future__ import annotations

__all__ = ["ProtocolError", "SDCError"]


class SDCError(Exception):
    """Base class of every error raised by ``sdc_agent`` and ``sdc_common``."""


class ProtocolError(SDCError, ValueError):
    """A report does not follow the wire protocol. ``field`` is its dotted path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
