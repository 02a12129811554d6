"""examples/train_fsdp.py as a job runs it: HSDP on 3 emulated nodes x 2 ranks (replicate 3,
shard 2), a GPU that computes wrong on one of them, sharded (DCP) checkpoints marked by the
checks, then the resume the operator would order on the 2 nodes left (4 ranks, replicate 2):
the newest verified checkpoint at or before HYPERPOD_SDC_RESUME_MAX_STEP, loaded resharded,
its state equal to what was saved."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from sdc_harness import zygote

# slow: two worlds of 6 and 4 processes started as a job starts them (25 s on 2 cores, loaded)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
EVERY = 4
# A persistent error of 2.5e-5 in rank 3's middle layer's output, from step 7.
FAULT = "rank=3,step=7,site=forward,kind=relative,persistent=true,target=2,index=all"
CHECKS = {
    "HYPERPOD_SDC_REPLAY_EVERY": "1",
    "HYPERPOD_SDC_WEIGHTS_EVERY": "1",
    "HYPERPOD_SDC_FINGERPRINT_BACKEND": "eager",
    # The periodic checkpoints' verification and resume (the snapshot at a detection, which
    # stops the job, is the e2e demo's HSDP variant: tests/e2e/test_demo.py).
    "HYPERPOD_SDC_SNAPSHOT_COPIES": "0",
}


def job(
    nodes: int, ckpt: Path, result: Path, env_extra: dict[str, str], per_node: int = 2
) -> tuple[int, str]:
    """The example on ``nodes`` x ``per_node`` processes, each with the env torchrun and
    the pod give it (RANK ..., NODE_NAME), through run_example.py (no gloo thread may
    outlive the teardown). Returns the worst exit code and rank 0's output.

    Each process is forked from one that imported torch once (``sdc_harness.zygote``, as the
    demo's kubelet stand-in starts a pod's workers): about 3 s of CPU less per process, 10
    processes here. The example runs from the start in each process; only the fork server's
    imports are inherited: torch's, and the agent's where the agent's spawn_local started
    this pytest process's fork server first. Either way each process runs one intra-op
    thread, as under OMP_NUM_THREADS=1 (tests/distributed/test_zygote.py). A fresh interpreter's
    start-up under torchrun is tested for the README's examples
    (tests/distributed/test_quickstart.py), not for this one."""
    world = nodes * per_node
    command = [
        sys.executable,
        str(Path(__file__).with_name("run_example.py")),
        str(ROOT / "examples" / "train_fsdp.py"),
        "--layout",
        "hsdp",
        "--steps",
        str(STEPS),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(EVERY),
        "--result-file",
        str(result),
    ]

    def env(rank: int) -> dict[str, str]:
        return {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "NODE_NAME": f"node-{rank // per_node}",
            **CHECKS,
            **env_extra,
        }

    ended = zygote.run_world(
        command,
        env,
        result.with_suffix(".logs"),
        world,
        per_node,
        zygote.listen_port(),
        timeout=240,
    )
    codes = [code for code, _ in ended]
    outputs = [out for _, out in ended]
    # A rank still running after 240 s fails with every rank's output (where it stopped).
    assert None not in codes, "ranks still running after 240 s: " + "".join(
        f"\n-- rank {r} ({'running' if c is None else f'exit {c}'}):\n{out[-3000:]}"
        for r, (c, out) in enumerate(ended)
    )
    for rank, (code, out) in enumerate(zip(codes, outputs, strict=True)):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        assert "Traceback" not in out, f"rank {rank}:\n{out}"
    return max(c or 0 for c in codes), outputs[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("fsdp_example")
    ckpt = base / "ckpt"
    _, first_out = job(3, ckpt, base / "first.json", {"HYPERPOD_SDC_FAULTS": FAULT})
    first = json.loads((base / "first.json").read_text())
    # What the operator sets: the incident's last clean step.
    _, resumed_out = job(2, ckpt, base / "resumed.json", {"HYPERPOD_SDC_RESUME_MAX_STEP": "6"})
    resumed = json.loads((base / "resumed.json").read_text())
    return {"first": first, "first_out": first_out, "resumed": resumed, "resumed_out": resumed_out}


def test_the_faulty_gpu_is_caught_and_its_checkpoint_is_not_verified(
    runs: dict[str, Any],
) -> None:
    out = runs["first_out"]
    assert "layout hsdp over mesh ('replicate', 'shard')" in out, out
    assert "step 7: rank(s) 3 computed a wrong result" in out, out
    assert "checkpoint step_4: verified True" in out, out
    assert "checkpoint step_8: verified False" in out, out
    assert runs["first"]["last_clean_step"] == 6
    assert runs["first"]["world"] == 6


def test_the_resume_on_two_nodes_loads_the_verified_state_it_saved(runs: dict[str, Any]) -> None:
    resumed = runs["resumed"]
    assert resumed["world"] == 4
    # Step 8's checkpoint is newer than the resume step and not verified: step 4's it is.
    assert resumed["loaded"]["step"] == 4
    assert resumed["loaded"]["sha256"] == runs["first"]["checkpoints"]["4"]
    # The same job on 2 nodes trains on, and names nobody.
    out = runs["resumed_out"]
    assert "layout hsdp over mesh ('replicate', 'shard')" in out, out
    assert " computed a wrong result" not in out, out
    assert "checkpoint step_8: verified True" in out, out
    assert resumed["last_clean_step"] == STEPS
