"""The confirmation run (``python -m sdc_agent.confirm``): a bundle written by an
audit-like flow in a real training script, recomputed where the emulated GPU is still
broken (confirmed) and where it is not (not confirmed); damaged, missing and incomplete
bundles (unknown, with the reason); a factory-built model; the pure decisions."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sdc_agent.bundle import BundleSettings, Tolerance, read_bundle, recompute, reference_of
from sdc_agent.confirm import (
    EXIT_CODES,
    TERMINATION_LOG_LIMIT,
    Slot,
    compact_summary,
    compare,
    confirm,
    decide,
    gemm_stress,
    judge_stress,
    main,
    run_dcgmi,
    suspect_slot,
)
from sdc_agent.protocol import Suspect
from sdc_agent.replay import Payload

from .test_bundle import CPU, Net, healthy, make_batch, snapshot, written
from .training_script import FAULT

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "unit" / "training_script.py"
FAULTS_ENV = "HYPERPOD_SDC_FAULTS"
QUICK: dict[str, Any] = {"dcgmi": False, "stress_size": 64}


def train(out: Path, mode: str) -> Path:
    """Run the stand-in training script; the bundle its healthy replayer wrote."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "sidecar")},
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    (out / "main-ran").unlink()
    return Path(info["bundle"])


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("job")
    return {"pickle": train(out / "a", "pickle"), "factory": train(out / "b", "factory")}


def run_confirm(bundle: Path, tmp_path: Path, faults: str | None) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    if faults is not None:
        env[FAULTS_ENV] = faults
    log = tmp_path / "termination-log"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdc_agent.confirm",
            str(bundle),
            "--json",
            str(tmp_path / "out.json"),
            "--termination-log",
            str(log),
            "--stress-size",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,  # not the repository: the bundle's own sys.path must find the script
    )
    result = json.loads(done.stdout)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    summary = log.read_bytes()
    assert len(summary) <= TERMINATION_LOG_LIMIT
    brief = json.loads(summary)
    assert (brief["outcome"], brief["gpus"][0]["result"]) == (
        result["outcome"],
        result["gpus"][0]["result"],
    )
    assert done.returncode == EXIT_CODES[result["outcome"]]
    return done.returncode, result


def test_confirmed_where_the_emulated_gpu_is_still_broken(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    rc, result = run_confirm(bundles["pickle"], tmp_path, FAULT)
    assert (rc, result["outcome"]) == (3, "confirmed")
    (gpu,) = result["gpus"]
    assert (gpu["device"], gpu["local_rank"], gpu["rank"], gpu["suspect"]) == ("cpu", 1, 3, True)
    assert gpu["result"] == "reproduces"
    # The very bits the suspect computed in training came back, every time.
    assert [r["outcome"] for r in gpu["replay"]["repeats"]] == ["suspect"] * 3
    assert gpu["replay"]["emulated_faults"], "an emulated fault must be visible in the result"
    assert gpu["stress"]["result"] == "pass"
    assert result["dcgmi"] == {
        "ran": False,
        "skipped": "dcgmi is not on PATH (no DCGM in this image)",
    }
    assert (result["step"], result["run_id"], result["suspect"]["rank"]) == (30, "run-7", 3)
    assert "GPU 0 (local rank 1)" in result["reason"]
    assert not (bundles["pickle"].parents[2] / "main-ran").exists(), "main() must not run"


def test_not_confirmed_on_a_healthy_node(bundles: dict[str, Path], tmp_path: Path) -> None:
    rc, result = run_confirm(bundles["pickle"], tmp_path, None)
    assert (rc, result["outcome"]) == (0, "not-confirmed")
    (gpu,) = result["gpus"]
    assert gpu["result"] == "does-not-reproduce"
    assert [r["outcome"] for r in gpu["replay"]["repeats"]] == ["reference"] * 3
    assert "emulated_faults" not in gpu["replay"]
    assert all(r["seconds"] > 0 for r in gpu["replay"]["repeats"])


def test_a_fault_aimed_at_another_rank_is_not_this_gpus(bundles: dict[str, Path]) -> None:
    # In this process: the command line's exit code for not-confirmed (0) is the test
    # above's, and a fresh process costs about 5 s of CPU (torch's imports).
    aimed = FAULT.replace("rank=3", "rank=5")
    result = confirm(bundles["pickle"], env={FAULTS_ENV: aimed}, stress_size=64)
    assert (result["outcome"], result["exit_code"]) == ("not-confirmed", 0)
    assert result["gpus"][0]["result"] == "does-not-reproduce"


def test_a_factory_built_model(bundles: dict[str, Path], tmp_path: Path) -> None:
    bundle = read_bundle(bundles["factory"])
    assert bundle.manifest["model"]["how"] == "factory"
    assert "module.pt" not in bundle.manifest["files"]
    rc, result = run_confirm(bundles["factory"], tmp_path, FAULT)
    assert (rc, result["outcome"]) == (3, "confirmed")
    assert [r["outcome"] for r in result["gpus"][0]["replay"]["repeats"]] == ["suspect"] * 3
    clean = confirm(bundles["factory"], env={}, **QUICK)
    assert clean["outcome"] == "not-confirmed", clean["reason"]


def test_a_damaged_or_missing_bundle_is_unknown_with_the_reason(
    bundles: dict[str, Path], tmp_path: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(bundles["pickle"], damaged)
    (damaged / "weights.pt").write_bytes(b"garbage")
    result = confirm(damaged, env={FAULTS_ENV: FAULT}, **QUICK)
    assert result["outcome"] == "unknown"
    assert result["reason"].startswith("bundle: files.weights.pt.bytes")
    assert result["exit_code"] == 4
    log = tmp_path / "log"
    rc = main([str(tmp_path / "nowhere"), "--termination-log", str(log), "--no-dcgmi"])
    assert rc == 4
    brief = json.loads(log.read_text())
    assert brief["outcome"] == "unknown" and "not a directory" in brief["reason"]


def test_waiting_for_a_bundle_still_being_written(tmp_path: Path) -> None:
    import threading

    later = tmp_path / "later"
    source = in_process_bundle(tmp_path / "src")
    shutil.copytree(source, tmp_path / ".later.tmp")
    # Renamed into place whole, as BundleWriter does.
    mover = threading.Timer(1.0, lambda: os.rename(tmp_path / ".later.tmp", later))
    mover.start()
    try:
        result = confirm(later, env={}, wait=30, **QUICK)
    finally:
        mover.join()
    assert result["outcome"] == "not-confirmed", result["reason"]
    never = confirm(tmp_path / "never", env={}, wait=0.5, **QUICK)
    assert never["outcome"] == "unknown" and "after 0.5 s" in never["reason"]


def test_an_incomplete_bundle_is_unknown_but_the_stress_check_still_runs(tmp_path: Path) -> None:
    torch.manual_seed(20)
    model = Net()
    payload, reference = healthy(model, make_batch())
    snap = snapshot(model, payload, reference, settings=BundleSettings(bundle_max_bytes=10_000))
    bundle = written(tmp_path, snap)
    result = confirm(bundle.path, env={}, **QUICK)
    assert result["outcome"] == "unknown"
    assert "weights.pt left out" in result["reason"]
    (gpu,) = result["gpus"]
    assert gpu["result"] == "could-not-run" and gpu["stress"]["result"] == "pass"


def in_process_bundle(tmp_path: Path, tolerance: Tolerance | None = None) -> Path:
    torch.manual_seed(21)
    model = Net()
    payload, reference = healthy(model, make_batch())
    return written(
        tmp_path, snapshot(model, payload, reference, tolerance=tolerance or Tolerance())
    ).path


def test_a_transient_fault_reproduces_once_and_still_confirms(tmp_path: Path) -> None:
    path = in_process_bundle(tmp_path)
    glitch = "rank=3,step=30,site=forward,kind=bitflip,bit=20,target=out"
    result = confirm(path, env={FAULTS_ENV: glitch}, **QUICK)
    assert result["outcome"] == "confirmed"
    outcomes = [r["outcome"] for r in result["gpus"][0]["replay"]["repeats"]]
    assert outcomes == ["other", "reference", "reference"]
    assert "1 of 3" in result["reason"]


def test_local_gradient_faults_need_a_target(tmp_path: Path) -> None:
    path = in_process_bundle(tmp_path)
    aimed = "rank=3,step=1,site=grad_local,kind=bitflip,bit=3,persistent=true,target=inp.weight"
    result = confirm(path, env={FAULTS_ENV: aimed}, **QUICK)
    assert result["outcome"] == "confirmed"
    repeat = result["gpus"][0]["replay"]["repeats"][0]
    assert repeat["loss_equal"] and not repeat["gradients_equal"]
    assert repeat["differing_parameters"] == ["inp.weight"]
    untargeted = aimed.replace(",target=inp.weight", "")
    result = confirm(path, env={FAULTS_ENV: untargeted}, **QUICK)
    assert result["outcome"] == "not-confirmed"
    assert "needs a DDP bucket" in result["gpus"][0]["replay"]["emulated_faults"][0]


def test_where_the_job_is_not_bit_reproducible_gradients_compare_within_tolerance(
    tmp_path: Path,
) -> None:
    path = in_process_bundle(tmp_path, Tolerance(bit_reproducible=False, gradient_tolerance=1e-3))
    noise = "rank=3,step=1,site=grad_local,kind=relative,relative_error=1e-6,index=all"
    noise += ",persistent=true,target=mid.weight"
    result = confirm(path, env={FAULTS_ENV: noise}, **QUICK)
    assert result["outcome"] == "not-confirmed", result["reason"]
    repeat = result["gpus"][0]["replay"]["repeats"][0]
    assert not repeat["gradients_bitwise_equal"] and repeat["gradients_equal"]
    assert 0 < repeat["max_relative_norm_difference"] < 1e-3
    wrong = noise.replace("relative_error=1e-6", "relative_error=0.1")
    assert confirm(path, env={FAULTS_ENV: wrong}, **QUICK)["outcome"] == "confirmed"


def test_bad_fault_settings_are_unknown_not_a_crash(tmp_path: Path) -> None:
    path = in_process_bundle(tmp_path)
    result = confirm(path, env={FAULTS_ENV: "rank=3,site=forward"}, **QUICK)
    assert result["outcome"] == "unknown" and result["reason"].startswith(FAULTS_ENV)
    result = confirm(path, env={FAULTS_ENV: "rank=3,step=1,site=forward,kind=nan,target=nope"})
    assert result["gpus"][0]["result"] == "could-not-run"
    assert "no module named 'nope'" in result["gpus"][0]["why"]


def inplace_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A loss function that scales its input in place (the audit's copy allows it)."""
    return model(batch.mul_(2.0)).square().mean()


def test_a_loss_that_changes_its_input_in_place_recomputes_alike(tmp_path: Path) -> None:
    torch.manual_seed(23)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    payload = Payload.capture(torch.randn(4, 8), copy=True)
    result, names = recompute(model, inplace_loss, Payload.capture(payload.batch, copy=True), CPU)
    bundle = written(
        tmp_path,
        snapshot(model, payload, reference_of(result, names), loss_fn=inplace_loss),
    )
    result_ = confirm(bundle.path, env={}, **QUICK)
    assert result_["outcome"] == "not-confirmed", result_["reason"]


def wide_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().sum()


def test_the_jobs_cpu_thread_count_is_used(tmp_path: Path) -> None:
    """CPU kernels split large reductions by thread (here the loss's sum over 4 M outputs;
    matmuls gave the same bits at 1 and 2 threads): the job's count must be the
    confirmation's, or a healthy CPU gives other bits and would be accused."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(22)
        model = torch.nn.Sequential(torch.nn.Linear(16, 1024))
        payload = Payload.capture(torch.randn(4096, 16), copy=True)
        result, names = recompute(model, wide_loss, payload, CPU)
        reference = reference_of(result, names)
        bundle = written(tmp_path, snapshot(model, payload, reference, loss_fn=wide_loss))
        assert bundle.manifest["numerics"]["cpu_threads"] == 1
        torch.set_num_threads(2)
        other, _ = recompute(model, wide_loss, payload, CPU)
        premise = reference_of(other, names)["loss_bits"] != reference["loss_bits"]
        result_ = confirm(bundle.path, env={}, **QUICK)
        assert result_["outcome"] == "not-confirmed", result_["reason"]
        assert torch.get_num_threads() == 1 and "cpu_threads=1" in result_["numerics"]
        assert premise or (os.cpu_count() or 1) < 2, "two threads gave the same bits here"
    finally:
        torch.set_num_threads(before)


# The e2e demo's broken GPU (scripts/e2e_demo.py, fault_spec(3)): GPU 1 of the faulty node.
DEMO_FAULT = (
    "rank=3,step=23,site=forward,kind=relative,relative_error=2.5e-5,"
    "persistent=true,target=0,index=all"
)


def test_the_demos_model_and_fault(tmp_path: Path) -> None:
    """examples/train.py's net and loss function, recorded by reference to the script (its
    main() must not run), with the demo's fault: what phase 2's demo will confirm."""
    import importlib.util

    script = ROOT / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("train", script)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
    )  # as train.py builds it
    payload = Payload.capture(train.batch_for(30, 3, CPU), copy=True)
    result, names = recompute(net, train.loss_fn, payload, CPU)
    reference = reference_of(result, names)
    code = {"script": str(script), "main_module": None, "sys_path": [str(script.parent)]}
    snap = snapshot(net, payload, reference, loss_fn=train.loss_fn, code=code)
    bundle = written(tmp_path, snap)
    assert bundle.manifest["model"]["loss_fn"] == "train:loss_fn"
    broken = confirm(bundle.path, env={FAULTS_ENV: DEMO_FAULT}, **QUICK)
    assert broken["outcome"] == "confirmed", broken["reason"]
    assert broken["gpus"][0]["replay"]["repeats"][0]["loss_equal"] is False
    healthy_node = confirm(bundle.path, env={}, **QUICK)
    assert healthy_node["outcome"] == "not-confirmed", healthy_node["reason"]


# -- pure parts ----------------------------------------------------------------------------

REF = {
    "loss_bits": 7,
    "gradient_fingerprint": "a:b",
    "per_parameter": {"w": "1:1", "b": "2:2"},
    "gradient_norms": {"w": 10.0, "b": 1.0},
}


def test_compare() -> None:
    same = compare(REF, dict(REF), bit_reproducible=True, gradient_tolerance=0)
    assert same["outcome"] == "reference" and same["differing_parameter_count"] == 0
    noisy = {
        **REF,
        "gradient_fingerprint": "c:d",
        "per_parameter": {"w": "9:9", "b": "2:2"},
        "gradient_norms": {"w": 10.0001, "b": 1.0},
    }
    strict = compare(REF, noisy, bit_reproducible=True, gradient_tolerance=1e-3)
    assert strict["outcome"] == "other" and strict["differing_parameters"] == ["w"]
    tolerant = compare(REF, noisy, bit_reproducible=False, gradient_tolerance=1e-3)
    assert tolerant["outcome"] == "reference"
    assert tolerant["max_relative_norm_difference"] == pytest.approx(1e-5)
    loss = compare(REF, {**REF, "loss_bits": 8}, bit_reproducible=False, gradient_tolerance=1)
    assert loss["outcome"] == "other", "the loss is compared bit for bit, whatever the tolerance"
    suspect = {"loss_bits": 8, "gradient_fingerprint": "a:b"}
    assert (
        compare(
            REF,
            {**REF, "loss_bits": 8},
            bit_reproducible=True,
            gradient_tolerance=0,
            suspect_result=suspect,
        )["outcome"]
        == "suspect"
    )


def gpu(index: int, result: str, bits: int = 1, why: str = "x") -> dict[str, Any]:
    repeats = (
        [{"loss_bits": bits, "gradient_fingerprint": "f"}] if result != "could-not-run" else []
    )
    replay = {"result": result, "repeats": repeats}
    return {
        "index": index,
        "local_rank": index,
        "uuid": None,
        "result": result,
        "why": why,
        "replay": replay,
    }


def test_decide() -> None:
    ok, bad, cnr = "does-not-reproduce", "reproduces", "could-not-run"
    assert decide([gpu(0, ok), gpu(1, bad)], 1)[0] == "confirmed"
    assert decide([gpu(0, ok), gpu(1, ok)], 1)[0] == "not-confirmed"
    assert decide([gpu(0, cnr), gpu(1, cnr)], 1)[0] == "unknown"
    outcome, reason = decide([gpu(0, ok), gpu(1, cnr)], 1)
    assert outcome == "unknown" and "suspect's GPU 1" in reason
    assert decide([gpu(0, ok), gpu(1, cnr)], 0)[0] == "not-confirmed"
    assert decide([gpu(0, ok)], None)[0] == "unknown"
    # Every GPU alike and different from the reference: the software, not a GPU.
    outcome, reason = decide([gpu(0, bad, 5), gpu(1, bad, 5)], 1)
    assert outcome == "unknown" and "not one GPU" in reason
    assert decide([gpu(0, bad, 5), gpu(1, bad, 6)], 1)[0] == "confirmed"
    assert decide([gpu(0, bad)], 0)[0] == "confirmed", "one device cannot tell; it confirms"
    outcome, reason = decide([gpu(0, bad)], 0, environment_differs="torch here is 9")
    assert outcome == "unknown" and "environment" in reason


def test_compact_summary_fits_the_termination_log() -> None:
    result: dict[str, Any] = {
        "outcome": "confirmed",
        "reason": "r" * 5000,
        "gpus": [
            {"index": i, "local_rank": i, "uuid": f"GPU-{i:036d}", "result": "does-not-reproduce"}
            for i in range(200)
        ],
        "dcgmi": {"ran": True, "passed": False},
    }
    result["gpus"][150]["result"] = "reproduces"
    result["gpus"][3]["result"] = "could-not-run"
    text = compact_summary(result)
    assert len(text.encode()) <= TERMINATION_LOG_LIMIT
    brief = json.loads(text)
    assert brief["outcome"] == "confirmed" and brief["dcgmi"] is False
    kept = {g["index"]: g for g in brief["gpus"]}
    assert kept[150] == {
        "index": 150,
        "local_rank": 150,
        "uuid": "GPU-" + "0" * 33 + "150",
        "result": "reproduces",
    }
    assert kept[3]["result"] == "could-not-run"
    assert 2 < len(kept) < 200 and brief["gpus_left_out"] == 200 - len(kept)
    small = compact_summary({"outcome": "unknown", "reason": "no bundle", "gpus": []})
    assert json.loads(small)["reason"] == "no bundle"
    timed = {"index": 0, "local_rank": 0, "result": "reproduces"}
    timed |= {"replay": {"seconds": 1.25}, "stress": {"seconds": 0.5}}
    summary = json.loads(compact_summary({"outcome": "confirmed", "gpus": [timed]}))
    assert summary["gpus"][0]["seconds"] == 1.75  # per GPU, for status.confirmation


def test_the_suspects_gpu_is_found_by_uuid_among_the_nodes_gpus() -> None:
    """The confirmation pod runs on every GPU of the node, numbered as the device plugin
    and CUDA gave them to it: the suspect's is the one of its UUID, whatever its number;
    by local rank only where no UUID is known on either side; not found: ``None`` (the
    run says nothing about the suspect's GPU)."""
    uuids = [f"GPU-{i}0000000-0000-0000-0000-000000000000" for i in range(4)]
    slots = [Slot(i, torch.device("cpu"), i, 8 + i, uuids[(i + 2) % 4]) for i in range(4)]
    suspect = Suspect(rank=9, node="n1", local_rank=1, gpu_uuid=uuids[1])
    assert suspect_slot(slots, suspect) == 3  # its GPU is this pod's device 3, not 1
    assert suspect_slot(slots, Suspect(rank=9, node="n1", local_rank=1)) == 1
    stranger = Suspect(rank=9, node="n1", local_rank=1, gpu_uuid="GPU-f" + uuids[0][5:])
    assert suspect_slot(slots, stranger) is None
    unnamed = [Slot(s.index, s.device, s.local_rank, s.rank, None) for s in slots]
    assert suspect_slot(unnamed, suspect) == 1


def test_stress_gemms_agree_on_the_cpu_and_the_judgement_finds_the_odd_one() -> None:
    slots = [Slot(0, torch.device("cpu"), 0, 0, None), Slot(1, torch.device("cpu"), 1, 1, None)]
    per = gemm_stress(slots, [torch.float32, torch.bfloat16], repeats=2, size=32, iterations=3)
    assert [p["result"] for p in per.values()] == ["pass", "pass"]
    assert (
        per[0]["dtypes"]["torch.float32"]["fingerprints"]
        == per[1]["dtypes"]["torch.float32"]["fingerprints"]
    )

    def table(*prints: list[str]) -> dict[int, dict[str, Any]]:
        return {
            i: {"dtypes": {"torch.float32": {"fingerprints": p}}, "seconds": 0.0}
            for i, p in enumerate(prints)
        }

    t = table(["a", "a"], ["a", "a"], ["b", "b"])
    judge_stress(t)
    assert [p["result"] for p in t.values()] == ["pass", "pass", "fail"]
    t = table(["a", "a"], ["a", "c"])
    judge_stress(t)
    assert [p["result"] for p in t.values()] == ["pass", "fail"]
    t = table(["a", "a"], ["b", "b"])
    judge_stress(t)
    assert [p["result"] for p in t.values()] == ["inconclusive", "inconclusive"]


def fake_dcgmi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "dcgmi"
    exe.write_text(f'#!/bin/sh\necho "$@" > "{bin_dir}/args"\n{body}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_dcgmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    fake_dcgmi(bin_dir, 'echo "| Memory | Pass |"; echo "| PCIe | Pass |"; exit 0')
    done = run_dcgmi(timeout=30)
    assert (done["ran"], done["passed"], done["exit_code"]) == (True, True, 0)
    assert (bin_dir / "args").read_text().split() == ["diag", "-r", "3"]
    fake_dcgmi(bin_dir, 'echo "| Memory | Fail - GPU 3 |"; exit 226')
    assert run_dcgmi(timeout=30)["passed"] is False
    fake_dcgmi(bin_dir, 'echo "Error: unable to establish a connection"; exit 1')
    assert run_dcgmi(timeout=30)["passed"] is None
    fake_dcgmi(bin_dir, "sleep 5")
    slow = run_dcgmi(timeout=0.5)
    assert slow["timed_out"] is True and slow["passed"] is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert run_dcgmi(timeout=30)["ran"] is False


def test_bad_usage_is_argparses_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["somewhere", "--repeat", "0"])
    assert caught.value.code == 2
    assert "--repeat" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda(tmp_path: Path) -> None:
    """The bundle written from CUDA tensors (pinned asynchronous copies), confirmed on
    every GPU of the machine: the emulated fault on the suspect's GPU only."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "pickle", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    path = Path(json.loads(done.stdout.strip().splitlines()[-1])["bundle"])
    clean = confirm(path, env={}, dcgmi=False)
    assert clean["outcome"] == "not-confirmed", clean["reason"]
    broken = confirm(path, env={FAULTS_ENV: FAULT}, dcgmi=False)
    suspect = [g for g in broken["gpus"] if g["local_rank"] == 1]
    if suspect:  # a machine with two GPUs or more: GPU 1 is the suspect's
        assert broken["outcome"] == "confirmed"
        assert [g["result"] for g in broken["gpus"] if g["local_rank"] != 1] == [
            "does-not-reproduce"
        ] * (len(broken["gpus"]) - 1)
