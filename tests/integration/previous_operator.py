"""``python -m tests.integration.previous_operator``: this release's operator with the intake
check of the release before protocol version 2 (tests/previous_protocol.py): it accepts
what that release accepted, refuses the rest with that release's messages, and advertises
no protocol range, as that release did not. Everything else (authentication, incidents,
containment) is today's, which is what the report reaches once that check passes. The
roll tests run the previous release's own code instead (tests/integration/previous_release.py),
which needs the repository's history; this one needs none."""

from __future__ import annotations

import runpy
from typing import Any

from aiohttp import web

from sdc_common.protocol import Report
from sdc_operator import intake
from tests import previous_protocol

_today = intake.parse_report


def parse_as_before(raw: Any, *, ignored: list[str] | None = None) -> Report:
    previous_protocol.parse_report(raw)  # raises that release's ProtocolError, with its words
    return _today(raw)


async def advertise_nothing(request: web.Request, response: web.StreamResponse) -> None:
    return None


intake.parse_report = parse_as_before  # type: ignore[assignment]
intake._advertise_versions = advertise_nothing

if __name__ == "__main__":
    runpy.run_module("sdc_operator", run_name="__main__", alter_sys=True)
