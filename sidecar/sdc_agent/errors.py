"""Every exception the agent raises, under one base class (:class:`SDCError`, which it
shares with the torch-free ``sdc_common``, where it and :class:`ProtocolError` live)."""

from __future__ import annotations

from sdc_common.errors import ProtocolError, SDCError

__all__ = [
    "BundleError",
    "CheckpointNotFoundError",
    "ConfigError",
    "OperatorUnreachableError",
    "ProtocolError",
    "SDCError",
]


class ConfigError(SDCError, ValueError):
    """A setting, keyword argument or environment variable has a bad value.

    The message names the setting (and, for environment variables, the variable) so the
    user can fix it without reading the source.
    """


class OperatorUnreachableError(SDCError):
    """A verdict could not be delivered to the operator in time and the local policy
    (``unreachable_policy="stop"``) stops training rather than go on unobserved."""


class CheckpointNotFoundError(SDCError):
    """No usable checkpoint at or before the requested step."""


class BundleError(SDCError, ValueError):
    """An evidence bundle is missing, incomplete or damaged. ``field`` names what is wrong
    (``bundle.json``, ``files.weights.pt.sha256``, ``reference.loss_bits`` ...)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
