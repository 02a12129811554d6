"""Every exception the operator raises, under one base class."""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError", "ConfigError", "OperatorError", "Refusal"]


class OperatorError(Exception):
    """Base class of every error raised by ``sdc_operator``."""


class ConfigError(OperatorError, ValueError):
    """A setting has a bad value; the message names the environment variable."""


class Refusal(OperatorError):
    """A report the intake will not accept: answered with ``status`` (a 4xx) and counted
    under ``reason`` in ``hyperpod_sdc_refusals_total``. Nothing in the cluster changes."""

    def __init__(
        self, status: int, reason: str, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after

    def again(self) -> Refusal:
        """A fresh copy to raise once more. Raising one stored exception again and again
        (a cached refusal) would chain every raise's frames, and the request bodies they
        hold, onto its traceback."""
        return Refusal(self.status, self.reason, self.message, retry_after=self.retry_after)


class ApiError(OperatorError):
    """The Kubernetes API server answered ``status`` (>= 400), or could not be reached
    (``status`` 0). ``body`` is its ``Status`` object where it sent one."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body or {}

    @property
    def reason(self) -> str:
        return str(self.body.get("reason") or "")
