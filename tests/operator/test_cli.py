"""``kubectl sdc``'s pure half: the timeline, the confirmation table, the review rules.
tests/integration/test_cli.py runs the command against the real API server."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_operator.cli import main, render_describe, review_refusal, timeline

T = "2026-01-02T03:04:05Z"


def incident(phase: str, **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hyperpod-sdc.dev/v1alpha1",
        "kind": "SDCIncident",
        "metadata": {"name": "train-15-abc", "namespace": "ml", "creationTimestamp": T},
        "spec": {
            "job": {"kind": "PyTorchJob", "name": "train", "uid": "u"},
            "check": "replay",
            "classification": "rank",
            "detectionStep": 15,
            "lastCleanStep": 10,
            "localized": True,
            "transient": False,
            "message": "rank(s) 3 computed wrong results",
        },
        "status": {
            "phase": phase,
            "actions": [
                {"action": "quarantine-node", "target": "n1", "result": "Succeeded", "at": T}
            ],
            **status,
        },
    }


def test_the_confirmation_per_gpu_is_shown() -> None:
    confirmed = {
        "type": "Confirmed",
        "status": "True",
        "reason": "Reproduced",
        "message": "GPU 1 returned a wrong result",
        "lastTransitionTime": T,
    }
    found = incident(
        "Resumed",
        conditions=[confirmed],
        confirmation={
            "outcome": "confirmed",
            "node": "n1",
            "reason": "GPU 1 (local rank 1): 3 of 3 recomputations differ",
            "finishedAt": T,
            "bundle": "/fsx/ckpt/sdc-evidence/run-7-15-r3",
            "gpus": [
                {"index": 0, "localRank": 0, "gpuUUID": "GPU-aaa", "result": "does-not-reproduce"},
                {
                    "index": 1,
                    "local_rank": 1,
                    "uuid": "GPU-bbb",
                    "result": "reproduces",
                    "seconds": 2.25,
                },
            ],
        },
    )
    out = render_describe(found, [])
    section = out.split("Confirmation:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0] == "  Confirmed=True (Reproduced): GPU 1 returned a wrong result"
    assert section[1].startswith("  outcome confirmed on node n1")
    assert section[2].split() == ["GPU", "LOCAL", "RANK", "UUID", "RESULT", "TIME"]
    assert section[3].split() == ["0", "0", "GPU-aaa", "does-not-reproduce", "-"]
    assert section[4].split() == ["1", "1", "GPU-bbb", "reproduces", "2.2", "s"]
    assert section[5] == "  bundle: /fsx/ckpt/sdc-evidence/run-7-15-r3"
    assert [e.kind for e in timeline(found, [])][-1] == "confirmation"


def test_review_rules() -> None:
    assert review_refusal(incident("Contained"), "replace") is None
    assert "unknown decision" in (review_refusal(incident("Contained"), "explode") or "")
    pending = incident("Contained")
    pending["metadata"]["annotations"] = {"hyperpod-sdc.dev/action": "reboot"}
    assert "pending" in (review_refusal(pending, "replace") or "")
    assert review_refusal(pending, "replace", overwrite=True) is None
    assert review_refusal(pending, "reboot") is None  # the same decision: nothing to change
    # A reboot carried out is not pending: the next decision needs no --overwrite.
    pending["status"]["actions"].append(
        {"action": "reboot-node", "target": "n1", "result": "Succeeded", "at": T}
    )
    pending["status"]["phase"] = "Remediated"
    assert review_refusal(pending, "replace") is None
    assert "already requested" in (review_refusal(pending, "reboot") or "")
    held = incident("Transient", message="a transient fault: run a confirmation to be sure")
    held["status"]["actions"] = []
    assert "held (Transient" in (review_refusal(held, "replace") or "")
    assert "Guidance:    a transient fault: run a confirmation" in render_describe(held, [])
    nothing = incident("Contained")
    nothing["status"]["actions"] = []
    assert "no node was quarantined" in (review_refusal(nothing, "release") or "")
    out = render_describe(nothing, [])
    assert "nothing to decide now: no node was quarantined" in out


def test_a_bad_stop_timeout_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    for raw, problem in (
        ("0", "expected a number of seconds > 0, got '0'"),
        ("inf", "expected a number of seconds > 0, got 'inf'"),
        ("soon", "expected a number of seconds, got 'soon'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["uninstall", "--stop", "ns/op", "--stop-timeout", raw])
        assert exit_.value.code == 2  # bad usage, before any kubeconfig is read
        assert f"argument --stop-timeout: {problem}" in capsys.readouterr().err
