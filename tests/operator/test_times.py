"""The API server's times read without strptime: the same datetimes strptime gave for what
the API server and the operator write, a ValueError naming the text for anything else, and
``_strptime`` never loaded by the operator's verdict path."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from sdc_operator.times import micro_time, now_iso, parse_micro_time, parse_time


@pytest.mark.parametrize("at", ["2026-12-06T19:00:07Z", "2000-02-29T23:59:59Z"])
def test_a_time_parses_as_strptime_read_it(at: str) -> None:
    expected = datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert parse_time(at) == expected
    assert parse_time(at.lower()) == expected  # RFC 3339 allows t and z
    assert now_iso(expected) == at


@pytest.mark.parametrize(
    "at", ["2026-12-06T19:00:07.123456Z", "2026-12-06T19:00:07.5Z", "2026-12-06T19:00:07.000000Z"]
)
def test_a_micro_time_parses_as_strptime_read_it(at: str) -> None:
    expected = datetime.strptime(at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    assert parse_micro_time(at) == expected


@pytest.mark.parametrize(
    "at",
    ["None", "", "2026-12-06T19:00:07", "2026-12-06T19:00:07.5Z", "2026-12-06 19:00:07Z",
     "2026-13-06T19:00:07Z", "2026-02-30T19:00:07Z", "2026-1-06T19:00:07Z",
     "2026-12-06T19:00:07+00:00", "٢٠٢٦-12-06T19:00:07Z"],
)  # fmt: skip
def test_anything_but_rfc3339_seconds_utc_is_a_value_error(at: str) -> None:
    with pytest.raises(ValueError, match=r"^time '"):
        parse_time(at)


@pytest.mark.parametrize(
    "at", ["2026-12-06T19:00:07Z", "2026-12-06T19:00:07.1234567Z", "2026-12-06T19:00:07.Z"]
)
def test_a_micro_time_needs_one_to_six_digits_of_fraction(at: str) -> None:
    with pytest.raises(ValueError, match=r"^time '"):
        parse_micro_time(at)


def test_no_operator_module_calls_strptime() -> None:
    """What the import check below cannot see: a ``strptime`` called only on a path it does
    not run (the election's ``peers()`` with two replicas, the confirmation's times)."""
    import sdc_operator

    package = Path(sdc_operator.__file__).parent
    calling = [path.name for path in package.glob("*.py") if "strptime(" in path.read_text()]
    assert calling == [], f"strptime called in {calling}: read times with sdc_operator.times"


def test_a_written_time_reads_back() -> None:
    at = datetime(2026, 12, 6, 19, 0, 7, 123456, tzinfo=timezone.utc)
    assert parse_time(now_iso(at)) == at.replace(microsecond=0)
    assert parse_micro_time(micro_time(at)) == at


def test_the_operator_leaves_strptime_unloaded() -> None:
    """The first verdict after a start parses its pod's creation time: with ``strptime``
    that imported ``_strptime`` and built its tables on the engine's thread, on the way to
    containment. Nothing the intake, the engine or the election import loads it."""
    code = (
        "import sys; from sdc_operator import engine, handlers, leader, confirmation; "
        "from sdc_operator.times import parse_time, parse_micro_time; "
        "parse_time('2026-12-06T19:00:07Z'); parse_micro_time('2026-12-06T19:00:07.5Z'); "
        "print('_strptime' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
