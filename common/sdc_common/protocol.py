"""The wire protocol between the agent and the operator: the one definition.

Torch-free on purpose (it lives in the shared ``sdc_common``, which imports only the
standard library): the agent and the operator both import it. A report is one JSON
object, at most :data:`MAX_REPORT_BYTES` bytes, sent as ``POST /v1/reports`` with
``Content-Type: application/json`` and the reporting pod's ServiceAccount token as a Bearer
token. The operator derives the job from the token's pod, never from the report. Three kinds
share an envelope::

    {"version": 2, "kind": "verdict" | "heartbeat" | "checkpoint" | "resume",
     "sent_at": <seconds since the epoch>,
     "reporter": {"rank": 0, "node": "hyperpod-i-0abc...", "pod": "job-worker-0"}, ...}

:func:`parse_report` validates and returns a frozen dataclass; every problem raises
:class:`~sdc_common.errors.ProtocolError` naming the field (``suspects[1].rank``).

Compatibility (``docs/protocol.md``, "Versions"): a receiver reads the current version
and the previous one (:data:`ACCEPTED_VERSIONS`). Version 1 refuses every unknown field.
From version 2 on, an unknown field is ignored (and named to the caller) unless the report
lists it in ``must_understand``, which makes it required: then the report is refused with
an error naming it. :func:`encode_report` writes any accepted version, leaving out (and
naming) what the older one cannot carry. :func:`report_schema` gives the rules as a JSON
Schema; ``python -m sdc_common.protocol`` prints it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ProtocolError

__all__ = [
    "ACCEPTED_VERSIONS",
    "CHECKS",
    "CLASSIFICATIONS",
    "MAX_REPORT_BYTES",
    "PREVIOUS_PROTOCOL_VERSION",
    "PROTOCOL_HEADER",
    "PROTOCOL_VERSION",
    "CheckpointReport",
    "HeartbeatReport",
    "ReplayKind",
    "ReporterIdentity",
    "ResumeReport",
    "Suspect",
    "VerdictReport",
    "encode_report",
    "parse_report",
    "report_schema",
]

PROTOCOL_VERSION = 2
"""The version this side writes."""
PREVIOUS_PROTOCOL_VERSION = 1
ACCEPTED_VERSIONS = (PREVIOUS_PROTOCOL_VERSION, PROTOCOL_VERSION)
"""What this side reads: agents ship inside users' images and lag the operator by weeks."""
PROTOCOL_HEADER = "Hyperpod-Sdc-Protocol"
"""On every answer of the operator's intake: the versions it accepts, ``"1, 2"``. An
operator from before this header speaks version 1 only."""
MAX_MUST_UNDERSTAND = 64
MAX_UNREPORTED = 64
MAX_REPLAY_KINDS = 64
"""A heartbeat's ``replay_kinds`` holds at most this many kinds: the loss, the blind kinds,
then the working kinds with the largest thresholds (the agent log has every kind)."""
MAX_REPORT_BYTES = 64 * 1024
"""Largest accepted report; the agent trims evidence to fit."""
CHECKS = ("nonfinite", "replay", "weights")
CLASSIFICATIONS = ("rank", "collective", "training", "replica", "nondeterministic")
KINDS = ("verdict", "heartbeat", "checkpoint", "resume")
FINGERPRINT_KERNELS = ("compiled", "eager")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_MESSAGE = 4096
_MAX_TEXT = MAX_MESSAGE
_MAX_NAME = 253  # a Kubernetes object name
MAX_SUSPECTS = 1024
_MAX_SUSPECTS = MAX_SUSPECTS
_MAX_DEPTH = 32  # nesting of evidence


@dataclass(frozen=True, slots=True)
class ReporterIdentity:
    """Who sends the report (the operator checks the pod against the token)."""

    rank: int
    node: str
    pod: str | None = None


@dataclass(frozen=True, slots=True)
class Suspect:
    rank: int
    node: str
    local_rank: int
    pod: str | None = None
    gpu_uuid: str | None = None
    """The CUDA device UUID (``GPU-...``) where CUDA reports one."""


@dataclass(frozen=True, slots=True)
class VerdictReport:
    reporter: ReporterIdentity
    sent_at: float
    check: str
    classification: str
    step: int
    last_clean_step: int
    localized: bool
    transient: bool | None
    suspects: tuple[Suspect, ...]
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    corroborated: bool | None = None
    """An independent recomputation on another node supports accusing ``suspects``
    (replay audit: mismatches on two different nodes, or a third node's tie-break;
    non-finite check: the suspect's micro-batch replayed finite elsewhere and non-finite
    again on the suspect). False: the evidence is one observation (one collective, one
    computation); null: unknown (agents before this field). The operator quarantines only
    on corroborated verdicts."""
    run_id: str | None = None
    """Identifies one run of the job's processes (new after every restart, the same on
    every rank); a verdict from a later run never folds into an earlier run's incident."""
    bundle: str | None = None
    """Where the evidence bundle that recomputes the audited micro-batch is (or is being)
    written, for a confirmation run on the suspect node."""
    snapshot_step: int | None = None
    """The step of the verified snapshot the healthy ranks are writing as a checkpoint
    because of this verdict (at or before ``last_clean_step``; ``sdc_agent.snapshot``): the
    operator's stop of the job waits a bounded time for its ``checkpoint`` report. Null or
    absent: no snapshot is written. Protocol 2."""
    kind: str = "verdict"
    version: int = PROTOCOL_VERSION

    @property
    def accuses_hardware(self) -> bool:
        return self.classification not in ("training", "nondeterministic") and bool(self.suspects)


@dataclass(frozen=True, slots=True)
class ReplayKind:
    """One kind of replay evidence (the loss, one layer's gradients, or one module's
    forward output) as the audit judges it: in a heartbeat's ``replay_kinds``."""

    kind: str
    """``loss``, ``gradients:<layer>`` or ``outputs:<module>``."""
    threshold: float | None
    """Relative differences at or below it are noise (0: compared bit for bit); ``None``:
    the kind is blind."""
    noise: float
    """The largest difference taken for run-to-run noise in this kind so far (relative)."""
    blind: bool = False
    """The kind cannot tell a fault from noise (its noise against ``replay_cap``); the
    other kinds keep watching."""


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    reporter: ReporterIdentity
    sent_at: float
    step: int
    last_clean_step: int
    check_seconds: dict[str, float] = field(default_factory=dict)
    """Time spent in each check since the previous heartbeat."""
    interval_seconds: float | None = None
    """Wall-clock seconds since the previous heartbeat (or the start): with
    ``check_seconds``, the checks' share of the step time."""
    fingerprint_kernel: str | None = None
    """``compiled`` or ``eager``: which fingerprint kernel runs (eager is the slow path)."""
    gradient_tolerance: float | None = None
    """The replay audit's detection threshold in force for gradients: relative
    differences at or below it count as run-to-run noise, not evidence. 0: the job is
    bit-reproducible and any difference is evidence; null: not measured yet."""
    bit_reproducible: bool | None = None
    """Whether the audit has found the job bit-reproducible across processes."""
    run_id: str | None = None
    """As in a verdict."""
    replay_dtype: str | None = None
    """The dtype the replay audit's cap is for (the computation's: ``bfloat16`` under bf16
    autocast)."""
    replay_cap: float | None = None
    """The largest difference rounding in ``replay_dtype`` can produce (relative): a kind
    whose noise reaches half of it goes blind."""
    replay_kinds: tuple[ReplayKind, ...] = ()
    """Per kind of replay evidence, its threshold in force and learned noise (at most
    :data:`MAX_REPLAY_KINDS`)."""
    unreported: tuple[str, ...] = ()
    """Fields this agent has but the operator does not read (left out for an older
    protocol, or ignored by the operator): what the operator does not learn from it.
    Protocol 2."""
    kind: str = "heartbeat"
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    reporter: ReporterIdentity
    sent_at: float
    step: int
    location: str
    verified: bool
    """True when every check vouched for this step (``step <= last_clean_step``)."""
    kind: str = "checkpoint"
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class ResumeReport:
    """The job restarted from the checkpoint of ``step`` (sent by ``Guard.restore``); the
    operator marks the incident that stopped the job as resumed."""

    reporter: ReporterIdentity
    sent_at: float
    step: int
    location: str | None = None
    """The checkpoint it loaded, where the training script says."""
    kind: str = "resume"
    version: int = PROTOCOL_VERSION


Report = VerdictReport | HeartbeatReport | CheckpointReport | ResumeReport


# -- validation ------------------------------------------------------------------------------


def _obj(
    value: Any,
    path: str,
    required: set[str],
    optional: set[str],
    unknown: list[str] | None = None,
) -> dict[str, Any]:
    """``value`` as an object with ``required`` and ``optional`` keys; another key is an
    error, or, given ``unknown``, is appended there (its path) and ignored."""
    if not isinstance(value, dict):
        raise ProtocolError(path or "report", f"must be a JSON object, got {_kind(value)}")
    _no_duplicates(value, path)
    for key in sorted(value, key=str):
        if not isinstance(key, str):
            raise ProtocolError(path or "report", f"has a key that is not a string: {key!r}")
        if key not in required and key not in optional:
            if unknown is None:
                raise ProtocolError(_join(path, key), "unknown field")
            unknown.append(_join(path, key))
    for key in sorted(required):
        if key not in value:
            raise ProtocolError(_join(path, key), "is required")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return f"a {type(value).__name__}"


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(path, f"must be an integer, got {_kind(value)}")
    if value < minimum:
        raise ProtocolError(path, f"must be >= {minimum}, got {value}")
    if value > 2**62:
        raise ProtocolError(path, f"is out of range: {value}")
    return value


def _num(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(path, f"must be a number, got {_kind(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise ProtocolError(path, "must be a finite number >= 0")
    return number


def _bool(value: Any, path: str, *, nullable: bool = False) -> bool | None:
    if value is None and nullable:
        return None
    if not isinstance(value, bool):
        raise ProtocolError(path, f"must be true or false, got {_kind(value)}")
    return value


def _str(value: Any, path: str, *, limit: int, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise ProtocolError(path, f"must be a string, got {_kind(value)}")
    if not value:
        raise ProtocolError(path, "must not be empty")
    if len(value) > limit:
        raise ProtocolError(path, f"is longer than {limit} characters")
    return value


def _choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ProtocolError(path, f"must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _reporter(value: Any, unknown: list[str] | None) -> ReporterIdentity:
    d = _obj(value, "reporter", {"rank", "node"}, {"pod"}, unknown)
    return ReporterIdentity(
        rank=_int(d["rank"], "reporter.rank"),
        node=_req_str(d["node"], "reporter.node", _MAX_NAME),
        pod=_str(d.get("pod"), "reporter.pod", limit=_MAX_NAME, nullable=True),
    )


def _req_str(value: Any, path: str, limit: int) -> str:
    out = _str(value, path, limit=limit)
    assert out is not None
    return out


def _suspect(value: Any, path: str, unknown: list[str] | None) -> Suspect:
    d = _obj(value, path, {"rank", "node", "local_rank"}, {"pod", "gpu_uuid"}, unknown)
    return Suspect(
        rank=_int(d["rank"], f"{path}.rank"),
        node=_req_str(d["node"], f"{path}.node", _MAX_NAME),
        local_rank=_int(d["local_rank"], f"{path}.local_rank"),
        pod=_str(d.get("pod"), f"{path}.pod", limit=_MAX_NAME, nullable=True),
        gpu_uuid=_str(d.get("gpu_uuid"), f"{path}.gpu_uuid", limit=128, nullable=True),
    )


_ENVELOPE = {"version", "kind", "sent_at", "reporter"}
_ENVELOPE_OPTIONAL = {"must_understand"}
# Version 1's fields, frozen: what an agent or operator of the first release knows. A field
# added later is optional to a version-2 receiver and left out when writing version 1.
_V1_FIELDS = {
    "verdict": (
        {"check", "classification", "step", "last_clean_step", "localized", "suspects", "message"},
        {"transient", "evidence", "corroborated", "run_id", "bundle"},
    ),
    "heartbeat": (
        {"step", "last_clean_step"},
        {
            "check_seconds",
            "interval_seconds",
            "fingerprint_kernel",
            "gradient_tolerance",
            "bit_reproducible",
            "run_id",
        },
    ),
    "checkpoint": ({"step", "location", "verified"}, set()),
    "resume": ({"step"}, {"location"}),
}
# Optional fields added since version 1, per kind.
_ADDED_SINCE_V1 = {
    "verdict": {"snapshot_step"},
    "heartbeat": {"unreported", "replay_dtype", "replay_cap", "replay_kinds"},
}
_FIELDS = {
    kind: (required, optional | _ADDED_SINCE_V1.get(kind, set()))
    for kind, (required, optional) in _V1_FIELDS.items()
}


def parse_report(
    data: bytes | str | Mapping[str, Any], *, ignored: list[str] | None = None
) -> Report:
    """Validate a report (raw JSON or an already decoded object) and return it.

    A version-2 report's unknown fields (paths such as ``mesh`` or ``reporter.zone``) are
    ignored and appended to ``ignored`` where given; one the report names in
    ``must_understand`` is refused instead. A version-1 report is held to version 1: any
    field it did not have is an error."""
    if isinstance(data, bytes | bytearray):
        if len(data) > MAX_REPORT_BYTES:
            raise ProtocolError("report", f"is larger than {MAX_REPORT_BYTES} bytes")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("report", "is not UTF-8") from None
    if isinstance(data, str):
        try:
            size = len(data.encode("utf-8"))
        except UnicodeEncodeError:
            raise ProtocolError("report", "is not valid UTF-8 text") from None
        if size > MAX_REPORT_BYTES:
            raise ProtocolError("report", f"is larger than {MAX_REPORT_BYTES} bytes")
        try:
            data = json.loads(
                data, parse_constant=_reject_constant, object_pairs_hook=_object_pairs
            )
        except ProtocolError:
            raise
        except json.JSONDecodeError as exc:
            raise ProtocolError("report", f"is not valid JSON ({exc.msg} at {exc.pos})") from None
        except (ValueError, RecursionError) as exc:  # absurd numbers, absurd nesting
            raise ProtocolError(
                "report", f"is not acceptable JSON ({type(exc).__name__})"
            ) from None
    if not isinstance(data, dict):
        raise ProtocolError("report", f"must be a JSON object, got {_kind(data)}")
    _no_duplicates(data, "")
    if "version" not in data:
        raise ProtocolError("version", "is required")
    version = data["version"]
    if type(version) is not int or version not in ACCEPTED_VERSIONS:
        accepted = " and ".join(map(str, ACCEPTED_VERSIONS))
        raise ProtocolError(
            "version",
            f"unsupported protocol version {version!r}; this side speaks {PROTOCOL_VERSION} "
            f"and accepts {accepted}",
        )
    kind = _choice(data.get("kind"), "kind", KINDS)
    unknown: list[str] | None = None
    must: frozenset[str] = frozenset()
    if version == 1:
        required, optional = _V1_FIELDS[kind]
        d = _obj(data, "", _ENVELOPE | required, optional)
    else:
        required, optional = _FIELDS[kind]
        unknown = []
        d = _obj(data, "", _ENVELOPE | required, optional | _ENVELOPE_OPTIONAL, unknown)
        must = _must_understand(d.get("must_understand"))
    reporter = _reporter(d["reporter"], unknown)
    sent_at = _num(d["sent_at"], "sent_at")
    if kind == "heartbeat":
        seconds = d.get("check_seconds", {})
        if not isinstance(seconds, dict):
            raise ProtocolError("check_seconds", f"must be an object, got {_kind(seconds)}")
        _no_duplicates(seconds, "check_seconds")
        for name in seconds:
            _choice(name, f"check_seconds.{name}", CHECKS)
        step = _int(d["step"], "step")
        report: Report = HeartbeatReport(
            reporter=reporter,
            sent_at=sent_at,
            step=step,
            last_clean_step=_clean_step(d["last_clean_step"], step),
            check_seconds={k: _num(v, f"check_seconds.{k}") for k, v in seconds.items()},
            interval_seconds=_opt_num(d.get("interval_seconds"), "interval_seconds"),
            fingerprint_kernel=(
                None
                if d.get("fingerprint_kernel") is None
                else _choice(d["fingerprint_kernel"], "fingerprint_kernel", FINGERPRINT_KERNELS)
            ),
            gradient_tolerance=_opt_num(d.get("gradient_tolerance"), "gradient_tolerance"),
            bit_reproducible=_bool(d.get("bit_reproducible"), "bit_reproducible", nullable=True),
            run_id=_run_id(d.get("run_id")),
            replay_dtype=_str(d.get("replay_dtype"), "replay_dtype", limit=32, nullable=True),
            replay_cap=_opt_num(d.get("replay_cap"), "replay_cap"),
            replay_kinds=_replay_kinds(d.get("replay_kinds"), unknown),
            unreported=_unreported(d.get("unreported")),
            version=version,
        )
    elif kind == "resume":
        report = ResumeReport(
            reporter=reporter,
            sent_at=sent_at,
            step=_int(d["step"], "step"),
            location=_str(d.get("location"), "location", limit=_MAX_TEXT, nullable=True),
            version=version,
        )
    elif kind == "checkpoint":
        report = CheckpointReport(
            reporter=reporter,
            sent_at=sent_at,
            step=_int(d["step"], "step"),
            location=_req_str(d["location"], "location", _MAX_TEXT),
            verified=bool(_bool(d["verified"], "verified")),
            version=version,
        )
    else:
        report = _verdict(d, reporter, sent_at, unknown, version)
    if unknown:
        for path in unknown:
            if path in must:
                raise ProtocolError(
                    path,
                    f"is not understood by this side (protocol {PROTOCOL_VERSION}) and the "
                    "report lists it in must_understand",
                )
        if ignored is not None:
            ignored.extend(unknown)
    return report


def _verdict(
    d: dict[str, Any],
    reporter: ReporterIdentity,
    sent_at: float,
    unknown: list[str] | None,
    version: int,
) -> VerdictReport:
    step = _int(d["step"], "step", minimum=1)
    last_clean = _clean_step(d["last_clean_step"], step - 1)
    suspects = d["suspects"]
    if not isinstance(suspects, list):
        raise ProtocolError("suspects", f"must be an array, got {_kind(suspects)}")
    if len(suspects) > _MAX_SUSPECTS:
        raise ProtocolError("suspects", f"has more than {_MAX_SUSPECTS} entries")
    evidence = d.get("evidence", {})
    if not isinstance(evidence, dict):
        raise ProtocolError("evidence", f"must be an object, got {_kind(evidence)}")
    _json_value(evidence, "evidence")
    return VerdictReport(
        reporter=reporter,
        sent_at=sent_at,
        check=_choice(d["check"], "check", CHECKS),
        classification=_choice(d["classification"], "classification", CLASSIFICATIONS),
        step=step,
        last_clean_step=last_clean,
        localized=bool(_bool(d["localized"], "localized")),
        transient=_bool(d.get("transient"), "transient", nullable=True),
        suspects=tuple(_suspect(s, f"suspects[{i}]", unknown) for i, s in enumerate(suspects)),
        message=_req_str(d["message"], "message", _MAX_TEXT),
        evidence=evidence,
        corroborated=_bool(d.get("corroborated"), "corroborated", nullable=True),
        run_id=_run_id(d.get("run_id")),
        bundle=_str(d.get("bundle"), "bundle", limit=_MAX_TEXT, nullable=True),
        snapshot_step=_snapshot_step(d.get("snapshot_step"), last_clean),
        version=version,
    )


def _snapshot_step(value: Any, last_clean: int) -> int | None:
    if value is None:
        return None
    found = _int(value, "snapshot_step")
    if found > last_clean:
        raise ProtocolError(
            "snapshot_step", f"must be <= last_clean_step {last_clean}, got {found}"
        )
    return found


def _must_understand(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset()
    return frozenset(_names(value, "must_understand", MAX_MUST_UNDERSTAND))


def _replay_kinds(value: Any, unknown: list[str] | None) -> tuple[ReplayKind, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ProtocolError("replay_kinds", f"must be an array, got {_kind(value)}")
    if len(value) > MAX_REPLAY_KINDS:
        raise ProtocolError("replay_kinds", f"has more than {MAX_REPLAY_KINDS} entries")
    out = []
    for i, item in enumerate(value):
        path = f"replay_kinds[{i}]"
        d = _obj(item, path, {"kind", "threshold", "noise"}, {"blind"}, unknown)
        out.append(
            ReplayKind(
                kind=_req_str(d["kind"], f"{path}.kind", _MAX_NAME),
                threshold=_opt_num(d["threshold"], f"{path}.threshold"),
                noise=_num(d["noise"], f"{path}.noise"),
                blind=bool(_bool(d.get("blind", False), f"{path}.blind")),
            )
        )
    if len({k.kind for k in out}) != len(out):
        raise ProtocolError("replay_kinds", "names a kind more than once")
    return tuple(out)


def _unreported(value: Any) -> tuple[str, ...]:
    return () if value is None else _names(value, "unreported", MAX_UNREPORTED)


def _names(value: Any, path: str, most: int) -> tuple[str, ...]:
    """An array of distinct field names (paths such as ``reporter.zone``)."""
    if not isinstance(value, list):
        raise ProtocolError(path, f"must be an array, got {_kind(value)}")
    if len(value) > most:
        raise ProtocolError(path, f"has more than {most} entries")
    for i, name in enumerate(value):
        _req_str(name, f"{path}[{i}]", 128)
    if len(set(value)) != len(value):
        raise ProtocolError(path, "names a field more than once")
    return tuple(value)


def _opt_num(value: Any, path: str) -> float | None:
    return None if value is None else _num(value, path)


def _run_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _RUN_ID.match(value):
        raise ProtocolError(
            "run_id",
            "must be 1 to 64 letters, digits, '.', '_' or '-', starting with one of the first two",
        )
    return value


class _Object(dict[str, Any]):
    """A decoded JSON object that remembers keys given more than once (JSON allows it,
    ``json.loads`` keeps the last one silently; a report that says ``"kind"`` twice must
    not mean whichever a parser happens to keep)."""

    duplicates: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        repeated: list[str] = []
        for key, _ in pairs:
            if key in seen and key not in repeated:
                repeated.append(key)
            seen.add(key)
        obj.duplicates = tuple(repeated)
    return obj


def _no_duplicates(value: Any, path: str) -> None:
    for key in getattr(value, "duplicates", ()):
        raise ProtocolError(_join(path, key), "is given more than once")


def _json_value(value: Any, path: str, depth: int = 0) -> None:
    """``value`` is plain JSON (objects with string keys, arrays, scalars), not too deep."""
    if depth > _MAX_DEPTH:
        raise ProtocolError(path, f"is nested more than {_MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError(path, "must not hold NaN or infinity")
        return
    if isinstance(value, dict):
        _no_duplicates(value, path)
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(path, f"has a key that is not a string: {key!r}")
            _json_value(item, _join(path, key), depth + 1)
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _json_value(item, f"{path}[{i}]", depth + 1)
        return
    raise ProtocolError(path, f"must be plain JSON, got {_kind(value)}")


def _clean_step(value: Any, most: int) -> int:
    step = _int(value, "last_clean_step")
    if step > most:
        raise ProtocolError("last_clean_step", f"must be <= {most}, got {step}")
    return step


def _reject_constant(name: str) -> Any:
    raise ProtocolError("report", f"is not valid JSON ({name} is not a JSON number)")


# Optional fields added after the first release: left out when unset, so a report that
# does not use them reads exactly as it did.
_OMITTED_WHEN_NULL = (
    "corroborated",
    "run_id",
    "bundle",
    "snapshot_step",
    "interval_seconds",
    "fingerprint_kernel",
    "gradient_tolerance",
    "bit_reproducible",
    "replay_dtype",
    "replay_cap",
)
_OMITTED_WHEN_EMPTY = ("unreported", "replay_kinds")


def encode_report(
    report: Report, *, version: int | None = None, left_out: list[str] | None = None
) -> bytes:
    """The report as compact JSON bytes in protocol ``version`` (one of
    :data:`ACCEPTED_VERSIONS`; default: the report's own ``version``, which is
    :data:`PROTOCOL_VERSION` unless it was read from an older report); raises
    :class:`ProtocolError` for anything the receiving side would refuse (too large, too long
    a message, too many suspects). Written as version 1, the fields version 1 does not have
    are left out, and named in ``left_out``."""
    if version is None:
        version = report.version
    if version not in ACCEPTED_VERSIONS:
        raise ProtocolError("version", f"cannot write protocol version {version!r}")
    body = asdict(report)
    body["version"] = version
    if isinstance(report, VerdictReport):
        body["suspects"] = [asdict(s) for s in report.suspects]
    for key in _OMITTED_WHEN_NULL:
        if key in body and body[key] is None:
            del body[key]
    for key in _OMITTED_WHEN_EMPTY:
        if key in body and not body[key]:
            del body[key]
    if version == 1:
        required, optional = _V1_FIELDS[report.kind]
        for key in sorted(set(body) - _ENVELOPE - required - optional):
            del body[key]
            if left_out is not None:
                left_out.append(key)
    try:
        data = json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ProtocolError("report", f"cannot be encoded as JSON ({exc})") from None
    parse_report(data)  # what the operator would refuse must not leave here
    return data


# -- JSON Schema -----------------------------------------------------------------------------


def report_schema() -> dict[str, Any]:
    """The protocol as a JSON Schema (draft 2020-12): what a sender of this release writes,
    in either version. The same rules as :func:`parse_report` except the cross-field ones
    (``last_clean_step`` below ``step``, the size limit, which fields version 1 lacks) and
    a version-2 receiver's leniency: it ignores unknown fields not in ``must_understand``."""
    count = {"type": "integer", "minimum": 0}
    name = {"type": "string", "minLength": 1, "maxLength": _MAX_NAME}
    nullable_name = {"type": ["string", "null"], "minLength": 1, "maxLength": _MAX_NAME}
    envelope = {
        "version": {"enum": list(ACCEPTED_VERSIONS)},
        "must_understand": {
            "type": "array",
            "maxItems": MAX_MUST_UNDERSTAND,
            "uniqueItems": True,
            "items": {"type": "string", "minLength": 1, "maxLength": 128},
        },
        "sent_at": {"type": "number", "minimum": 0},
        "reporter": {
            "type": "object",
            "additionalProperties": False,
            "required": ["rank", "node"],
            "properties": {"rank": count, "node": name, "pod": nullable_name},
        },
    }

    def kind(label: str, required: list[str], props: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "additionalProperties": False,
            "required": ["version", "kind", "sent_at", "reporter", *required],
            "properties": {**envelope, "kind": {"const": label}, **props},
        }

    text = {"type": "string", "minLength": 1, "maxLength": _MAX_TEXT}
    run_id = {"type": ["string", "null"], "pattern": _RUN_ID.pattern}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://hyperpod-sdc.dev/schemas/report-v2.json",
        "title": "hyperpod-sdc report",
        "oneOf": [
            kind(
                "verdict",
                [
                    "check",
                    "classification",
                    "step",
                    "last_clean_step",
                    "localized",
                    "suspects",
                    "message",
                ],
                {
                    "check": {"enum": list(CHECKS)},
                    "classification": {"enum": list(CLASSIFICATIONS)},
                    "step": {"type": "integer", "minimum": 1},
                    "last_clean_step": count,
                    "localized": {"type": "boolean"},
                    "transient": {"type": ["boolean", "null"]},
                    "suspects": {
                        "type": "array",
                        "maxItems": _MAX_SUSPECTS,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["rank", "node", "local_rank"],
                            "properties": {
                                "rank": count,
                                "node": name,
                                "local_rank": count,
                                "pod": nullable_name,
                                "gpu_uuid": {
                                    "type": ["string", "null"],
                                    "minLength": 1,
                                    "maxLength": 128,
                                },
                            },
                        },
                    },
                    "message": text,
                    "evidence": {"type": "object"},
                    "corroborated": {"type": ["boolean", "null"]},
                    "run_id": run_id,
                    "bundle": {"type": ["string", "null"], "minLength": 1, "maxLength": _MAX_TEXT},
                    "snapshot_step": {"type": ["integer", "null"], "minimum": 0},
                },
            ),
            kind(
                "heartbeat",
                ["step", "last_clean_step"],
                {
                    "step": count,
                    "last_clean_step": count,
                    "check_seconds": {
                        "type": "object",
                        "propertyNames": {"enum": list(CHECKS)},
                        "additionalProperties": {"type": "number", "minimum": 0},
                    },
                    "interval_seconds": {"type": ["number", "null"], "minimum": 0},
                    "fingerprint_kernel": {"enum": [*FINGERPRINT_KERNELS, None]},
                    "gradient_tolerance": {"type": ["number", "null"], "minimum": 0},
                    "bit_reproducible": {"type": ["boolean", "null"]},
                    "run_id": run_id,
                    "replay_dtype": {"type": ["string", "null"], "minLength": 1, "maxLength": 32},
                    "replay_cap": {"type": ["number", "null"], "minimum": 0},
                    "replay_kinds": {
                        "type": "array",
                        "maxItems": MAX_REPLAY_KINDS,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["kind", "threshold", "noise"],
                            "properties": {
                                "kind": name,
                                "threshold": {"type": ["number", "null"], "minimum": 0},
                                "noise": {"type": "number", "minimum": 0},
                                "blind": {"type": "boolean"},
                            },
                        },
                    },
                    "unreported": {
                        "type": "array",
                        "maxItems": MAX_UNREPORTED,
                        "uniqueItems": True,
                        "items": {"type": "string", "minLength": 1, "maxLength": 128},
                    },
                },
            ),
            kind(
                "checkpoint",
                ["step", "location", "verified"],
                {"step": count, "location": text, "verified": {"type": "boolean"}},
            ),
            kind(
                "resume",
                ["step"],
                {
                    "step": count,
                    "location": {
                        "type": ["string", "null"],
                        "minLength": 1,
                        "maxLength": _MAX_TEXT,
                    },
                },
            ),
        ],
    }


if __name__ == "__main__":
    json.dump(report_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
