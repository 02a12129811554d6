"""The confirmation run: a pod on the quarantined node that recomputes the evidence bundle.

Pure decisions (no cluster), for the engine and :mod:`.actions`:

- which bundle and which node an incident confirms (:func:`bundle_of`,
  :func:`confirmation_node`), and whether the bundle can be reached from the job's volumes
  (:func:`bundle_problem`);
- the pod (:func:`pod_body`): the job's image, its training container's env, volumes,
  volume mounts and resources (with every accelerator the node has, so that it gets the
  suspect's GPU), pinned to the node by required node affinity (as a
  DaemonSet's pods are), tolerating our quarantine taint and the cordon, ``restartPolicy:
  Never``, ``activeDeadlineSeconds``, running ``python -m sdc_agent.confirm BUNDLE``;
  owned by the incident, so deleting the incident deletes it; its name derived from the
  incident and the node (:func:`pod_name`), so a create after a crash or on another replica
  meets the pod already there (409) instead of making a second;
- what the pod says (:func:`judge`): from the container's terminated state (exit code 0,
  3, 4 of ``sdc_agent.confirm`` and the summary it writes to the termination log), or why
  it could not run (unschedulable, the image, a timeout, deleted);
- the status that records it (:func:`record`): ``status.confirmation`` and the condition
  ``Confirmed`` (True: the fault came back on a GPU of the node; False: it did not; Unknown
  with the reason);
- which pods are left over (:func:`orphaned`): a pod given up on is deleted right after its
  result is recorded, so an operator that dies in between leaves it holding the node's GPUs
  until its deadline; the next leader finds it from the records.

The result is the job's own word: the pod runs the job's image with the job's
ServiceAccount, as the training did (docs/confirmation.md, "Trust").
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sdc_common.names import CONFIRM_EXIT_CODES

from .jobshape import GPU_RESOURCES
from .names import GROUP, INCIDENT_KIND, SUSPECT_KEY, VERSION
from .times import parse_time

__all__ = [
    "CONFIRMATION_LABEL",
    "CONTAINER",
    "EXIT_OUTCOMES",
    "INCIDENT_LABEL",
    "OUTCOMES",
    "bundle_of",
    "bundle_problem",
    "confirmation_node",
    "confirmed_node",
    "is_running",
    "judge",
    "orphaned",
    "outcome_of",
    "pod_body",
    "pod_name",
    "record",
    "running_record",
    "pod_difference",
    "training_template",
]

CONFIRMATION_LABEL = f"{GROUP}/confirmation"
"""On a confirmation pod: ``"true"`` (how the operator's pod cache knows to keep its state)."""
INCIDENT_LABEL = f"{GROUP}/incident"
"""On a confirmation pod: the name of its incident (in the pod's namespace)."""
CONTAINER = "confirm"
OUTCOMES = ("confirmed", "not-confirmed", "unknown")
EXIT_OUTCOMES = {code: outcome for outcome, code in CONFIRM_EXIT_CODES.items()}
"""``sdc_agent.confirm``'s exit codes (``sdc_common.names.CONFIRM_EXIT_CODES``), by code."""
TERMINATION_LOG = "/dev/termination-log"
BUNDLE_WAIT_SECONDS = 300
"""``--wait``: the agent names the bundle in the verdict and writes it in the background
right after; a bundle not there five minutes after the pod starts will not come."""
POD_GONE_GRACE_SECONDS = 30.0
"""A pod created this recently may not be in the watch-fed cache yet: not "gone"."""
DEADLINE_GRACE_SECONDS = 60.0
"""How long past ``activeDeadlineSeconds`` the kubelet gets to stop the pod itself."""
_MAX_BUNDLE_CHARS = 4096
_IMAGE_PULL = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
_UNSCHEDULABLE_TOLERATION = "node.kubernetes.io/unschedulable"


def _status(incident: Mapping[str, Any]) -> dict[str, Any]:
    return dict(incident.get("status") or {})


def bundle_of(incident: Mapping[str, Any]) -> str | None:
    """The bundle the verdict named: the first report's (``spec.bundle``), else any report
    of the incident that names one (only the rank that writes it may say so)."""
    found = (incident.get("spec") or {}).get("bundle")
    if found:
        return str(found)
    for entry in _status(incident).get("reports") or []:
        if entry.get("bundle"):
            return str(entry["bundle"])
    return None


def _quarantined(status: Mapping[str, Any]) -> list[str]:
    return [
        str(a["target"])
        for a in status.get("actions") or []
        if a.get("action") == "quarantine-node" and a.get("result") == "Succeeded"
    ]


def confirmation_node(incident: Mapping[str, Any]) -> str | None:
    """The node to confirm on: the bundle's suspect is the incident's first suspect
    (``status.node``); only once that node is quarantined (the job is off it, so its GPUs
    are free, and a person or a policy is about to decide about it)."""
    status = _status(incident)
    node = status.get("node")
    return str(node) if node and node in _quarantined(status) else None


def training_template(job: Mapping[str, Any], suspect_pod: str | None) -> dict[str, Any] | None:
    """The pod template the suspect's pod was made from: a PyTorchJob's ``Master`` for a
    ``*-master-*`` pod, else its ``Worker``; a HyperPodPyTorchJob's first replica spec."""
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs")
    if isinstance(replicas, Mapping):
        order = ["Master", "Worker"] if "-master-" in (suspect_pod or "") else ["Worker", "Master"]
        order += [k for k in replicas if k not in order]
        for name in order:
            template = (replicas.get(name) or {}).get("template")
            if template:
                return dict(template)
        return None
    for replica in spec.get("replicaSpecs") or []:
        template = (replica or {}).get("template")
        if template:
            return dict(template)
    return None


def _training_container(template_spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """Kubeflow's convention names the training container ``pytorch``; else the first."""
    containers = list(template_spec.get("containers") or [])
    named = [c for c in containers if c.get("name") == "pytorch"]
    return dict((named or containers or [None])[0] or {}) or None


def bundle_problem(bundle: str, mounts: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the confirmation pod could not read ``bundle`` (a path the agent reported), or
    ``None``. It must be absolute and lie under one of the training container's volume
    mounts (the shared checkpoint volume, or a ``hostPath`` on the node): a path inside the
    training container's own file system is gone with it."""
    if len(bundle) > _MAX_BUNDLE_CHARS or any(c in bundle for c in "\0\n\r"):
        return "the bundle path is not a plain path (too long, or control characters)"
    if not bundle.startswith("/"):
        return f"the bundle path {bundle!r} is not absolute"
    path = posixpath.normpath(bundle)
    for mount in mounts:
        where = posixpath.normpath(str(mount.get("mountPath") or "/-"))
        if path == where or path.startswith(where.rstrip("/") + "/"):
            return None
    places = ", ".join(str(m.get("mountPath")) for m in mounts) or "none"
    return (
        f"the bundle {bundle} is on none of the training container's volumes (mounts: "
        f"{places}); write checkpoints, and so bundles, to a volume every node can read"
    )


def pod_name(incident: Mapping[str, Any], node: str) -> str:
    """Deterministic from the incident (its uid too: a recreated incident of the same
    name gets a new pod) and the node; at most 63 characters."""
    meta = incident.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid')}/{node}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"sdc-confirm-{str(meta.get('name', ''))[:38].strip('-')}-{digest}"


def pod_body(
    incident: Mapping[str, Any],
    job: Mapping[str, Any],
    node: str,
    bundle: str,
    *,
    repeat: int,
    deadline_seconds: float,
    image: str | None = None,
    node_gpus: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """The confirmation pod, or ``(None, why not)``. ``node_gpus``: the node's allocatable
    accelerators (``nvidia.com/gpu``: 8); the pod asks for all of them, so the device
    plugin cannot hand it other GPUs than the suspect's (one of the node's; the pod picks
    the suspect's by UUID). Without it the training container's request is copied."""
    suspects = _status(incident).get("suspects") or [{}]
    template = training_template(job, suspects[0].get("pod"))
    if template is None:
        return None, "the job has no pod template"
    tspec = dict(template.get("spec") or {})
    container = _training_container(tspec)
    if container is None:
        return None, "the job's pod template has no container"
    mounts = list(container.get("volumeMounts") or [])
    problem = bundle_problem(bundle, mounts)
    if problem is not None:
        return None, problem
    chosen = image or container.get("image")
    if not chosen:
        return None, "the training container has no image (and no confirmation image is set)"
    mounted = {m.get("name") for m in mounts}
    meta = incident["metadata"]
    env = [e for e in container.get("env") or [] if e.get("name") != "NODE_NAME"]
    env.append({"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    confirm: dict[str, Any] = {
        "name": CONTAINER,
        "image": chosen,
        "command": ["python", "-m", "sdc_agent.confirm"],
        "args": [
            bundle,
            "--repeat",
            str(repeat),
            "--wait",
            str(BUNDLE_WAIT_SECONDS),
            "--termination-log",
            TERMINATION_LOG,
        ],
        "env": env,
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_LOG,
        # A crash before the summary is written still says something.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    for key in ("envFrom", "resources", "securityContext", "workingDir", "imagePullPolicy"):
        if container.get(key) and not (key == "imagePullPolicy" and image):
            confirm[key] = container[key]
    whole = _whole_node(container.get("resources") or {}, node_gpus or {})
    if whole:
        confirm["resources"] = whole
    tolerations = [
        t
        for t in tspec.get("tolerations") or []
        if t.get("key") not in (SUSPECT_KEY, _UNSCHEDULABLE_TOLERATION)
    ]
    tolerations += [
        {"key": SUSPECT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"},
        # the node is cordoned: the scheduler places a pod there only if it tolerates this
        {"key": _UNSCHEDULABLE_TOLERATION, "operator": "Exists", "effect": "NoSchedule"},
    ]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": max(1, int(deadline_seconds)),
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": tolerations,
        # It reads a bundle and computes; it has nothing to ask the API server.
        "automountServiceAccountToken": False,
        "volumes": [v for v in tspec.get("volumes") or [] if v.get("name") in mounted],
        "containers": [confirm],
    }
    for key in (
        "serviceAccountName",
        "imagePullSecrets",
        "securityContext",
        "runtimeClassName",
        "priorityClassName",
    ):
        if key in tspec:
            spec[key] = tspec[key]
    job_name = str(((incident.get("spec") or {}).get("job") or {}).get("name", ""))
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(incident, node),
            "namespace": meta["namespace"],
            # None of the labels the admission webhook selects training pods by.
            "labels": {
                CONFIRMATION_LABEL: "true",
                INCIDENT_LABEL: str(meta["name"])[:63],
                f"{GROUP}/job": job_name[:63],
            },
            "annotations": {f"{GROUP}/bundle": bundle},
            "ownerReferences": [
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": INCIDENT_KIND,
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": spec,
    }
    return body, ""


def _whole_node(resources: Mapping[str, Any], node_gpus: Mapping[str, Any]) -> dict[str, Any]:
    """The training container's resources with every accelerator the node has asked for
    (limits and requests alike: extended resources must be equal in both); ``{}`` where
    the node's allocatable accelerators are not known."""
    counts = {}
    for name, value in node_gpus.items():
        try:
            count = int(str(value))
        except ValueError:
            continue
        if count > 0:
            counts[name] = count
    if not counts:
        return {}
    out: dict[str, Any] = {}
    for part in ("limits", "requests"):
        kept = {
            k: v
            for k, v in dict(resources.get(part) or {}).items()
            if k not in GPU_RESOURCES or k in counts
        }
        if part == "limits" or resources.get("requests"):
            kept.update(counts)
        out[part] = kept
    return out


# -- reading the pod ---------------------------------------------------------------------------


def is_running(status: Mapping[str, Any]) -> bool:
    """A confirmation pod was created and its result is not recorded yet."""
    return (status.get("confirmation") or {}).get("outcome") == "running"


def running_record(
    pod: str,
    node: str,
    bundle: str,
    at: str,
    uid: str | None = None,
    images: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The record of a confirmation pod just created; ``uid`` pins the result to that very
    pod (a tenant may delete it and make another of the same name), ``images`` (container
    name -> image, :func:`pod_images`) to what it runs (a tenant may patch a pod's image)."""
    record: dict[str, Any] = {
        "outcome": "running",
        "pod": pod,
        "node": node,
        "bundle": bundle,
        "createdAt": at,
    }
    if uid:
        record["podUid"] = uid
    if images:
        record["images"] = dict(images)
    return record


def pod_images(pod: Mapping[str, Any]) -> dict[str, str]:
    """Container name -> image, over the pod's init containers and containers (the one
    field of a pod's spec that anyone with ``patch`` on pods may change after it was
    created; ephemeral containers are told apart by :func:`pod_changed`)."""
    spec = pod.get("spec") or {}
    return {
        str(c.get("name")): str(c.get("image"))
        for key in ("initContainers", "containers")
        for c in spec.get(key) or []
    }


def pod_changed(confirmation: Mapping[str, Any], pod: Mapping[str, Any]) -> str | None:
    """How the pod differs from the one the operator created and recorded, or ``None``:
    another image patched into it, an ephemeral container added, or the confirmation
    container restarted (``restartPolicy: Never``: only a changed spec restarts it, so a
    patched image that was patched back still shows)."""
    recorded = confirmation.get("images")
    if recorded and pod_images(pod) != dict(recorded):
        now = pod_images(pod)
        changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
        return f"its images were changed since it was created ({', '.join(changed)})"
    ephemeral = (pod.get("spec") or {}).get("ephemeralContainers") or []
    if ephemeral:
        names = ", ".join(str(c.get("name")) for c in ephemeral)
        return f"ephemeral containers were added to it ({names})"
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER and int(status.get("restartCount") or 0) > 0:
            return f"its container {CONTAINER} was restarted (its spec was changed)"
    return None


def pod_difference(
    found: Mapping[str, Any], as_created: Mapping[str, Any], node: str
) -> str | None:
    """What makes a pod found under our name other than the one we would create, or
    ``None``. ``as_created``: our pod as the API server would store it (a dry-run create:
    its defaults and admission applied), so the whole spec is compared, not only the
    containers' images and commands: env, volumes, security contexts, service account,
    tolerations, resources. Only ``nodeName`` may differ, where the scheduler set it to
    ``node``. Labels, annotations and owners must be ours too. An owner reference alone
    proves nothing (anyone who may create pods there can write one), and the name is no
    secret (the incident's uid is readable by the tenant)."""
    spec = dict(found.get("spec") or {})
    wanted = dict(as_created.get("spec") or {})
    if spec.get("nodeName") not in (None, "", node):
        return f"it runs on node {spec.get('nodeName')}, not {node}"
    if not wanted.get("nodeName"):
        spec.pop("nodeName", None)
        wanted.pop("nodeName", None)
    for key in sorted(set(spec) | set(wanted)):
        if spec.get(key) != wanted.get(key):
            return f"its spec.{key} is not ours"
    meta, ours = found.get("metadata") or {}, as_created.get("metadata") or {}
    for key in ("labels", "annotations", "ownerReferences"):
        if (meta.get(key) or None) != (ours.get(key) or None):
            return f"its metadata.{key} are not ours"
    return None


def _container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == CONTAINER:
            return dict(status.get("state") or {})
    return {}


def _scheduling_refusal(pod: Mapping[str, Any]) -> str | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "not scheduled")
    return None


def _at(value: Any) -> datetime | None:
    try:
        return parse_time(str(value))
    except ValueError:
        return None


def _gpus(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for gpu in summary.get("gpus") or []:
        if not isinstance(gpu, Mapping):
            continue
        entry: dict[str, Any] = {"result": str(gpu.get("result") or "")}
        for theirs, ours, kind in (
            ("index", "index", int),
            ("local_rank", "localRank", int),
            ("uuid", "uuid", str),
            ("seconds", "seconds", float),
        ):
            value = gpu.get(theirs)
            if value is not None and not isinstance(value, bool):
                try:
                    entry[ours] = kind(value)
                except (TypeError, ValueError):
                    continue
        if gpu.get("why"):  # why it could not run, or what differed: the person deciding needs it
            entry["why"] = str(gpu["why"])[:512]
        out.append(entry)
    return out[:64]


def suspect_gpu_problem(
    gpus: Sequence[Mapping[str, Any]], suspects: Sequence[Mapping[str, Any]]
) -> str | None:
    """Why a "not reproduced" does not speak for the suspect's own GPU, or ``None``.

    The suspect's GPU is found among those the confirmation ran on by its UUID where the
    suspect's is known and the run reported any (the device plugin numbers a pod's GPUs
    from 0, so a local rank names a GPU of this pod, not of the training pod), else by
    local rank. Not found, or found and could not run: the run says nothing about it."""
    problems = []
    with_uuid = any(g.get("uuid") for g in gpus)
    for suspect in suspects:
        uuid = suspect.get("gpuUUID")
        local = suspect.get("localRank")
        if uuid and with_uuid:
            gpu = next((g for g in gpus if g.get("uuid") == uuid), None)
            named = f"the suspect's GPU {uuid}"
        elif local is not None:
            gpu = next((g for g in gpus if g.get("localRank") == local), None)
            named = f"the suspect's GPU (local rank {local})"
        else:
            continue
        if gpu is None:
            ran = ", ".join(_describe(g) for g in gpus) or "none"
            problems.append(f"{named} was not among those the confirmation ran on ({ran})")
        elif gpu.get("result") == "could-not-run":
            problems.append(f"{named} could not run: {gpu.get('why') or 'no reason given'}")
    return "; ".join(problems) or None


def _from_exit(
    terminated: Mapping[str, Any],
    base: dict[str, Any],
    suspects: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, str, str, dict[str, Any]]:
    """(outcome, reason, message, record) from the container's terminated state."""
    code = terminated.get("exitCode")
    text = str(terminated.get("message") or "")
    record = {
        **base,
        "exitCode": code,
        "startedAt": terminated.get("startedAt"),
        "finishedAt": terminated.get("finishedAt"),
    }
    record = {k: v for k, v in record.items() if v is not None}
    try:
        summary = json.loads(text) if text.strip().startswith("{") else None
    except ValueError:
        summary = None
    outcome = EXIT_OUTCOMES.get(int(code)) if isinstance(code, int) else None
    if outcome is None:
        why = (
            f"the confirmation exited with code {code} ({terminated.get('reason') or 'no reason'})"
            f": {text[-600:].strip() or 'no message'}"
        )
        return "unknown", "CouldNotRun", why, record
    if not isinstance(summary, Mapping) or summary.get("outcome") != outcome:
        said = summary.get("outcome") if isinstance(summary, Mapping) else None
        why = (
            f"the confirmation exited with code {code} ({outcome}) but its termination message "
            + (f"says {said!r}" if said else "is not its summary")
            + f": {text[:300].strip() or 'empty'}"
        )
        return "unknown", "UnreadableResult", why, record
    record["gpus"] = _gpus(summary)
    if summary.get("dcgmi") is not None:
        record["dcgmi"] = str(summary.get("dcgmi"))
    if isinstance(summary.get("seconds"), int | float):
        record["seconds"] = float(summary["seconds"])
    reason = str(summary.get("reason") or "")[:1024]
    if outcome == "confirmed":
        bad = [g for g in record["gpus"] if g.get("result") == "reproduces"]
        names = ", ".join(_describe(g) for g in bad) or "a GPU"
        return (
            outcome,
            "Reproduced",
            f"{names} of node {base['node']} reproduced it: {reason}",
            record,
        )
    if outcome == "not-confirmed":
        missed = suspect_gpu_problem(record["gpus"], suspects)
        if missed is not None:
            why = f"on node {base['node']}: not reproduced, but {missed}"
            return "unknown", "SuspectGPUNotRun", why, record
        return outcome, "NotReproduced", f"on node {base['node']}: {reason}", record
    return outcome, "Inconclusive", f"on node {base['node']}: {reason}", record


def _describe(gpu: Mapping[str, Any]) -> str:
    uuid = f", {gpu['uuid']}" if gpu.get("uuid") else ""
    return f"GPU {gpu.get('index', '?')} (local rank {gpu.get('localRank', '?')}{uuid})"


def judge(
    confirmation: Mapping[str, Any],
    pod: Mapping[str, Any] | None,
    now: datetime,
    *,
    start_seconds: float,
    deadline_seconds: float,
    suspects: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, str, str, dict[str, Any]] | None:
    """What a running confirmation came to, as ``(outcome, reason, message, record)``
    (``record`` is the new ``status.confirmation``), or ``None`` while it still runs.

    ``confirmation`` is the running record; ``pod`` the pod as the cache has it (``None``:
    not there); ``suspects`` the incident's suspects on the node (a "not reproduced" that
    did not run on a suspect's GPU is Unknown, :func:`suspect_gpu_problem`). A pod that has
    not started ``start_seconds`` after it was created is given
    up (unschedulable, its image, ...); one that runs past ``deadline_seconds`` (the
    kubelet stops it at ``activeDeadlineSeconds``) is a timeout.
    """
    base = {
        k: confirmation[k]
        for k in ("pod", "podUid", "node", "bundle", "createdAt")
        if k in confirmation
    }
    created = _at(confirmation.get("createdAt")) or now
    node = str(confirmation.get("node"))
    if pod is None:
        if now - created < timedelta(seconds=POD_GONE_GRACE_SECONDS):
            return None
        why = f"the confirmation pod {confirmation.get('pod')} was deleted before it finished"
        return "unknown", "PodGone", why, base
    uid = confirmation.get("podUid")
    if uid and (pod.get("metadata") or {}).get("uid") != uid:
        why = (
            f"the confirmation pod {confirmation.get('pod')} was replaced by another pod of "
            "the same name: its result is not the operator's"
        )
        return "unknown", "PodReplaced", why, base
    changed = pod_changed(confirmation, pod)
    if changed is not None:
        why = (
            f"the confirmation pod {confirmation.get('pod')} is not the one the operator "
            f"created: {changed}; its result is not the operator's"
        )
        return "unknown", "PodChanged", why, base
    bound = (pod.get("spec") or {}).get("nodeName")
    if bound and bound != node:
        why = f"the confirmation pod ran on {bound}, not on the suspect node {node}"
        return "unknown", "WrongNode", why, base
    state = _container_state(pod)
    phase = (pod.get("status") or {}).get("phase")
    if "terminated" in state:
        return _from_exit(state["terminated"], base, suspects)
    if phase in ("Failed", "Succeeded"):  # stopped before (or without) the container
        reason = str((pod.get("status") or {}).get("reason") or "")
        message = str((pod.get("status") or {}).get("message") or reason or "no message")
        if reason == "DeadlineExceeded":
            return "unknown", "Timeout", f"stopped after {deadline_seconds:g} s: {message}", base
        return "unknown", "CouldNotRun", f"the pod {phase.lower()}: {message}", base
    if "running" in state:
        started = _at(state["running"].get("startedAt")) or created
        limit = timedelta(seconds=deadline_seconds + DEADLINE_GRACE_SECONDS)
        if now - started > limit:
            why = f"still running {deadline_seconds:g} s after it started"
            return "unknown", "Timeout", why, base
        return None
    if now - created <= timedelta(seconds=start_seconds):
        return None
    waiting = state.get("waiting") or {}
    refusal = _scheduling_refusal(pod)
    after = f"not started {start_seconds:g} s after it was created"
    if refusal is not None:
        return "unknown", "Unschedulable", f"{after}: unschedulable: {refusal}", base
    if waiting.get("reason") in _IMAGE_PULL:
        message = f"{after}: {waiting.get('reason')}: {waiting.get('message') or ''}".strip()
        return "unknown", "ImagePullFailed", message, base
    if waiting.get("reason"):
        message = f"{after}: {waiting.get('reason')}: {waiting.get('message') or ''}".strip()
        return "unknown", "CouldNotStart", message, base
    return "unknown", "NotStarted", f"{after} (phase {phase or 'Pending'})", base


def orphaned(pod: Mapping[str, Any], incidents: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the confirmation pod ``pod`` is to be deleted now, or ``None``: it has not ended
    (it holds the node's GPUs until its deadline), and every incident whose record reads it
    (``status.confirmation.podUid``: the one that made it and those sharing it) has
    recorded its result. That is what an operator that died between recording the result
    and deleting the pod leaves (the record is the intent; the delete is by uid, so a pod
    made since under the name is never touched). ``incidents``: those of the pod's
    namespace. A pod no record reads yet is left alone: its create may be recorded
    ``Pending`` (a restart finds it and reads it), and a pod whose incident is gone is
    the garbage collector's (its owner reference)."""
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    if (
        not uid
        or meta.get("deletionTimestamp")
        or (meta.get("labels") or {}).get(CONFIRMATION_LABEL) != "true"
        or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    ):
        return None
    readers = [
        (incident, record)
        for incident in incidents
        if (incident.get("metadata") or {}).get("namespace") == meta.get("namespace")
        for record in [_status(incident).get("confirmation") or {}]
        if record.get("podUid") == uid
    ]
    if not readers or any(r.get("outcome") not in OUTCOMES for _, r in readers):
        return None
    said = ", ".join(
        f"{(i.get('metadata') or {}).get('name')} ({r.get('outcome')})" for i, r in readers
    )
    return f"its result is recorded ({said}) and it has not ended"


def outcome_of(status: Mapping[str, Any]) -> str | None:
    return (status.get("confirmation") or {}).get("outcome")


def confirmed_node(status: Mapping[str, Any]) -> str | None:
    """The node a finished confirmation reproduced the fault on (``Confirmed=True``)."""
    confirmed: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Confirmed"), {}
    )
    if confirmed.get("status") != "True" or outcome_of(status) != "confirmed":
        return None
    node = (status.get("confirmation") or {}).get("node")
    return str(node) if node else None


CONDITION_STATUS = {"confirmed": "True", "not-confirmed": "False", "unknown": "Unknown"}


def record(
    outcome: str, reason: str, message: str, found: Mapping[str, Any], at: str
) -> tuple[dict[str, Any], tuple[str, str, str, str]]:
    """The confirmation's result as ``(status.confirmation, the condition Confirmed as
    (type, status, reason, message))``."""
    entry = {**found, "outcome": outcome, "reason": message[:1024]}
    entry.setdefault("finishedAt", at)
    return entry, ("Confirmed", CONDITION_STATUS[outcome], reason, message)
