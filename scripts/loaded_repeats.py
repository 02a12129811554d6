"""Runs the timing-sensitive sets of tests N times with the machine loaded, and prints JSON
of how each test fared: the check behind "none fails with the other core busy".

    .venv/bin/python scripts/loaded_repeats.py --runs 20 [--busy 1] [--out FILE]

Each run is three pytest passes: tests/distributed/test_quickstart.py (the README's
examples under torchrun, which must exit 0), tests/distributed/test_noise.py and the
integration tests marked ``timing`` (deadlines, lease renewals, containment under floods).
While they run, ``--busy`` processes (default 1: on a 2-core machine, the other core)
spin in a busy loop; this script starts them before the first run and stops them after
the last, whatever happens. Exit status 1 if any test failed in any run. With ``--out``, the
file holds the JSON of the runs done so far after each run (``runs_done``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = {
    "quickstart": ["tests/distributed/test_quickstart.py"],
    "noise": ["tests/distributed/test_noise.py"],
    "integration_timing": ["tests/integration", "-m", "timing"],
}
BUSY = "while True:\n    pass\n"


def outcomes(report: Path) -> dict[str, str]:
    """test id -> passed, failed or skipped, from a JUnit XML report."""
    found: dict[str, str] = {}
    if not report.exists():
        return found
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            found[name] = "failed"
        elif "skipped" in kinds:
            found[name] = "skipped"
        else:
            found[name] = "passed"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes (default 1)")
    parser.add_argument(
        "--sets", default=",".join(SETS), help="comma-separated: " + ", ".join(SETS)
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    chosen = [s for s in args.sets.split(",") if s]
    unknown = [s for s in chosen if s not in SETS]
    if unknown:
        parser.error(f"--sets: unknown {unknown}; choose from {list(SETS)}")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    results: dict[str, dict[str, dict[str, int]]] = {s: {} for s in chosen}
    failures: list[dict[str, object]] = []
    wall: dict[str, float] = {s: 0.0 for s in chosen}
    started = time.monotonic()

    def summary(done: int) -> dict[str, object]:
        return {
            "runs": args.runs,
            "runs_done": done,
            "busy_loops": args.busy,
            "cpus": os.cpu_count(),
            "seconds": round(time.monotonic() - started),
            "seconds_per_set": {k: round(v) for k, v in wall.items()},
            "totals": {
                name: {
                    kind: sum(c[kind] for c in tests.values())
                    for kind in ("passed", "failed", "skipped")
                }
                for name, tests in results.items()
            },
            "tests": results,
            "failures": failures,
        }

    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory(prefix="loaded-repeats-") as tmp:
            for run in range(1, args.runs + 1):
                for name in chosen:
                    report = Path(tmp) / f"{name}-{run}.xml"
                    began = time.monotonic()
                    done = subprocess.run(
                        [
                            sys.executable,
                            "-m",
                            "pytest",
                            "-q",
                            "-p",
                            "no:cacheprovider",
                            f"--junitxml={report}",
                            *SETS[name],
                        ],
                        cwd=ROOT,
                        env=env,
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    wall[name] += time.monotonic() - began
                    found = outcomes(report)
                    if done.returncode not in (0, 1) or not found:
                        # pytest itself failed (collection, an internal error): say so
                        found = {f"{name} (pytest exit {done.returncode})": "failed"}
                    for test, outcome in found.items():
                        counts = results[name].setdefault(
                            test, {"passed": 0, "failed": 0, "skipped": 0}
                        )
                        counts[outcome] += 1
                        if outcome == "failed":
                            failures.append({"run": run, "test": test, "tail": done.stdout[-3000:]})
                    print(
                        f"run {run}/{args.runs} {name}: exit {done.returncode}, "
                        f"{time.monotonic() - began:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                if args.out:  # what is done so far, readable while it runs
                    args.out.write_text(json.dumps(summary(run), indent=2) + "\n")
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    text = json.dumps(summary(args.runs), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
