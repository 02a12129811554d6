"""The long clean runs: 200 steps under each check, noise and layout, nobody named.

Issues 13, 21 and 26 asked for clean runs of 200 steps: no healthy rank named, (almost) every
step applied, checkpoints still verified, guarded training bitwise equal to unguarded. The
suite trains those runs shorter (enough for several audit intervals and every check kind, see
each test's docstring); this bench runs the **same tests, with the same assertions**, at 200
steps: it sets ``HYPERPOD_SDC_LONG_CLEAN_RUNS=1`` (``tests/distributed/drills.py``'s
``clean_steps``) and runs pytest on them. Prints JSON: each test, its outcome and seconds,
and the steps each of its long runs trained as the ranks report them (``steps_trained``,
which each test records in the JUnit XML and asserts to be 200 under that variable); a test
that shows fewer, or none, fails the bench. ``uncommitted_changes`` lists modified and
untracked files.

    .venv/bin/python bench/clean_runs.py [--only bf16,fsdp,...] > bench/results/clean-runs-….json

Each file's tests share one spawn that also runs the file's other (short) scenarios, so a
group's seconds are its whole file's, not the long runs' alone. ``cpu_seconds`` is the CPU
time of the group's whole process tree (pytest, its fork server and every rank: on Linux the
bench reaps them as a child subreaper; elsewhere the ranks are not counted). The exit status
is 1 if any test failed. What each group runs (CPU, gloo, the drill's models; the noise
emulated in torch):

- ``bf16``: six ranks on three nodes, bf16 autocast, the MLP and the GPT-2 under forward and
  backward noise, an audit every 5 steps (tests/distributed/test_bf16.py);
- ``fsdp``: FSDP2 and HSDP over six ranks, the weight or update check every step and an audit
  every 5, each against the same run unguarded (tests/distributed/test_fsdp.py);
- ``replay``: six ranks on three nodes, an audit and check 3 every step, dropout on
  (tests/distributed/test_replay.py);
- ``noise``: three nodes, gradient noise in three elements or every element of a layer, an
  audit every 3 steps (tests/distributed/test_noise.py);
- ``checks``: three ranks on two nodes, check 3 every step (tests/distributed/test_checks.py).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV = "HYPERPOD_SDC_LONG_CLEAN_RUNS"
STEPS = 200
STEPS_PROPERTY = "steps_trained:"
"""What each test records (``tests/distributed/drills.py``'s ``trained``): a clean run's
length as its ranks report it, by scenario."""
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
"""pytest in one process of its own (its CPU is counted), without xdist's workers."""
GROUPS: dict[str, list[str]] = {
    "bf16": [
        "tests/distributed/test_bf16.py::test_bf16_noise_alone_names_nobody_and_keeps_verifying",
    ],
    "fsdp": [
        "tests/distributed/test_fsdp.py::test_long_clean_runs_name_nobody_and_train_bitwise_like_plain_fsdp",
    ],
    "replay": ["tests/distributed/test_replay.py::test_clean_audited_steps_raise_nothing[3x2]"],
    "noise": [
        "tests/distributed/test_noise.py::test_run_to_run_noise_accuses_nobody_and_drops_no_step",
        "tests/distributed/test_noise.py::test_dense_gradient_noise_is_quiet_and_every_step_applied",
    ],
    "checks": ["tests/distributed/test_checks.py::test_clean_runs_raise_nothing[3]"],
}


def _subreaper() -> bool:
    """Become the parent of orphaned descendants (the fork server pytest leaves at its exit,
    whose ranks it reaped), so that their CPU time is counted in ours."""
    try:
        return ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_group(name: str, tests: list[str]) -> dict[str, Any]:
    env = {**os.environ, ENV: "1"}
    cpu = _cpu()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        proc = subprocess.run(
            [
                *PYTEST,
                f"--junitxml={report}",  # xunit1 (pyproject.toml): steps_trained recorded
                *tests,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - start
        _reap(30.0)
        cases = []
        if report.exists():
            for case in ET.parse(report).iter("testcase"):
                outcome = "passed"
                for child in case:
                    if child.tag in ("failure", "error", "skipped"):
                        outcome = {"failure": "failed"}.get(child.tag, child.tag)
                steps = {
                    str(p.get("name")).removeprefix(STEPS_PROPERTY): int(p.get("value", "0"))
                    for p in case.iter("property")
                    if str(p.get("name")).startswith(STEPS_PROPERTY)
                }
                cases.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "outcome": outcome,
                        "seconds": round(float(case.get("time", 0.0)), 1),
                        "steps_trained": steps,
                        "trained_all_steps": bool(steps)
                        and all(n == STEPS for n in steps.values()),
                    }
                )
    out: dict[str, Any] = {
        "group": name,
        "pytest_exit": proc.returncode,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(_cpu() - cpu, 1),
        "tests": cases,
    }
    if proc.returncode != 0:
        out["output_tail"] = proc.stdout[-4000:] + proc.stderr[-2000:]
    return out


def passed(results: list[dict[str, Any]]) -> bool:
    """Every group's pytest passed, and each test passed and recorded runs of :data:`STEPS`
    steps (a test that records none, or fewer, did not show the length)."""
    return all(
        g["pytest_exit"] == 0
        and g["tests"]
        and all(t["outcome"] == "passed" and t["trained_all_steps"] for t in g["tests"])
        for g in results
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated groups of {list(GROUPS)}")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(GROUPS)
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        parser.error(f"--only: unknown group(s) {unknown}; expected some of {list(GROUPS)}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    subreaper = _subreaper()
    results = [run_group(n, GROUPS[n]) for n in names]
    print(
        json.dumps(
            {
                "benchmark": "clean_runs",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit,
                "uncommitted_changes": sorted(line[3:] for line in changed if line.strip()),
                "command": "bench/clean_runs.py" + (f" --only {args.only}" if args.only else ""),
                "steps": STEPS,
                "cpus": os.cpu_count(),
                "ranks_counted_in_cpu_seconds": subreaper,
                "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
                "python": platform.python_version(),
                "groups": results,
                "all_passed": passed(results),
            },
            indent=2,
        )
    )
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
