"""Protocol compatibility (docs/protocol.md, "Versions"): the previous release's reports are
read, the previous release's operator is written to, unknown optional fields are ignored and
named, unknown required ones are refused naming the field; the reporter negotiates."""

from __future__ import annotations

import dataclasses
import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sdc_agent.launch import free_port
from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_common.errors import ProtocolError
from sdc_common.protocol import (
    ACCEPTED_VERSIONS,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    CheckpointReport,
    HeartbeatReport,
    ReporterIdentity,
    ResumeReport,
    Suspect,
    VerdictReport,
    encode_report,
    parse_report,
)
from tests import previous_protocol as previous

ME = ReporterIdentity(rank=4, node="hyperpod-i-0abc", pod="job-worker-2")
NOW = 1764400000.5


def reports(module: Any) -> list[Any]:
    """One report of each kind, built with ``module``'s dataclasses (this release's or the
    previous one's), every optional field set."""
    me = module.ReporterIdentity(rank=4, node="hyperpod-i-0abc", pod="job-worker-2")
    suspect = module.Suspect(3, "hyperpod-i-0def", 1, "job-worker-1", "GPU-5d6e")
    return [
        module.VerdictReport(
            reporter=me,
            sent_at=NOW,
            check="replay",
            classification="rank",
            step=1200,
            last_clean_step=1150,
            localized=True,
            transient=False,
            suspects=(suspect,),
            message="rank 3 is wrong",
            evidence={"mismatches": [{"work_of": 3, "replayed_by": 5}]},
            corroborated=True,
            run_id="run-1",
            bundle="/fsx/bundles/1200",
        ),
        module.HeartbeatReport(
            reporter=me,
            sent_at=NOW,
            step=1300,
            last_clean_step=1250,
            check_seconds={"replay": 1.5},
            interval_seconds=60.0,
            fingerprint_kernel="compiled",
            gradient_tolerance=0.0,
            bit_reproducible=True,
            run_id="run-1",
        ),
        module.CheckpointReport(
            reporter=me, sent_at=NOW, step=1250, location="/fsx/ckpt/1250", verified=True
        ),
        module.ResumeReport(reporter=me, sent_at=NOW, step=1250, location="/fsx/ckpt/1250"),
    ]


def plain(report: Any) -> dict[str, Any]:
    body = dataclasses.asdict(report)
    body.pop("version")
    # added since v1
    for added in ("unreported", "replay_dtype", "replay_cap", "replay_kinds", "snapshot_step"):
        body.pop(added, None)
    return body


def test_the_versions_are_the_current_and_the_previous() -> None:
    assert ACCEPTED_VERSIONS == (PROTOCOL_VERSION - 1, PROTOCOL_VERSION) == (1, 2)
    assert previous.PROTOCOL_VERSION == 1


@pytest.mark.parametrize("index", range(4))
def test_a_previous_agents_report_reads_the_same(index: int) -> None:
    old = reports(previous)[index]
    read = parse_report(previous.encode_report(old))
    assert read.version == 1
    assert plain(read) == plain(old)
    # and this side writes it back exactly as the previous agent did
    assert encode_report(read) == previous.encode_report(old)


@pytest.mark.parametrize("index", range(4))
def test_the_previous_operator_reads_what_this_agent_writes_as_version_1(index: int) -> None:
    new = reports(_current)[index]
    with pytest.raises(ProtocolError, match=r"^version: unsupported protocol version 2"):
        previous.parse_report(encode_report(new))  # its answer, which the reporter reads
    left_out: list[str] = []
    old = previous.parse_report(encode_report(new, version=1, left_out=left_out))
    assert plain(old) == plain(new) and left_out == []


class _Current:
    ReporterIdentity = ReporterIdentity
    Suspect = Suspect
    VerdictReport = VerdictReport
    HeartbeatReport = HeartbeatReport
    CheckpointReport = CheckpointReport
    ResumeReport = ResumeReport


_current = _Current


def test_written_as_version_1_the_newer_fields_are_left_out_and_named() -> None:
    beat = dataclasses.replace(reports(_current)[1], unreported=("mesh",))
    left_out: list[str] = []
    body = json.loads(encode_report(beat, version=1, left_out=left_out))
    assert left_out == ["unreported"] and "unreported" not in body and body["version"] == 1
    assert json.loads(encode_report(beat))["unreported"] == ["mesh"]
    with pytest.raises(ProtocolError, match="^version: cannot write protocol version 3"):
        encode_report(beat, version=3)


def v2(kind: int = 2, **extra: Any) -> dict[str, Any]:
    body = json.loads(encode_report(reports(_current)[kind]))
    assert body["version"] == 2
    return {**body, **extra}


def test_version_2_ignores_unknown_optional_fields_and_names_them() -> None:
    body = v2(0, mesh={"dp": 4, "tp": 2})
    body["reporter"]["zone"] = "usw2-az1"
    body["suspects"][0]["nvlink"] = 3
    ignored: list[str] = []
    report = parse_report(json.dumps(body), ignored=ignored)
    assert ignored == ["mesh", "reporter.zone", "suspects[0].nvlink"]
    assert plain(report) == plain(reports(_current)[0])
    assert parse_report(json.dumps(body)) == report  # the caller need not ask


def test_version_2_refuses_an_unknown_field_the_report_requires_naming_it() -> None:
    body = v2(must_understand=["mesh", "step"], mesh={"dp": 4})
    with pytest.raises(ProtocolError) as info:
        parse_report(json.dumps(body))
    assert info.value.field == "mesh"
    assert str(info.value) == (
        "mesh: is not understood by this side (protocol 2) and the report lists it in "
        "must_understand"
    )
    # required and understood, or required and absent: accepted
    assert parse_report(json.dumps(v2(must_understand=["step", "later"]))).kind == "checkpoint"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("mesh", "must_understand: must be an array, got a string"),
        (["mesh", "mesh"], "must_understand: names a field more than once"),
        ([""], "must_understand[0]: must not be empty"),
        (["x"] * 65, "must_understand: has more than 64 entries"),
    ],
)
def test_a_malformed_must_understand_is_named(value: Any, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_report(json.dumps(v2(must_understand=value)))
    assert str(info.value) == message


def test_version_1_stays_strict() -> None:
    body = json.loads(previous.encode_report(reports(previous)[2]))
    extras: list[dict[str, Any]] = [{"mesh": 1}, {"must_understand": []}, {"unreported": []}]
    for extra in extras:
        with pytest.raises(ProtocolError) as info:
            parse_report(json.dumps({**body, **extra}))
        assert info.value.field == next(iter(extra)) and info.value.problem == "unknown field"
    with pytest.raises(ProtocolError, match="^version: unsupported protocol version 3; this"):
        parse_report(json.dumps({**body, "version": 3}))


# -- the reporter's negotiation, against stand-in intakes ----------------------------------


class Intake:
    """Answers like an operator: ``accept`` decides (raising ProtocolError refuses with 422
    as the intake does); ``header`` is its advertised range (None: the previous release)."""

    def __init__(
        self,
        accept: Callable[[bytes], list[str]],
        header: str | None,
    ) -> None:
        self.received: list[dict[str, Any]] = []
        self.header = header
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    ignored = accept(body)
                    status, answer = (
                        202,
                        {"accepted": "x", **({"ignored": ignored} if ignored else {})},
                    )
                    owner.received.append(json.loads(body))
                except ProtocolError as exc:
                    status, answer = 422, {"error": "schema", "message": str(exc)}
                data = json.dumps(answer).encode()
                self.send_response(status)
                if owner.header is not None:
                    self.send_header(PROTOCOL_HEADER, owner.header)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reporter(self) -> Reporter:
        return Reporter(
            ReporterConfig(
                operator_url=f"http://127.0.0.1:{self.port}",
                token_file=None,
                initial_backoff_seconds=0.05,
                max_backoff_seconds=0.2,
            )
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def previous_intake(body: bytes) -> list[str]:
    previous.parse_report(body)
    return []


@pytest.fixture
def intakes() -> Iterator[list[Intake]]:
    made: list[Intake] = []
    yield made
    for intake in made:
        intake.close()


def heartbeat(step: int) -> HeartbeatReport:
    return HeartbeatReport(reporter=ME, sent_at=time.time(), step=step, last_clean_step=step)


def test_a_new_agent_falls_back_to_the_previous_operators_version(
    intakes: list[Intake], caplog: pytest.LogCaptureFixture
) -> None:
    intake = Intake(previous_intake, header=None)
    intakes.append(intake)
    reporter = intake.reporter()
    caplog.set_level(logging.WARNING, "sdc_agent.reporter")
    try:
        for report in reports(_current):
            reporter.submit(dataclasses.replace(report, sent_at=time.time()))
        assert reporter.flush(10)
        counters = reporter.counters()
    finally:
        reporter.close()
    assert [r["kind"] for r in intake.received] == ["verdict", "heartbeat", "checkpoint", "resume"]
    assert {r["version"] for r in intake.received} == {1}
    assert counters["delivered"] == 4 and counters["refused"] == 0
    assert counters["protocol_version"] == 1 and counters["unreported"] == {}
    (line,) = [r.getMessage() for r in caplog.records if "writing version" in r.getMessage()]
    assert "accepts protocol version(s) 1; writing version 1 from now on (was 2)" in line


def test_an_agent_says_what_an_older_operator_ignores_and_follows_its_upgrade(
    intakes: list[Intake], caplog: pytest.LogCaptureFixture
) -> None:
    """A version-2 operator that does not know a field the agent sends (stood in for by one
    that ignores ``bundle``) answers ``ignored``; the agent logs it once, counts it and
    names it in its heartbeats."""

    upgraded = threading.Event()

    def older(body: bytes) -> list[str]:
        parse_report(body)
        return ["bundle"] if "bundle" in json.loads(body) and not upgraded.is_set() else []

    intake = Intake(older, header="1, 2")
    intakes.append(intake)
    reporter = intake.reporter()
    reporter.protocol_version = 1  # as after talking to the operator before its upgrade
    caplog.set_level(logging.WARNING, "sdc_agent.reporter")
    try:
        reporter.submit(dataclasses.replace(reports(_current)[0], sent_at=time.time()))
        assert reporter.flush(10)
        reporter.submit(dataclasses.replace(reports(_current)[0], sent_at=time.time()))
        reporter.submit(heartbeat(5))
        assert reporter.flush(10)
        counters = reporter.counters()
        # The operator is upgraded: its answer to a report carrying the field no longer
        # names it, and the heartbeats stop naming it (the counts stay).
        upgraded.set()
        reporter.submit(dataclasses.replace(reports(_current)[0], sent_at=time.time()))
        reporter.submit(heartbeat(6))
        assert reporter.flush(10)
        after = reporter.counters()
    finally:
        reporter.close()
    assert [r["version"] for r in intake.received] == [1, 2, 2, 2, 2]
    assert counters["protocol_version"] == 2 and counters["unreported"] == {"bundle": 2}
    assert counters["not_received"] == ["bundle"]
    assert intake.received[2]["unreported"] == ["bundle"]
    assert "unreported" not in intake.received[-1]
    assert after["not_received"] == [] and after["unreported"] == {"bundle": 2}
    said = [r.getMessage() for r in caplog.records if "does not receive" in r.getMessage()]
    assert len(said) == 1 and "bundle" in said[0]


def test_what_an_older_version_lacked_is_not_named_once_the_operator_speaks_the_newer(
    intakes: list[Intake],
) -> None:
    """Left out while the operator spoke version 1 (its release before the header); once it
    is upgraded and advertises version 2, the fields arrive and no heartbeat names them."""
    accept: dict[str, Callable[[bytes], list[str]]] = {"now": previous_intake}
    intake = Intake(lambda body: accept["now"](body), header=None)
    intakes.append(intake)
    reporter = intake.reporter()
    beat = dataclasses.replace(heartbeat(5), replay_dtype="bfloat16", replay_cap=7.8e-3)
    try:
        reporter.submit(dataclasses.replace(beat, sent_at=time.time()))
        assert reporter.flush(10)
        before = reporter.counters()
        accept["now"], intake.header = lambda body: (parse_report(body), [])[1], "1, 2"
        for step in (6, 7):  # the first answer advertises 2; the second is written in it
            reporter.submit(dataclasses.replace(beat, step=step, sent_at=time.time()))
            assert reporter.flush(10)
        after = reporter.counters()
    finally:
        reporter.close()
    assert [r["version"] for r in intake.received] == [1, 1, 2]
    assert before["not_received"] == ["replay_cap", "replay_dtype"]
    assert (after["protocol_version"], after["not_received"]) == (2, [])
    assert intake.received[-1]["replay_dtype"] == "bfloat16"
    assert "unreported" not in intake.received[-1]
    assert after["unreported"] == {"replay_cap": 2, "replay_dtype": 2}
