"""The README's examples run as documented, under torch's own launcher in fresh
interpreters, and exit 0: their teardown ends the process group, so no gloo thread is left
running at interpreter exit. The quickstart's drill runs in workers forked with torchrun's
env (its start-up is the clean run's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdc_harness import zygote

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def run(
    env_extra: dict[str, str], nproc: int = 2, script: str = "quickstart.py"
) -> subprocess.CompletedProcess[str]:
    """The example under torchrun, through run_example.py (which also checks that no gloo
    thread outlived the example's teardown). A rank that aborts shows every thread's
    Python stack (faulthandler)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env_extra}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            str(Path(__file__).with_name("run_example.py")),
            str(ROOT / "examples" / script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def finished(proc: subprocess.CompletedProcess[str]) -> None:
    """Every rank exited 0 with no exception and no gloo thread left behind."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "gloo threads left" not in proc.stderr, proc.stderr


def test_quickstart_runs_clean() -> None:
    proc = run({})
    finished(proc)
    assert "done: last clean step 40" in proc.stdout
    assert "step" not in proc.stdout.replace("done: last clean step", "")


def test_quickstart_drill_from_the_environment_is_caught(tmp_path: Path) -> None:
    """The quickstart's drill (its docstring's HYPERPOD_SDC_FAULTS) in 3 workers with the
    env torchrun gives them, each forked from a process that imported torch once
    (``sdc_harness.zygote``: about 11 s of CPU less than a fourth torchrun here, its
    launcher and three fresh interpreters, whose start-up the three tests of the README's
    commands show). Three replicas, so a majority can name the odd one out."""
    faults = {"HYPERPOD_SDC_FAULTS": "rank=1,step=12,site=weights,kind=bitflip,bit=3"}
    command = [
        sys.executable,
        str(Path(__file__).with_name("run_example.py")),
        str(ROOT / "examples" / "quickstart.py"),
    ]
    ended = zygote.run_world(
        command,
        lambda rank: {**os.environ, "OMP_NUM_THREADS": zygote.THREADS, **faults},
        tmp_path,
        world=3,
        per_node=3,
        port=zygote.listen_port(),
        timeout=180,
    )
    for rank, (code, out) in enumerate(ended):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        assert "Traceback" not in out and "gloo threads left" not in out, out
    out = ended[0][1]
    assert "rank 0: step 15: weights of rank(s) 1 differ" in out, out
    assert "done: last clean step 10" in out, out


# One three-rank run: about 14 s on 2 cores, nearly all of it starting torchrun and three
# ranks (torch, and the torch._dynamo that DDP imports); the 30 steps take under a second.
# A drill in the same loop form (phases, accumulation, clipping: a persistent finite
# forward error on one rank, caught at its step, that rank named, the step held back) is
# tests/distributed/test_loops.py's phases_accumulation; a drill set through
# HYPERPOD_SDC_FAULTS in the environment, test_quickstart_drill_from_the_environment_is_caught.
@pytest.mark.slow
def test_custom_loop_example_runs_clean() -> None:
    proc = run({}, nproc=3, script="custom_loop.py")
    finished(proc)
    assert "done: last clean step 30" in proc.stdout, proc.stdout + proc.stderr
    assert "step " not in proc.stdout.replace("done: last clean step", "")


@pytest.mark.slow  # transformers imported in three ranks: about 21 s on 2 cores
def test_huggingface_example_runs_clean() -> None:
    proc = run({}, nproc=3, script="huggingface_trainer.py")
    finished(proc)
    assert "done: 12 steps, 0 verdict(s)" in proc.stdout, proc.stdout + proc.stderr
