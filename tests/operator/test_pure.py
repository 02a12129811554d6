"""The operator's pure decisions about nodes and jobs (no cluster needed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sdc_operator.jobs import is_enabled, resume_patch, suspend_patch
from sdc_operator.nodes import (
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
    resumed = apply(suspended, resume_patch(suspended, 1150))
    assert resumed["spec"]["runPolicy"]["suspend"] is False
    for replica in resumed["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            values = [e for e in container["env"] if e["name"] == "HYPERPOD_SDC_RESUME_MAX_STEP"]
            assert values == [{"name": "HYPERPOD_SDC_RESUME_MAX_STEP", "value": "1150"}]
            assert container["image"]  # the rest of the container survives
    worker = resumed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert {"name": "A", "value": "1"} in worker["env"]
    with pytest.raises(ValueError, match="^max_step:"):
        resume_patch(JOB, -1)


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
