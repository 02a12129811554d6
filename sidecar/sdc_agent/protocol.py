"""The wire protocol, defined once in the torch-free :mod:`sdc_common.protocol` (shared with
the operator) and re-exported here so ``sdc_agent.protocol`` keeps working.
``python -m sdc_agent.protocol`` prints the JSON Schema, as ``python -m sdc_common.protocol``
does."""

from __future__ import annotations

import json
import sys

from sdc_common.protocol import (
    ACCEPTED_VERSIONS,
    CHECKS,
    CLASSIFICATIONS,
    FINGERPRINT_KERNELS,
    KINDS,
    MAX_MESSAGE,
    MAX_REPLAY_KINDS,
    MAX_REPORT_BYTES,
    MAX_SUSPECTS,
    PREVIOUS_PROTOCOL_VERSION,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    CheckpointReport,
    HeartbeatReport,
    ReplayKind,
    Report,
    ReporterIdentity,
    ResumeReport,
    Suspect,
    VerdictReport,
    encode_report,
    parse_report,
    report_schema,
)

__all__ = [
    "ACCEPTED_VERSIONS",
    "CHECKS",
    "CLASSIFICATIONS",
    "FINGERPRINT_KERNELS",
    "KINDS",
    "MAX_MESSAGE",
    "MAX_REPLAY_KINDS",
    "MAX_REPORT_BYTES",
    "MAX_SUSPECTS",
    "PREVIOUS_PROTOCOL_VERSION",
    "PROTOCOL_HEADER",
    "PROTOCOL_VERSION",
    "CheckpointReport",
    "HeartbeatReport",
    "ReplayKind",
    "Report",
    "ReporterIdentity",
    "ResumeReport",
    "Suspect",
    "VerdictReport",
    "encode_report",
    "parse_report",
    "report_schema",
]

if __name__ == "__main__":
    json.dump(report_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
