"""The operator's pure decisions about nodes and jobs (no cluster needed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sdc_operator.jobs import (
    auto_resume_refusal,
    checkpoint_patch,
    is_enabled,
    newest_checkpoint,
    resume_env_patch,
    resume_env_set,
    suspend_patch,
    unsuspend_patch,
    verified_checkpoints,
    workload_active_patch,
)
from sdc_operator.nodes import (
    hand_over_patch,
    health_label_patch,
    holders,
    instance_id_from_node_name,
    instance_id_from_provider_id,
    quarantine_patch,
    release_patch,
)


@pytest.mark.parametrize(
    ("provider_id", "want"),
    [
        ("aws:///us-west-2a/i-0123456789abcdef0", "i-0123456789abcdef0"),
        ("aws:///us-west-2a/i-01234567", "i-01234567"),
        ("aws:///us-west-2a/i-0123456789abcdef0/", "i-0123456789abcdef0"),
        ("gce://project/zone/name", None),
        ("aws:///us-west-2a/not-an-instance", None),
        ("", None),
        (None, None),
    ],
)
def test_instance_id_from_provider_id(provider_id: str | None, want: str | None) -> None:
    assert instance_id_from_provider_id(provider_id) == want


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("hyperpod-i-0123456789abcdef0", "i-0123456789abcdef0"),
        ("hyperpod-i-xyz", None),
        ("ip-10-1-2-3.ec2.internal", None),
        (None, None),
    ],
)
def test_instance_id_from_node_name(name: str | None, want: str | None) -> None:
    assert instance_id_from_node_name(name) == want


NODE: dict[str, Any] = {
    "metadata": {"name": "hyperpod-i-0123456789abcdef0", "labels": {"a": "b"}},
    "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]},
}


def apply(node: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch, as the API server applies it."""
    out = copy.deepcopy(node)

    def merge(target: dict[str, Any], p: dict[str, Any]) -> None:
        for k, v in p.items():
            if v is None:
                target.pop(k, None)
            elif isinstance(v, dict):
                merge(target.setdefault(k, {}), v)
            else:
                target[k] = v

    merge(out, patch)
    return out


def test_quarantine_is_complete_and_idempotent() -> None:
    patch = quarantine_patch(NODE, "team/job-incident-1")
    assert patch is not None
    node = apply(NODE, patch)
    assert node["spec"]["unschedulable"] is True
    assert {"key": "hyperpod-sdc.dev/suspect", "value": "true", "effect": "NoSchedule"} in node[
        "spec"
    ]["taints"]
    assert node["spec"]["taints"][0]["key"] == "nvidia.com/gpu"  # other taints kept
    assert node["metadata"]["labels"] == {"a": "b", "hyperpod-sdc.dev/suspect": "true"}
    assert node["metadata"]["annotations"]["hyperpod-sdc.dev/incident"] == "team/job-incident-1"
    assert quarantine_patch(node, "team/job-incident-1") is None
    assert all(t["key"] != "node.kubernetes.io/out-of-service" for t in node["spec"]["taints"])


def test_release_undoes_quarantine() -> None:
    patch = quarantine_patch(NODE, "team/x")
    assert patch is not None
    released_patch = release_patch(apply(NODE, patch))
    assert released_patch is not None
    released = apply(apply(NODE, patch), released_patch)
    assert released["metadata"].pop("annotations") == {}  # emptied, as on a real node
    assert released == NODE
    assert release_patch(NODE) is None


JOB: dict[str, Any] = {
    "metadata": {"annotations": {"hyperpod-sdc.dev/enabled": "true"}},
    "spec": {
        "runPolicy": {"suspend": False},
        "pytorchReplicaSpecs": {
            "Master": {"template": {"spec": {"containers": [{"name": "train", "image": "img"}]}}},
            "Worker": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "train",
                                "image": "img",
                                "env": [
                                    {"name": "A", "value": "1"},
                                    {"name": "HYPERPOD_SDC_RESUME_MAX_STEP", "value": "5"},
                                ],
                            },
                            {"name": "sidecar", "image": "other"},
                        ]
                    }
                }
            },
        },
    },
}


def test_opt_in() -> None:
    assert is_enabled(JOB)
    assert not is_enabled({"metadata": {"annotations": {"hyperpod-sdc.dev/enabled": "yes"}}})
    assert not is_enabled({})


def test_suspend_then_resume_from_the_clean_step() -> None:
    patch = suspend_patch(JOB)
    assert patch is not None
    suspended = apply(JOB, patch)
    assert suspend_patch(suspended) is None
    assert unsuspend_patch(JOB) is None
    env_patch = resume_env_patch(suspended, 1150)
    assert env_patch is not None and "runPolicy" not in env_patch["spec"]  # env first
    with_env = apply(suspended, env_patch)
    assert with_env["spec"]["runPolicy"]["suspend"] is True
    assert resume_env_set(with_env, 1150) and resume_env_patch(with_env, 1150) is None
    resumed = apply(with_env, unsuspend_patch(with_env) or {})
    assert resumed["spec"]["runPolicy"]["suspend"] is False
    for replica in resumed["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            values = [e for e in container["env"] if e["name"] == "HYPERPOD_SDC_RESUME_MAX_STEP"]
            assert values == [{"name": "HYPERPOD_SDC_RESUME_MAX_STEP", "value": "1150"}]
            assert container["image"]  # the rest of the container survives
    worker = resumed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert {"name": "A", "value": "1"} in worker["env"]
    with pytest.raises(ValueError, match="^max_step:"):
        resume_env_patch(JOB, -1)


HYPERPOD_JOB: dict[str, Any] = {
    "metadata": {"annotations": {"hyperpod-sdc.dev/enabled": "true"}},
    "spec": {
        "runPolicy": {"suspend": True, "jobMaxRetryCount": 0},
        "replicaSpecs": [
            {
                "name": "pods",
                "replicas": 3,
                "spares": 1,
                "template": {"spec": {"containers": [{"name": "t", "image": "i"}]}},
            },
            {
                "name": "aux",
                "replicas": 1,
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "a", "image": "j", "env": [{"name": "B", "value": "2"}]}
                        ]
                    }
                },
            },
        ],
    },
}


def test_resume_a_hyperpod_job_keeps_its_replica_list_whole() -> None:
    patch = resume_env_patch(HYPERPOD_JOB, 40)
    assert patch is not None
    resumed = apply(HYPERPOD_JOB, patch)
    replicas = resumed["spec"]["replicaSpecs"]
    assert [(r["name"], r["replicas"], r.get("spares")) for r in replicas] == [
        ("pods", 3, 1),
        ("aux", 1, None),
    ]
    assert replicas[1]["template"]["spec"]["containers"][0]["env"] == [
        {"name": "B", "value": "2"},
        {"name": "HYPERPOD_SDC_RESUME_MAX_STEP", "value": "40"},
    ]
    assert resume_env_set(resumed, 40) and not resume_env_set(resumed, 41)
    assert apply(resumed, unsuspend_patch(resumed) or {})["spec"]["runPolicy"] == {
        "suspend": False,
        "jobMaxRetryCount": 0,
    }


def test_verified_checkpoints_are_recorded_on_the_job() -> None:
    job: dict[str, Any] = {"metadata": {"annotations": {}}}
    for step in (50, 100, 150):
        job = apply(job, checkpoint_patch(job, step, f"/fsx/step_{step}") or {})
    assert checkpoint_patch(job, 100, "/fsx/step_100") is None  # idempotent
    assert newest_checkpoint(job, 149) == {"step": 100, "location": "/fsx/step_100"}
    assert newest_checkpoint(job, 49) is None
    for step in range(200, 2000, 50):
        job = apply(job, checkpoint_patch(job, step, f"/fsx/step_{step}") or {})
    assert len(verified_checkpoints(job)) == 16
    damaged = {"metadata": {"annotations": {"hyperpod-sdc.dev/checkpoints": "{not json"}}}
    assert verified_checkpoints(damaged) == []


def test_auto_resume_refusals() -> None:
    assert auto_resume_refusal(JOB) is None
    off = {"metadata": {"annotations": {"hyperpod-sdc.dev/auto-resume": "false"}}}
    assert auto_resume_refusal(off) == (
        "OptedOut",
        'the job carries hyperpod-sdc.dev/auto-resume: "false"',
    )
    hp = {"metadata": {"annotations": {"sagemaker.amazonaws.com/enable-job-auto-resume": "true"}}}
    reason = auto_resume_refusal(hp)
    assert reason is not None and reason[0] == "HyperPodAutoResume"


def test_the_operator_never_imports_torch() -> None:
    import pkgutil
    import subprocess
    import sys

    import sdc_operator

    modules = [f"sdc_operator.{m.name}" for m in pkgutil.iter_modules(sdc_operator.__path__)]
    assert "sdc_operator.handlers" in modules
    code = (
        f"import sys, {', '.join(modules)}\n"
        "assert 'torch' not in sys.modules, 'the operator pulled in torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_release_leaves_a_node_cordoned_before_as_it_was() -> None:
    cordoned = apply(NODE, {"spec": {"unschedulable": True}})
    quarantined = apply(cordoned, quarantine_patch(cordoned, "team/x") or {})
    assert quarantined["metadata"]["annotations"]["hyperpod-sdc.dev/was-cordoned"] == "true"
    released = apply(quarantined, release_patch(quarantined) or {})
    assert released["metadata"].pop("annotations") == {}
    assert released == cordoned
    # a second incident on a node we quarantined does not mistake our cordon for a prior one
    again = quarantine_patch(apply(NODE, quarantine_patch(NODE, "team/x") or {}), "team/y")
    assert (
        again is not None
        and "hyperpod-sdc.dev/was-cordoned" not in again["metadata"]["annotations"]
    )


def _holding(name: str, *actions: tuple[str, str], phase: str = "Contained") -> dict[str, Any]:
    entries = [{"action": a, "target": "n1", "result": r} for a, r in actions]
    return {
        "metadata": {"namespace": "team", "name": name},
        "status": {"phase": phase, "actions": entries},
    }


def test_a_node_is_held_by_every_open_incident_that_quarantined_it() -> None:
    quarantined = ("quarantine-node", "Succeeded")
    others = [
        _holding("a", quarantined),
        _holding("b", quarantined, ("release-node", "Skipped")),  # gave it up
        _holding("c", quarantined, phase="Released"),
        _holding("d", ("quarantine-node", "Skipped")),  # the cap: never quarantined it
        _holding("e", quarantined, ("release-node", "Pending")),  # releasing: still holds
        _holding("f", quarantined, phase="Remediated"),  # replacement asked: still holds
        _holding("me", quarantined),
    ]
    assert holders("n1", "team/me", others) == ["team/a", "team/e", "team/f"]
    assert holders("n2", "team/me", others) == []
    node = apply(NODE, quarantine_patch(NODE, "team/me") or {})
    handed = apply(node, hand_over_patch(node, "team/a") or {})
    assert handed["metadata"]["annotations"]["hyperpod-sdc.dev/incident"] == "team/a"
    assert (
        handed["spec"] == node["spec"]
        and handed["metadata"]["labels"] == node["metadata"]["labels"]
    )
    assert hand_over_patch(handed, "team/a") is None


def test_health_label_asks_hyperpod_to_act() -> None:
    patch = health_label_patch(NODE, "replace")
    assert patch == {
        "metadata": {
            "labels": {
                "sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReplacement"
            }
        }
    }
    assert health_label_patch(apply(NODE, patch), "replace") is None
    assert health_label_patch(apply(NODE, patch), "reboot") is not None


def test_workload_active_patch() -> None:
    fresh: dict[str, Any] = {"spec": {"queueName": "q"}}  # active unless spec.active is false
    assert workload_active_patch(fresh, True) is None
    stopped = apply(fresh, workload_active_patch(fresh, False) or {})
    assert stopped["spec"]["active"] is False and workload_active_patch(stopped, False) is None
    assert apply(stopped, workload_active_patch(stopped, True) or {})["spec"]["active"] is True
