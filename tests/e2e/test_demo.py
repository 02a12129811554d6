"""The README's main command, as CI runs it: scripts/e2e_demo.py end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """scripts/e2e_demo.py with ``args``: its output and its JSON, once it succeeded."""
    out = tmp_path / "demo.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "e2e_demo.py"),
            "--json",
            str(out),
            "--keep",
            str(tmp_path / "state"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    demo = json.loads(out.read_text())
    assert demo["problems"] == []
    return done.stdout, demo


@pytest.mark.slow  # the whole demo: about 1 min on 2 cores (loaded)
def test_corrupted_job_is_detected_contained_and_resumed_with_nothing_lost(tmp_path: Path) -> None:
    stdout, demo = run_demo(tmp_path)

    # the job carries only the annotation; the webhook wired every pod the runner created,
    # and the training operator's pods carry its creator marker (kept true by the creator
    # check the demo registers, the chart's ValidatingWebhookConfiguration)
    for run in (demo["clean"], demo["faulty"]):
        job = run["job_object"]
        assert job["metadata"]["annotations"]["hyperpod-sdc.dev/enabled"] == "true"
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        # only the job's own volume: the checkpoints, where the evidence bundles go
        assert [v["name"] for v in template["volumes"]] == ["checkpoints"]
        assert not {e["name"] for e in template["containers"][0]["env"]} & {
            "POD_NAME",
            "NODE_NAME",
            "HYPERPOD_SDC_OPERATOR_URL",
            "HYPERPOD_SDC_TOKEN_FILE",
            "HYPERPOD_SDC_CA_BUNDLE",
        }
        assert len(run["wired_pods"]) == 3 * len(run["placements"])
        for pod in run["wired_pods"]:
            env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
            assert {"POD_NAME", "NODE_NAME", "HYPERPOD_SDC_CA_BUNDLE"} <= env
            assert {v["name"] for v in pod["spec"]["volumes"]} == {
                "checkpoints",
                "hyperpod-sdc-token",
                "hyperpod-sdc-ca",
            }
            annotations = pod["metadata"]["annotations"]
            assert annotations["hyperpod-sdc.dev/created-by"] == (
                "system:serviceaccount:kubeflow:training-operator"
            )
            assert pod["metadata"]["labels"]["hyperpod-sdc.dev/attested"] == "true"
            assert "hyperpod-sdc.dev/attestation" not in annotations  # no v2 HMAC any more

    assert demo["replay_every"] == 10
    status = check_contained_and_resumed(demo, stdout)
    # the node is quarantined at once; the stop waited for the snapshot's report
    assert [a["action"] for a in status["actions"]] == [
        "quarantine-node",
        "suspend-job",
        "resume-job",
        "confirm-node",
        "replace-node",
    ]
    faulty, clean, bad = demo["faulty"], demo["clean"], demo["faulty_node"]
    incident = faulty["incidents"][0]
    # confirmed on the faulty node, where the emulated GPU is still broken, naming that GPU;
    # replaced by the policy auto-replace-confirmed, with exactly one SageMaker call
    assert status["phase"] == "Remediated"
    confirmed = next(c for c in status["conditions"] if c["type"] == "Confirmed")
    assert (confirmed["status"], confirmed["reason"]) == ("True", "Reproduced")
    assert f"(local rank 1) of node {bad}" in confirmed["message"]
    record = status["confirmation"]
    assert (record["outcome"], record["exitCode"], record["node"]) == ("confirmed", 3, bad)
    assert record["bundle"] == incident["spec"]["bundle"]
    assert [g["localRank"] for g in record["gpus"] if g["result"] == "reproduces"] == [1]
    assert demo["sagemaker_calls"] == [
        [
            "BatchReplaceClusterNodes",
            {"ClusterName": "demo-cluster", "NodeIds": [demo["instances"][bad]]},
        ]
    ]
    # the same bundle on a healthy node: not confirmed
    second = faulty["second_opinion"]
    assert second["node"] != bad and second["exit_code"] == 0
    assert second["summary"]["outcome"] == "not-confirmed"
    assert not clean["confirmation_pods"]
    assert "llama-demo" in demo["table"] and "Remediated" in demo["table"]
    assert "CONFIRMED" in demo["table"] and "confirmed" in demo["table"]


@pytest.mark.slow  # the whole demo, as HSDP: about 1 min on 2 cores (loaded)
def test_the_hsdp_variant_is_detected_contained_and_resumed_from_its_snapshot(
    tmp_path: Path,
) -> None:
    """``scripts/demo.sh --layout hsdp``: examples/train_fsdp.py, replicate 3 x shard 2, one
    replica per node; confirmation off and the manual policy (an FSDP2 bundle cannot
    rebuild its model yet), so the node stays quarantined for a person."""
    stdout, demo = run_demo(tmp_path, "--layout", "hsdp")
    assert demo["layout"] == "hsdp"
    assert "HSDP: replicate 3 x shard 2, 30 steps" in stdout
    assert demo["replay_every"] == 5
    status = check_contained_and_resumed(demo, stdout)
    assert [a["action"] for a in status["actions"]] == [
        "quarantine-node",
        "suspend-job",
        "resume-job",
    ]
    # the verdict's evidence: the layout and the suspect's mesh coordinates (rank 3: the
    # second replica group, shard 1)
    spec = demo["faulty"]["incidents"][0]["spec"]
    evidence = spec.get("evidence") or {}
    assert evidence.get("layout") == "hsdp", spec
    assert evidence["mesh_coordinates"] == {"3": {"replicate": 1, "shard": 1}}
    assert demo["sagemaker_calls"] == []
    assert not demo["faulty"]["confirmation_pods"] and not demo["clean"]["confirmation_pods"]
    assert status["phase"] != "Remediated"


def check_contained_and_resumed(demo: dict[str, Any], stdout: str) -> dict[str, Any]:
    """What both layouts promise: the clean run touches nothing; the faulty one is named,
    contained, resumed on the spare node from the verified snapshot of its last clean step,
    and ends with the clean run's state. Returns the first incident's status."""
    # no fault: no incident, no node touched
    clean = demo["clean"]
    assert clean["finished"] and clean["incidents"] == []
    assert clean["nodes_after"] == clean["nodes_before"]

    # the fault: the incident names the faulty rank's node and its instance id. A loaded
    # machine may let the job reach its next audit before the suspension lands: then there
    # are more incidents (the demo sorts them by detection step), every one names the faulty
    # node, and the first is checked (one SageMaker call in all, below)
    faulty, bad = demo["faulty"], demo["faulty_node"]
    incident = faulty["incidents"][0]
    assert {i["status"]["node"] for i in faulty["incidents"]} == {bad}
    status = incident["status"]
    assert (status["node"], status["instanceId"], status["ranks"]) == (
        bad,
        demo["instances"][bad],
        "3",
    )
    # the job was suspended, the node cordoned and tainted
    assert faulty["stopped_for_suspend"] == 1
    labels, _, taints, unschedulable = faulty["nodes_after"][bad]
    assert unschedulable is True and labels["hyperpod-sdc.dev/suspect"] == "true"
    assert {"key": "hyperpod-sdc.dev/suspect", "value": "true", "effect": "NoSchedule"} in taints
    # resumed on the spare node, from the verified snapshot of the last clean step that the
    # healthy ranks wrote at the detection, not from the last periodic checkpoint: the work
    # lost is at most one audit interval (DDP: replay_every 10, a periodic checkpoint every
    # 30; HSDP: 5 and 15)
    first, second = faulty["placements"]
    spare = demo["nodes"][3]
    assert bad in first and spare not in first and bad not in second and spare in second
    last_clean = incident["spec"]["lastCleanStep"]
    assert status["resumedFromStep"] == faulty["result"]["resumed_from"] == last_clean
    assert status["resumedFrom"].endswith(f"/sdc-snapshot-step_{last_clean}")
    assert status["resumeCheckpoint"]["step"] == status["resumedFromStep"]
    snapshot_condition = next(c for c in status["conditions"] if c["type"] == "Snapshot")
    assert (snapshot_condition["status"], snapshot_condition["reason"]) == (
        "True",
        "SnapshotReported",
    )
    assert [c for c in faulty["checkpoints"] if c["snapshot"]] == [
        {
            "name": f"sdc-snapshot-step_{last_clean}",
            "step": last_clean,
            "verified": True,
            "snapshot": True,
        }
    ]
    lost, replay_every = faulty["lost_work"], demo["replay_every"]
    assert lost["detection_step"] == int(incident["spec"]["detectionStep"])
    assert lost["resume_step"] == last_clean
    assert lost["source"] == "status.lostWork"  # the operator records it
    assert lost["recorded"]["steps"] == lost["steps"] == lost["detection_step"] - last_clean
    assert 0 < lost["steps"] <= replay_every
    assert lost["resume_step"] > lost["last_periodic_checkpoint"]
    assert lost["steps_from_periodic_checkpoint"] > lost["steps"]
    assert f"Lost work: {lost['steps']} steps" in stdout
    assert not [c for c in clean["checkpoints"] if c["snapshot"]]
    # finished, with the weights of the run without the fault, bit for bit
    assert faulty["finished"]
    assert faulty["result"]["sha256"] == clean["result"]["sha256"]
    return dict(status)
