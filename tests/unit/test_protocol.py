"""The wire protocol: round trips, a named error for every malformed field, the schema."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sdc_agent.errors import ProtocolError
from sdc_agent.protocol import (
    MAX_REPORT_BYTES,
    CheckpointReport,
    HeartbeatReport,
    ResumeReport,
    VerdictReport,
    encode_report,
    parse_report,
    report_schema,
)

ROOT = Path(__file__).resolve().parents[2]

REPORTER = {"rank": 4, "node": "hyperpod-i-0abc", "pod": "job-worker-2"}
VERDICT: dict[str, Any] = {
    "version": 1,
    "kind": "verdict",
    "sent_at": 1764400000.5,
    "reporter": REPORTER,
    "check": "replay",
    "classification": "rank",
    "step": 1200,
    "last_clean_step": 1150,
    "localized": True,
    "transient": False,
    "suspects": [
        {
            "rank": 3,
            "node": "hyperpod-i-0def",
            "local_rank": 1,
            "pod": "job-worker-1",
            "gpu_uuid": "GPU-5d6e0c1a-0000-0000-0000-000000000000",
        }
    ],
    "message": "rank(s) 3 computed wrong results ...",
    "evidence": {"mismatches": [{"work_of": 3, "replayed_by": 5}]},
}
HEARTBEAT: dict[str, Any] = {
    "version": 1,
    "kind": "heartbeat",
    "sent_at": 1764400000.0,
    "reporter": REPORTER,
    "step": 1300,
    "last_clean_step": 1250,
    "check_seconds": {"nonfinite": 0.8, "replay": 1.5, "weights": 0.2},
}
CHECKPOINT: dict[str, Any] = {
    "version": 1,
    "kind": "checkpoint",
    "sent_at": 1764400000.0,
    "reporter": REPORTER,
    "step": 1250,
    "location": "/fsx/ckpt/step_1250",
    "verified": True,
}
RESUME: dict[str, Any] = {
    "version": 1,
    "kind": "resume",
    "sent_at": 1764400000.0,
    "reporter": REPORTER,
    "step": 1250,
    "location": "/fsx/ckpt/step_1250",
}
EXAMPLES = {"verdict": VERDICT, "heartbeat": HEARTBEAT, "checkpoint": CHECKPOINT, "resume": RESUME}
TYPES = {
    "verdict": VerdictReport,
    "heartbeat": HeartbeatReport,
    "checkpoint": CheckpointReport,
    "resume": ResumeReport,
}


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_round_trip(kind: str) -> None:
    report = parse_report(json.dumps(EXAMPLES[kind]).encode())
    assert isinstance(report, TYPES[kind])
    again = parse_report(encode_report(report))
    assert again == report
    assert json.loads(encode_report(report)) == EXAMPLES[kind]


def test_optional_fields_default() -> None:
    body = copy.deepcopy(VERDICT)
    del body["transient"], body["evidence"], body["reporter"]["pod"]
    del body["suspects"][0]["pod"], body["suspects"][0]["gpu_uuid"]
    report = parse_report(body)
    assert isinstance(report, VerdictReport)
    assert report.transient is None
    assert report.evidence == {}
    assert report.reporter.pod is None


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    target: Any = out
    keys = path.replace("[", ".").replace("]", "").split(".")
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    last = keys[-1]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return out


DELETE = object()
BAD: list[tuple[dict[str, Any], str, Any, str]] = [
    (VERDICT, "version", 3, "version"),
    (VERDICT, "version", DELETE, "version"),
    (VERDICT, "kind", "gossip", "kind"),
    (VERDICT, "sent_at", -1, "sent_at"),
    (VERDICT, "sent_at", "now", "sent_at"),
    (VERDICT, "reporter", "rank 4", "reporter"),
    (VERDICT, "reporter.rank", -1, "reporter.rank"),
    (VERDICT, "reporter.node", "", "reporter.node"),
    (VERDICT, "reporter.node", DELETE, "reporter.node"),
    (VERDICT, "reporter.colour", "red", "reporter.colour"),
    (VERDICT, "check", "vibes", "check"),
    (VERDICT, "classification", "cosmic-ray", "classification"),
    (VERDICT, "step", 0, "step"),
    (VERDICT, "step", 1.5, "step"),
    (VERDICT, "step", True, "step"),
    (VERDICT, "last_clean_step", 1200, "last_clean_step"),
    (VERDICT, "localized", "yes", "localized"),
    (VERDICT, "transient", 1, "transient"),
    (VERDICT, "suspects", {}, "suspects"),
    (VERDICT, "suspects[0].rank", "3", "suspects[0].rank"),
    (VERDICT, "suspects[0].node", DELETE, "suspects[0].node"),
    (VERDICT, "suspects[0].local_rank", -2, "suspects[0].local_rank"),
    (VERDICT, "suspects[0].gpu_uuid", 7, "suspects[0].gpu_uuid"),
    (VERDICT, "suspects[0].extra", 1, "suspects[0].extra"),
    (VERDICT, "message", "", "message"),
    (VERDICT, "message", "x" * 5000, "message"),
    (VERDICT, "evidence", [1, 2], "evidence"),
    (VERDICT, "job", "someone-elses-job", "job"),
    (HEARTBEAT, "step", -5, "step"),
    (HEARTBEAT, "last_clean_step", 1301, "last_clean_step"),
    (HEARTBEAT, "check_seconds", [], "check_seconds"),
    (HEARTBEAT, "check_seconds.vibes", 1.0, "check_seconds.vibes"),
    (HEARTBEAT, "check_seconds.replay", -1.0, "check_seconds.replay"),
    (CHECKPOINT, "location", "", "location"),
    (CHECKPOINT, "verified", "true", "verified"),
    (CHECKPOINT, "step", DELETE, "step"),
]


@pytest.mark.parametrize(("base", "path", "value", "field"), BAD)
def test_every_malformed_field_is_named(
    base: dict[str, Any], path: str, value: Any, field: str
) -> None:
    body = _set(base, path, value)
    with pytest.raises(ProtocolError) as info:
        parse_report(json.dumps(body))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "is not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b"\xff\xfe", "is not UTF-8"),
        (b'{"version": 1, "kind": "checkpoint", "sent_at": NaN}', "NaN"),
        (b" " * (MAX_REPORT_BYTES + 1), "larger than"),
    ],
)
def test_malformed_documents(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_report(raw)


def test_unknown_version_is_rejected_even_if_otherwise_fine() -> None:
    with pytest.raises(ProtocolError, match="unsupported protocol version 3"):
        parse_report({**CHECKPOINT, "version": 3})


def test_the_schema_agrees_with_the_parser() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for body in EXAMPLES.values():
        validator.validate(body)
    cross_field = {"last_clean_step"}  # the schema cannot compare two fields
    for base, path, value, field in BAD:
        if field in cross_field:
            continue
        assert not validator.is_valid(_set(base, path, value)), (path, value)


def test_the_published_schema_is_current() -> None:
    published = json.loads((ROOT / "docs" / "report.schema.json").read_text())
    assert published == report_schema(), (
        "regenerate: python -m sdc_common.protocol > docs/report.schema.json"
    )


def test_protocol_imports_without_torch() -> None:
    code = (
        "import sys, sdc_agent.protocol, sdc_agent.errors\n"
        "assert 'torch' not in sys.modules, 'protocol pulled in torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (json.dumps({**CHECKPOINT, "sent_at": 10**400}), "sent_at"),
        ('{"version": 1, "kind": "checkpoint", "sent_at": ' + "9" * 5000 + "}", "report"),
        ("[" * 100_000 + "]" * 100_000, "report"),
        ('{"version": 1.0, "kind": "checkpoint"}', "version"),
    ],
)
def test_absurd_documents_get_a_protocol_error(body: str, field: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_report(body)
    assert info.value.field == field


def test_decoded_objects_are_held_to_the_same_rules() -> None:
    with pytest.raises(ProtocolError, match="^report: has a key that is not a string"):
        parse_report({**CHECKPOINT, 5: "x"})  # type: ignore[dict-item]
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ProtocolError, match="^evidence.*nested more than"):
        parse_report({**VERDICT, "evidence": deep})
    with pytest.raises(ProtocolError, match="^evidence.a: must be plain JSON, got a set"):
        parse_report({**VERDICT, "evidence": {"a": {1, 2}}})
    with pytest.raises(ProtocolError, match="^report: is not valid UTF-8"):
        parse_report('{"version": 1, "message": "\ud800"}')


def test_encode_refuses_what_the_operator_would_refuse() -> None:
    report = parse_report(VERDICT)
    assert isinstance(report, VerdictReport)
    import dataclasses

    with pytest.raises(ProtocolError, match="^message:"):
        encode_report(dataclasses.replace(report, message="x" * 5000))


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        # "kind" twice must not turn a heartbeat into a verdict (or anything else).
        ('{"version":1,"kind":"heartbeat","kind":"verdict"}', "kind"),
        ('{"version":1,"version":1,"kind":"resume"}', "version"),
        (
            '{"version":1,"kind":"resume","sent_at":1,"step":2,'
            '"reporter":{"rank":0,"node":"a","node":"b"}}',
            "reporter.node",
        ),
        (
            '{"version":1,"kind":"heartbeat","sent_at":1,"reporter":{"rank":0,"node":"a"},'
            '"step":2,"last_clean_step":1,"check_seconds":{"replay":1,"replay":2}}',
            "check_seconds.replay",
        ),
    ],
)
def test_a_key_given_twice_is_refused_by_name(raw: str, field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_report(raw)
    assert caught.value.field == field
    assert "more than once" in str(caught.value)


def test_a_key_given_twice_inside_evidence_is_refused() -> None:
    raw = json.dumps(VERDICT).replace('"evidence": {', '"evidence": {"mismatches": [], ', 1)
    with pytest.raises(ProtocolError, match=r"^evidence\.mismatches: is given more than once"):
        parse_report(raw)


def test_the_optional_fields_of_this_wave_round_trip() -> None:
    verdict = dict(VERDICT, corroborated=True, run_id="r-7f3a", bundle="/fsx/ckpt/sdc/b1")
    heartbeat = dict(
        HEARTBEAT,
        interval_seconds=12.5,
        fingerprint_kernel="eager",
        gradient_tolerance=3e-6,
        bit_reproducible=False,
        run_id="r-7f3a",
    )
    for doc in (verdict, heartbeat):
        report = parse_report(json.dumps(doc))
        assert json.loads(encode_report(report)) == doc
        jsonschema.validate(doc, report_schema())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"run_id": "../etc"}, "run_id"),
        ({"run_id": "x" * 65}, "run_id"),
        ({"fingerprint_kernel": "triton"}, "fingerprint_kernel"),
        ({"gradient_tolerance": -1}, "gradient_tolerance"),
        ({"interval_seconds": "soon"}, "interval_seconds"),
        ({"bit_reproducible": "yes"}, "bit_reproducible"),
    ],
)
def test_bad_optional_heartbeat_fields_are_named(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_report(json.dumps(dict(HEARTBEAT, **change)))
    assert caught.value.field == field


REPLAY_KINDS = [
    {"kind": "loss", "threshold": 0.0, "noise": 0.0, "blind": False},
    {"kind": "gradients:3", "threshold": None, "noise": 0.0067, "blind": True},
    {"kind": "gradients:5", "threshold": 0.0021, "noise": 0.0019, "blind": False},
]


def test_the_replay_audits_thresholds_per_kind_round_trip_in_version_2() -> None:
    doc = dict(
        HEARTBEAT,
        version=2,
        replay_dtype="bfloat16",
        replay_cap=2**-7,
        replay_kinds=REPLAY_KINDS,
    )
    report = parse_report(json.dumps(doc))
    assert isinstance(report, HeartbeatReport)
    assert [k.kind for k in report.replay_kinds if k.blind] == ["gradients:3"]
    assert json.loads(encode_report(report)) == doc
    jsonschema.validate(doc, report_schema())
    left_out: list[str] = []
    old = json.loads(encode_report(report, version=1, left_out=left_out))
    assert sorted(left_out) == ["replay_cap", "replay_dtype", "replay_kinds"]
    assert old == dict(HEARTBEAT)


@pytest.mark.parametrize(
    ("kinds", "field"),
    [
        ({"loss": 0}, "replay_kinds"),
        ([{"kind": "loss", "threshold": -1, "noise": 0}], "replay_kinds[0].threshold"),
        ([{"kind": "loss", "threshold": 0}], "replay_kinds[0].noise"),
        ([{"kind": "", "threshold": 0, "noise": 0}], "replay_kinds[0].kind"),
        ([{"kind": "loss", "threshold": 0, "noise": 0, "blind": 1}], "replay_kinds[0].blind"),
        ([{"kind": "loss", "threshold": 0, "noise": 0}] * 2, "replay_kinds"),
        ([{"kind": f"k{i}", "threshold": 0, "noise": 0} for i in range(65)], "replay_kinds"),
    ],
)
def test_bad_replay_kinds_are_named(kinds: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_report(json.dumps(dict(HEARTBEAT, version=2, replay_kinds=kinds)))
    assert caught.value.field == field


def test_the_snapshot_step_round_trips_in_version_2_and_is_left_out_of_version_1() -> None:
    doc = dict(VERDICT, version=2, snapshot_step=VERDICT["last_clean_step"])
    report = parse_report(json.dumps(doc))
    assert isinstance(report, VerdictReport)
    assert report.snapshot_step == VERDICT["last_clean_step"]
    assert json.loads(encode_report(report)) == doc
    jsonschema.validate(doc, report_schema())
    left_out: list[str] = []
    old = json.loads(encode_report(report, version=1, left_out=left_out))
    assert left_out == ["snapshot_step"]
    assert "snapshot_step" not in old
    # Unset, it is not written at all (a report without a snapshot reads as before).
    plain = parse_report(json.dumps(dict(VERDICT, version=2)))
    assert "snapshot_step" not in json.loads(encode_report(plain))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("3", "must be an integer"),
        (-1, "must be >= 0"),
        (True, "must be an integer"),
        (VERDICT["last_clean_step"] + 1, "must be <= last_clean_step"),
    ],
)
def test_a_bad_snapshot_step_is_named(value: Any, problem: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_report(json.dumps(dict(VERDICT, version=2, snapshot_step=value)))
    assert caught.value.field == "snapshot_step"
    assert problem in str(caught.value)


def test_version_1_refuses_the_snapshot_step() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_report(json.dumps(dict(VERDICT, version=1, snapshot_step=1)))
    assert caught.value.field == "snapshot_step"
