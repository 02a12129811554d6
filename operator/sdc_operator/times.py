"""The API server's times, written and read. Read without ``strptime``: its first call in a
process imports ``_strptime`` and builds its locale tables and patterns, and the first
verdict after a start paid that on the engine's thread on the way to containment (traced
at 2,048 nodes: 20 ms with the load generator at niceness 19, 150 ms with it competing
for the cores).

Both forms are RFC 3339 in UTC as the API server writes them (upper-case ``T`` and ``Z``,
every field zero-padded; lower case is read too, as RFC 3339 allows); anything else is a
``ValueError`` naming the text."""

from __future__ import annotations

import functools
import re
from datetime import datetime, timezone

_DATE_TIME = r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})"
_SECONDS = re.compile(_DATE_TIME + "Z", re.IGNORECASE)
_MICROSECONDS = re.compile(_DATE_TIME + r"\.([0-9]{1,6})Z", re.IGNORECASE)


def now_iso(now: datetime | None = None) -> str:
    """``now`` (default: the current time) in whole seconds: a ``metav1.Time``."""
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(at: datetime | None = None) -> str:
    """``at`` (default: the current time) in microseconds: a ``metav1.MicroTime``."""
    return (at or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@functools.lru_cache(maxsize=4096)
def parse_time(at: str) -> datetime:
    """``at`` in whole seconds (``2026-12-06T19:00:07Z``: a ``metav1.Time``, and what the
    operator writes into its records) as an aware datetime. Remembered: every verdict of a
    storm parses the same few times (its pod's creation, the incident's stop; strptime cost
    2.6 s of a profiled 2,048-node storm)."""
    return _datetime(at, _SECONDS, "whole seconds (YYYY-MM-DDTHH:MM:SSZ)")


def parse_micro_time(at: str) -> datetime:
    """``at`` with a fraction of a second (``2026-12-06T19:00:07.123456Z``: a
    ``metav1.MicroTime``, such as a Lease's ``renewTime``) as an aware datetime."""
    return _datetime(at, _MICROSECONDS, "microseconds (YYYY-MM-DDTHH:MM:SS.ffffffZ)")


def _datetime(at: str, form: re.Pattern[str], what: str) -> datetime:
    match = form.fullmatch(at)
    if match is None:
        raise ValueError(f"time {at!r} is not RFC 3339 in {what}, UTC")
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    micro = int(match.group(7).ljust(6, "0")) if form.groups > 6 else 0
    try:
        return datetime(year, month, day, hour, minute, second, micro, tzinfo=timezone.utc)
    except ValueError as exc:  # a month 13, a February 30th
        raise ValueError(f"time {at!r}: {exc}") from None
