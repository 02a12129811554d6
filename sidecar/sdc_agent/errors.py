"""Every exception the agent raises, under one base class."""

from __future__ import annotations

__all__ = ["ConfigError", "SDCError"]


class SDCError(Exception):
    """Base class of every error raised by ``sdc_agent``."""


class ConfigError(SDCError, ValueError):
    """A setting, keyword argument or environment variable has a bad value.

    The message names the setting (and, for environment variables, the variable) so the
    user can fix it without reading the source.
    """
