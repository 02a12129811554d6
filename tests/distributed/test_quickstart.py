"""The README's example runs as documented, under torch's own launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def run(env_extra: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            str(ROOT / "examples" / "quickstart.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_quickstart_runs_clean() -> None:
    proc = run({})
    assert proc.returncode == 0, proc.stderr
    assert "done: last clean step 40" in proc.stdout
    assert "step" not in proc.stdout.replace("done: last clean step", "")


def test_quickstart_drill_from_the_environment_is_caught() -> None:
    # Three replicas, so a majority can name the odd one out.
    proc = run({"HYPERPOD_SDC_FAULTS": "rank=1,step=12,site=weights,kind=bitflip,bit=3"}, nproc=3)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: step 15: weights of rank(s) 1 differ" in proc.stdout
    assert "done: last clean step 10" in proc.stdout
