"""The previous release's operator as it was released, not a stand-in: its ``operator/`` and
``sidecar/`` trees from the repository's history (:data:`COMMIT`, the release before
protocol version 2, whose protocol module tests/previous_protocol.py records), run as
``python -m sdc_operator`` with only its own packages on the path: its intake, engine,
effects, SageMaker calls and election, against this release's CRDs (what ``helm rollback``
leaves: Helm never downgrades ``crds/``) and this release's incidents.

tests/integration/previous_operator.py is the stand-in the intake tests use (this
release's engine behind that release's intake check): it needs no history. Where the
history is missing (a shallow clone, a source archive) the tests that need this one are
skipped, saying so."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from sdc_harness.cluster import ROOT

__all__ = ["COMMIT", "Release", "THIS", "extract"]

COMMIT = "dd99bea74a5bafc3edc24c65f68f07b17e56cd24"
"""The last commit before protocol version 2 (3658b85): the previous release (dd99bea)."""


@dataclass(frozen=True)
class Release:
    """An operator release the tests can start (``start_operator(extra_env=release.env)``)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    """What the operator process's environment needs to run this release."""


THIS = Release("this")
"""This checkout's operator (the fixture's default)."""


def extract(into: Path) -> Release | str:
    """The previous release, extracted under ``into``; or why it cannot be (a reason to
    skip with)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", COMMIT, "operator", "sidecar"],
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return (
            f"needs the previous release's source, commit {COMMIT} of this repository's "
            f"history: {exc} {detail.decode(errors='replace').strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        # our own history: trusted; the filter exists from Python 3.10.12 and 3.11.4
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    path = os.pathsep.join(str(into / part) for part in ("operator", "sidecar"))
    # ahead of the editable install's finder, which would give this release's packages
    return Release("previous", {"PYTHONPATH": path})
