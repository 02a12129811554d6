"""CPU per test file: what each file costs the suite's parallel pass on a 2-core machine.

The parallel pass (scripts/test.sh: four pytest processes on two cores) is CPU-bound, so
its wall time is set by the CPU seconds of each file, and its tail by a long file that
starts late. ``--durations`` gives wall seconds only, and leaves out the CPU of the
processes a test starts. This bench runs each file alone, in its own pytest process with
the parallel pass's marker expression (``not timing``), and counts the CPU time of the
whole process tree: pytest, its fork servers, their ranks and every operator (on Linux it
reaps them as a child subreaper, as bench/clean_runs.py does). Prints JSON, files ranked
by CPU.

    .venv/bin/python -m bench.suite_cpu tests/distributed/test_bf16.py tests/e2e ...

A folder stands for each of its ``test_*.py`` files, one run each. Each run starts its own
pytest (about 2 s of CPU; integration files also their own API server), which the parallel
pass shares between the files of one process: compare files, not sums with the suite's.
Run it under the CPU lock on the shared machine; its figures are only comparable within
one run, or with the machine's load the output reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.clean_runs import PYTEST, ROOT, _cpu, _reap, _subreaper

MARKERS = "not timing"
"""The parallel pass's selection (scripts/test.sh); the timing tests run one at a time."""


def files_of(args: list[str]) -> list[str]:
    out: list[str] = []
    for arg in args:
        path = ROOT / arg
        if path.is_dir():
            out += sorted(str(p.relative_to(ROOT)) for p in path.glob("test_*.py"))
        elif path.is_file():
            out.append(arg)
        else:
            raise SystemExit(f"suite_cpu: {arg}: no such test file or folder under {ROOT}")
    return out


def run_file(test_file: str, markers: str) -> dict[str, Any]:
    cpu = _cpu()
    start = time.perf_counter()
    proc = subprocess.run(
        [*PYTEST, "-m", markers, test_file],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    _reap(30.0)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    out: dict[str, Any] = {
        "file": test_file,
        "cpu_seconds": round(_cpu() - cpu, 1),
        "seconds": round(seconds, 1),
        "pytest_exit": proc.returncode,
        "summary": summary,
        "load_average": round(os.getloadavg()[0], 1),
    }
    if proc.returncode not in (0, 5):  # 5: nothing selected (a file of timing tests only)
        out["output_tail"] = proc.stdout[-3000:] + proc.stderr[-1000:]
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="test files or folders, relative to the root")
    parser.add_argument("-m", dest="markers", default=MARKERS, help=f"default: {MARKERS!r}")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    subreaper = _subreaper()
    results = [run_file(f, args.markers) for f in files_of(args.paths)]
    results.sort(key=lambda r: -r["cpu_seconds"])
    print(
        json.dumps(
            {
                "benchmark": "suite_cpu",
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "commit": commit,
                "markers": args.markers,
                "cpus": os.cpu_count(),
                "ranks_counted_in_cpu_seconds": subreaper,
                "total_cpu_seconds": round(sum(r["cpu_seconds"] for r in results), 1),
                "files": results,
            },
            indent=2,
        )
    )
    return 0 if all(r["pytest_exit"] in (0, 5) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
