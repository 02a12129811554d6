"""A stand-in for the scheduler and the kubelet, for the confirmation pods the operator
creates (the test API server has neither): it binds a pod to the node its required node
affinity names, runs its container's command as a local process (``python`` is this
interpreter; ``/dev/termination-log`` a file) and writes the container's terminated state
back as the kubelet would: exit code, and the termination log as its ``message``. Or it
writes by hand the states of a pod that does not get that far (unschedulable, an image
that does not pull, the deadline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sdc_operator.confirmation import CONFIRMATION_LABEL

from .cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


def confirmation_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    found = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{CONFIRMATION_LABEL}=true", _preload_content=False
    )
    return list(json.loads(found.data)["items"])


def pinned_node(pod: dict[str, Any]) -> str:
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    (term,) = terms["nodeSelectorTerms"]
    (field,) = term["matchFields"]
    assert (field["key"], field["operator"]) == ("metadata.name", "In")
    return str(field["values"][0])


def bind(cluster: Cluster, pod: dict[str, Any], node: str) -> None:
    """The scheduler's part: a Binding (``spec.nodeName`` cannot be set otherwise)."""
    meta = pod["metadata"]
    cluster.core.create_namespaced_pod_binding(
        meta["name"],
        meta["namespace"],
        {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        },
        _preload_content=False,
    )


def set_status(cluster: Cluster, pod: dict[str, Any], status: dict[str, Any]) -> None:
    meta = pod["metadata"]
    cluster.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})


def container_status(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "confirm",
        "ready": False,
        "restartCount": 0,
        "image": "example.com/train:1",
        "imageID": "",
        "state": state,
    }


def run(
    cluster: Cluster, pod: dict[str, Any], work: Path, env: dict[str, str] | None = None
) -> int:
    """Bind ``pod`` to its node and run it to its end; its exit code."""
    node = pinned_node(pod)
    bind(cluster, pod, node)
    now = _now()
    set_status(
        cluster,
        pod,
        {
            "phase": "Running",
            "startTime": now,
            "containerStatuses": [container_status({"running": {"startedAt": now}})],
        },
    )
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "sdc_agent.confirm"]
    work.mkdir(parents=True, exist_ok=True)
    log = work / "termination-log"
    args = [str(log) if a == container["terminationMessagePath"] else a for a in container["args"]]
    values = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}
    done = subprocess.run(
        [sys.executable, "-m", "sdc_agent.confirm", *args, "--no-dcgmi", "--stress-size", "64"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "PYTHONPATH": str(ROOT / "sidecar"),
            "OMP_NUM_THREADS": "1",
            **values,
            "NODE_NAME": node,
            **(env or {}),
        },
        cwd=work,
        capture_output=True,
        text=True,
        timeout=180,
    )
    (work / "output.log").write_text(done.stdout + done.stderr)
    message = log.read_text() if log.exists() else (done.stdout + done.stderr)[-2000:]
    terminated = {
        "exitCode": done.returncode,
        "reason": "Completed" if done.returncode == 0 else "Error",
        "message": message,
        "startedAt": now,
        "finishedAt": _now(),
    }
    set_status(
        cluster,
        pod,
        {
            "phase": "Succeeded" if done.returncode == 0 else "Failed",
            "containerStatuses": [container_status({"terminated": terminated})],
        },
    )
    return done.returncode


def _now() -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
