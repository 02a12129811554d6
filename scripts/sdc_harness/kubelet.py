"""A stand-in for the scheduler and the kubelet (the test API server has neither), for the
pods that must run: the demo's training pods and the confirmation pods the operator
creates.

- :func:`materialize`: what the kubelet does for a pod before its containers start, on
  this machine: the env with downward-API fields resolved, the projected ServiceAccount
  token and the ConfigMap volumes written under a directory per pod
  (``<pod dir>/<mountPath>/...``; a path under such a mount in the env points into that
  directory). A ``hostPath`` is this machine's own directory, where every pod mounts it.
- A confirmation pod: :func:`start` binds it to the node its required node affinity names
  (:func:`bind`, the scheduler's part) and runs its container's command as a local process
  (``python`` is this interpreter; its termination log a file); :func:`finish` writes the
  container's terminated state back as the kubelet would: exit code, and the termination
  log as its ``message``; :func:`run` does both and waits. Or a test writes by hand the
  states of a pod that does not get that far (unschedulable, an image that does not pull,
  the deadline) with :func:`set_status` and :func:`container_status`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from sdc_operator.confirmation import CONFIRMATION_LABEL

from . import zygote
from .cluster import ROOT, Cluster

QUICK = ("--no-dcgmi", "--stress-size", "64")
"""Extra arguments of :func:`run` by default: no DCGM on this machine, a short stress run."""


def confirmation_pods(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    found = cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{CONFIRMATION_LABEL}=true", _preload_content=False
    )
    return list(json.loads(found.data)["items"])


def read_pod(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    found = cluster.core.read_namespaced_pod(name, namespace, _preload_content=False)
    return dict(json.loads(found.data))


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


def container_status(state: dict[str, Any], image: str = "example.com/train:1") -> dict[str, Any]:
    return {
        "name": "confirm",
        "ready": False,
        "restartCount": 0,
        "image": image,
        "imageID": "",
        "state": state,
    }


def materialize(cluster: Cluster, pod: dict[str, Any], root: Path) -> dict[str, str]:
    """The first container's env, its volumes written under ``root`` (see the module)."""
    spec, meta = pod["spec"], pod["metadata"]
    container = spec["containers"][0]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    mounts = {
        m["mountPath"]: m["name"]
        for m in container.get("volumeMounts") or []
        if "hostPath" not in volumes[m["name"]]
    }
    for path, name in mounts.items():
        target = root / path.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        _fill(cluster, pod, volumes[name], target)
    env = {}
    for var in container.get("env") or []:
        if "value" in var:
            value = str(var["value"])
        else:
            field_path = var["valueFrom"]["fieldRef"]["fieldPath"]
            value = {
                "metadata.name": meta["name"],
                "metadata.namespace": meta["namespace"],
                "spec.nodeName": spec.get("nodeName", ""),
            }[field_path]
        for path in mounts:  # a file under a mount is in the pod's directory here
            if value == path or value.startswith(path.rstrip("/") + "/"):
                value = str(root / value.lstrip("/"))
        env[var["name"]] = value
    return env


def _fill(cluster: Cluster, pod: dict[str, Any], volume: dict[str, Any], target: Path) -> None:
    namespace = pod["metadata"]["namespace"]
    if "projected" in volume:
        for source in volume["projected"]["sources"]:
            sat = source["serviceAccountToken"]
            review = cluster.core.create_namespaced_service_account_token(
                pod["spec"].get("serviceAccountName", "default"),
                namespace,
                {
                    "spec": {
                        "audiences": [sat["audience"]],
                        "expirationSeconds": sat.get("expirationSeconds", 3600),
                        "boundObjectRef": {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": pod["metadata"]["name"],
                            "uid": pod["metadata"]["uid"],
                        },
                    }
                },
            )
            (target / sat["path"]).write_text(review.status.token)
    elif "configMap" in volume:
        name = volume["configMap"]["name"]
        deadline = time.monotonic() + 60
        while True:  # a pod waits for a ConfigMap volume that does not exist yet
            try:
                found = cluster.core.read_namespaced_config_map(name, namespace)
                break
            except client.ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for key, value in (found.data or {}).items():
            (target / key).write_text(value)
    else:
        raise RuntimeError(f"the stand-in kubelet cannot mount volume {volume}")


@dataclass
class Started:
    """A confirmation pod's container, running as a local process."""

    pod: dict[str, Any]
    """As the API server stored it once bound."""
    node: str
    proc: subprocess.Popen[bytes] | zygote.Forked
    termination_log: Path
    started_at: str
    exit_code: int | None = None
    message: str = ""


def start(
    cluster: Cluster,
    pod: dict[str, Any],
    work: Path,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    *,
    fork: bool = False,
) -> Started:
    """Bind a confirmation pod to its node and start its container's command in ``work``
    (output in ``work/output.log``); ``env`` on top of the pod's (the emulated broken GPU),
    ``args`` after the pod's. ``fork``: forked from the process that imported torch once
    (:mod:`sdc_harness.zygote`, as the demo's workers are: a warm container; about 2.5 s of
    CPU less on the 2-core machine), with this process's ``sys.path``; else a fresh
    ``python -m sdc_agent.confirm``."""
    node = pinned_node(pod)
    bind(cluster, pod, node)
    bound = read_pod(cluster, pod["metadata"]["namespace"], pod["metadata"]["name"])
    work.mkdir(parents=True, exist_ok=True)
    values = materialize(cluster, bound, work)
    (container,) = bound["spec"]["containers"]
    assert container["command"] == ["python", "-m", "sdc_agent.confirm"], container["command"]
    log = work / "termination-log"
    pod_args = [
        str(log) if a == container["terminationMessagePath"] else a for a in container["args"]
    ]
    now = _now()
    set_status(
        cluster,
        bound,
        {
            "phase": "Running",
            "startTime": now,
            "containerStatuses": [
                container_status({"running": {"startedAt": now}}, container["image"])
            ],
        },
    )
    command = [sys.executable, "-m", "sdc_agent.confirm", *pod_args, *args]
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", str(work)),
        # this checkout's agent, as the image would carry it
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("sidecar", "common")),
        "OMP_NUM_THREADS": zygote.THREADS,
        **values,
        **(env or {}),
    }
    (work / "output.log").write_bytes(b"")
    proc: subprocess.Popen[bytes] | zygote.Forked
    if fork:
        proc = zygote.start(command, environment, work / "output.log", cwd=work)
    else:
        with open(work / "output.log", "wb") as output:
            proc = subprocess.Popen(
                command,
                env=environment,
                cwd=work,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    return Started(bound, node, proc, log, now)


def finish(cluster: Cluster, started: Started) -> int | None:
    """Once the container's process ended, write its terminated state back (once): its
    exit code, or None while it runs."""
    if started.exit_code is not None:
        return started.exit_code
    code = started.proc.poll()
    if code is None:
        return None
    log, output = started.termination_log, started.termination_log.parent / "output.log"
    # terminationMessagePolicy FallbackToLogsOnError
    message = log.read_text() if log.exists() else output.read_text(errors="replace")[-2000:]
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "message": message,
        "startedAt": started.started_at,
        "finishedAt": _now(),
    }
    (container,) = started.pod["spec"]["containers"]
    set_status(
        cluster,
        started.pod,
        {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [container_status({"terminated": terminated}, container["image"])],
        },
    )
    started.exit_code, started.message = code, message
    return code


def run(
    cluster: Cluster,
    pod: dict[str, Any],
    work: Path,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = QUICK,
    timeout: float = 180,
) -> int:
    """Bind ``pod`` to its node and run it to its end; its exit code."""
    started = start(cluster, pod, work, env, args)
    started.proc.wait(timeout=timeout)
    code = finish(cluster, started)
    assert code is not None
    return code


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
