"""``kubectl sdc``: read an incident's story and take the review decision.

    kubectl sdc describe INCIDENT [-n NAMESPACE] [-o text|json]
    kubectl sdc approve  INCIDENT [-n NAMESPACE] [--action replace|reboot] [--overwrite]
    kubectl sdc release  INCIDENT [-n NAMESPACE] [--overwrite]
    kubectl sdc uninstall [--release-nodes] [--dry-run] [--stop NAMESPACE/DEPLOYMENT]
                          [--stop-timeout SECONDS] [-o text|json]

An executable named ``kubectl-sdc`` on ``PATH`` is a kubectl plugin: ``kubectl sdc ...``
runs it with the same arguments. It reads the kubeconfig as kubectl does (``--kubeconfig``,
else ``KUBECONFIG``, else ``~/.kube/config``; ``--context``; the context's namespace unless
``-n`` is given) and falls back to in-cluster credentials.

``describe`` prints the incident's timeline (reports, conditions, actions, and the Events
on the incident, its job and its suspect nodes, in time order), its suspects, the
confirmation per GPU where there is one, the evidence, and what the review can decide now.
``approve`` and ``release`` record the decision as the ``hyperpod-sdc.dev/action``
annotation, which the operator acts on: ``replace`` or ``reboot`` the quarantined node
through HyperPod, or ``release`` it. Where the SDCPolicy admitting the incident's namespace
says ``approvals: cluster`` they record it, as the operator then reads it, as
``approve.hyperpod-sdc.dev/<incident uid>`` on that policy (only a cluster admin may; a
tenant is refused, and nothing is written). They refuse, saying why and changing nothing, where
the decision makes no sense in the incident's phase (nothing quarantined yet or at all,
dry-run, already released or replaced, another decision pending). The write carries the
incident's ``resourceVersion``: a concurrent change is re-read and decided again.
``uninstall`` is the clean-up before ``helm uninstall`` (the chart's pre-delete hook runs
it; :mod:`.uninstall` says what it does and leaves): it stops the operator (``--stop``:
scales its Deployment to zero and waits, up to ``--stop-timeout`` seconds, until none of
its pods is left; if some are still there then, it does nothing more and fails), lists
every node quarantined and every job suspended, releases the nodes only with
``--release-nodes``, resumes nothing, deletes the operator's ConfigMaps and confirmation
pods in tenant namespaces, and keeps the incidents and CRDs.
Exit codes: 0 done, 1 refused or failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import uninstall
from .jobs import JOB_KINDS
from .names import ACTION_ANNOTATION, GROUP, INCIDENT_PLURAL, POLICY_PLURAL, VERSION
from .nodes import release_patch
from .policy import APPROVAL_PREFIX, namespace_admission

__all__ = [
    "DECISIONS",
    "TimelineEntry",
    "main",
    "render_describe",
    "review_refusal",
    "timeline",
]

DECISIONS = ("replace", "reboot", "release")
FIELD_MANAGER = "kubectl-sdc"
_RETRIES = 5


# -- pure: the story -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    at: str
    """ISO 8601 UTC, as the API server writes it; empty where unknown (sorted first)."""
    kind: str
    """``recorded``, ``report``, ``condition``, ``action``, ``event``, ``confirmation``."""
    text: str


def _event_time(event: Mapping[str, Any]) -> str:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        value = event.get(key)
        if value:
            return str(value)[:19] + "Z" if len(str(value)) > 20 else str(value)
    return str((event.get("metadata") or {}).get("creationTimestamp") or "")


def _status(incident: Mapping[str, Any]) -> dict[str, Any]:
    return dict(incident.get("status") or {})


def confirmation_of(incident: Mapping[str, Any]) -> dict[str, Any] | None:
    """The confirmation result the operator recorded (``status.confirmation``), if any."""
    found = _status(incident).get("confirmation")
    return dict(found) if isinstance(found, Mapping) else None


def timeline(
    incident: Mapping[str, Any], events: Sequence[Mapping[str, Any]]
) -> list[TimelineEntry]:
    """Everything that happened to ``incident``, oldest first. Pure."""
    meta = incident.get("metadata") or {}
    spec = incident.get("spec") or {}
    status = _status(incident)
    entries = [
        TimelineEntry(
            str(meta.get("creationTimestamp") or ""),
            "recorded",
            f"incident recorded: {spec.get('check')} check at step {spec.get('detectionStep')}",
        )
    ]
    for report in status.get("reports") or []:
        suspects = ", ".join(map(str, report.get("suspectRanks") or [])) or "none"
        entries.append(
            TimelineEntry(
                str(report.get("receivedAt") or ""),
                "report",
                f"report from node {report.get('node')} (pod {report.get('pod')}, rank "
                f"{report.get('rank')}): {report.get('classification')}, "
                f"{'localized' if report.get('localized') else 'not localized'}, "
                f"suspect ranks {suspects}",
            )
        )
    for condition in status.get("conditions") or []:
        entries.append(
            TimelineEntry(
                str(condition.get("lastTransitionTime") or ""),
                "condition",
                f"{condition.get('type')}={condition.get('status')} "
                f"({condition.get('reason')}): {condition.get('message', '')}",
            )
        )
    for action in status.get("actions") or []:
        reason = f" [{action['reason']}]" if action.get("reason") else ""
        entries.append(
            TimelineEntry(
                str(action.get("at") or ""),
                "action",
                f"{action.get('action')} {action.get('target')}: {action.get('result')}{reason}"
                f" - {action.get('message', '')}",
            )
        )
    for event in events:
        obj = event.get("involvedObject") or {}
        count = int(event.get("count") or 1)
        entries.append(
            TimelineEntry(
                _event_time(event),
                "event",
                f"{event.get('type')} {event.get('reason')} on {obj.get('kind')} "
                f"{obj.get('name')}: {event.get('message', '')}"
                + (f" (x{count})" if count > 1 else ""),
            )
        )
    confirmation = confirmation_of(incident)
    if confirmation is not None:
        entries.append(
            TimelineEntry(
                str(confirmation.get("finishedAt") or confirmation.get("startedAt") or ""),
                "confirmation",
                f"confirmation on {confirmation.get('node')}: {confirmation.get('outcome')} - "
                f"{confirmation.get('reason', '')}",
            )
        )

    def cause_first(entry: TimelineEntry) -> int:
        # Within one second (the API's resolution): reports lead to Detected, which leads
        # to actions, which lead to the other conditions and the Events that say so.
        if entry.kind == "condition":
            return 2 if entry.text.startswith("Detected=") else 4
        return {"recorded": 0, "report": 1, "action": 3, "event": 5}.get(entry.kind, 6)

    return sorted(entries, key=lambda e: (e.at, cause_first(e)))


def _quarantined(status: Mapping[str, Any]) -> list[str]:
    return [
        str(a.get("target"))
        for a in status.get("actions") or []
        if a.get("action") == "quarantine-node" and a.get("result") == "Succeeded"
    ]


def _condition(status: Mapping[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in status.get("conditions") or [] if c.get("type") == type_), {})


def _done(status: Mapping[str, Any], action: str) -> bool:
    return any(
        a.get("action") == action and a.get("result") in ("Succeeded", "Skipped")
        for a in status.get("actions") or []
    )


_ON_THE_INCIDENT = object()


def review_refusal(
    incident: Mapping[str, Any],
    decision: str,
    *,
    overwrite: bool = False,
    current: Any = _ON_THE_INCIDENT,
) -> str | None:
    """Why ``decision`` (``replace``, ``reboot`` or ``release``) cannot be recorded on
    ``incident`` now, or ``None`` when it can. ``current``: the decision recorded already
    where it is not the incident's annotation (``approvals: cluster``: the policy's). Pure."""
    if decision not in DECISIONS:
        return f"unknown decision {decision!r}; one of {', '.join(DECISIONS)}"
    status = _status(incident)
    phase = status.get("phase")
    verb = {"replace": "replace", "reboot": "reboot", "release": "release"}[decision]
    if phase in (None, "WaitingForAgreement"):
        return (
            "the incident is waiting for agreement (one node's report is not enough to act on): "
            f"nothing is quarantined, nothing to {verb}"
        )
    if phase == "Detected":
        return "containment is still in progress (phase Detected): try again in a few seconds"
    if phase in ("Transient", "AwaitingEvidence"):
        why = (
            "one glitch: nothing is quarantined unless the same node is caught again"
            if phase == "Transient"
            else "the verdict is not corroborated yet: nothing is quarantined until it is"
        )
        return f"the incident is held ({phase}, {why}): nothing to {verb}"
    if phase == "NotHardware":
        classification = (incident.get("spec") or {}).get("classification")
        return (
            f"the verdict does not accuse hardware ({classification}): nothing was "
            f"quarantined, nothing to {verb}"
        )
    if phase == "DryRun":
        return "the operator runs in dry-run: it records what it would do and acts on no decision"
    if phase == "Released":
        return "the node was already released: the review of this incident is over"
    nodes = _quarantined(status)
    if not nodes:
        contained = _condition(status, "Contained")
        return (
            f"no node was quarantined (Contained: {contained.get('reason')}: "
            f"{contained.get('message', '')}): nothing to {verb}"
        )
    if phase == "Remediated":
        remediated = _condition(status, "Remediated")
        if remediated.get("reason") == "ReplaceRequested" or _done(status, "replace-node"):
            return (
                "the node's replacement was already requested from HyperPod: nothing left to decide"
            )
        if decision == "reboot" and _done(status, "reboot-node"):
            return "a reboot was already requested; after it, decide replace or release"
    where = ACTION_ANNOTATION
    if current is _ON_THE_INCIDENT:
        current = ((incident.get("metadata") or {}).get("annotations") or {}).get(where)
    else:
        where = f"{APPROVAL_PREFIX}{(incident.get('metadata') or {}).get('uid')}"
    pending = current in DECISIONS and not _done(status, f"{current}-node")
    if pending and current != decision and not overwrite:
        return (
            f"another decision is pending: {where}={current} (not yet carried "
            "out); give --overwrite to change it"
        )
    return None


@dataclass(frozen=True, slots=True)
class Approvals:
    """Where a person's decision about an incident is read (:func:`approvals_for`)."""

    cluster: bool
    """``approvals: cluster``: only an annotation on an admitting SDCPolicy counts."""
    policy: str | None = None
    """The policy the CLI writes the decision on (the first admitting one by name: where
    several record a decision, the operator reads the first's)."""
    current: str | None = None
    """The decision the admitting policies record for the incident now."""
    unknown: str | None = None
    """Why it could not be told (the SDCPolicies could not be read): the incident's
    annotation is written, and counts only under ``approvals: namespace``."""


def approvals_for(
    incident: Mapping[str, Any],
    policies: Sequence[Mapping[str, Any]] | None,
    namespace_labels: Mapping[str, str],
) -> Approvals:
    """Whether the incident's namespace decides (``approvals: namespace``) or a cluster
    admin (``cluster``), as the operator reads it (:func:`.policy.namespace_admission`).
    ``policies`` ``None``: they could not be read. Pure."""
    meta = incident.get("metadata") or {}
    if policies is None:
        return Approvals(False, unknown="the SDCPolicies could not be read")
    found = namespace_admission(policies, str(meta.get("namespace")), namespace_labels)
    if not found.admitted or not found.cluster_approvals:
        return Approvals(False)
    return Approvals(True, found.policies[0], found.approved.get(str(meta.get("uid"))))


def _gpu_line(gpu: Mapping[str, Any]) -> str:
    local = gpu.get("local_rank", gpu.get("localRank"))
    uuid = gpu.get("uuid") or gpu.get("gpuUUID") or "-"
    seconds = gpu.get("seconds")
    timing = f"{float(seconds):.1f} s" if isinstance(seconds, int | float) else "-"
    index, result = gpu.get("index", "-"), gpu.get("result", "-")
    why = f"  {gpu['why']}" if gpu.get("why") else ""
    return f"  {index!s:<5} {local!s:<10} {uuid:<42} {result:<20} {timing}{why}"


def render_describe(incident: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> str:
    """What ``kubectl sdc describe`` prints. Pure."""
    meta = incident.get("metadata") or {}
    spec = incident.get("spec") or {}
    status = _status(incident)
    job = spec.get("job") or {}
    lines = [
        f"Incident:    {meta.get('namespace')}/{meta.get('name')}",
        f"Job:         {job.get('kind')} {meta.get('namespace')}/{job.get('name')} "
        f"(uid {job.get('uid')})",
        f"Check:       {spec.get('check')} ({spec.get('classification')}; "
        f"{'localized' if spec.get('localized') else 'not localized'}"
        + (
            f"; {'transient' if spec.get('transient') else 'persistent'}"
            if spec.get("transient") is not None
            else ""
        )
        + ")",
        f"Window:      steps ({spec.get('lastCleanStep')}, {spec.get('detectionStep')}]: "
        f"last clean step {spec.get('lastCleanStep')}, detected at step "
        f"{spec.get('detectionStep')}",
        f"Phase:       {status.get('phase', '-')}",
        f"Message:     {spec.get('message', '')}",
        *([f"Guidance:    {status['message']}"] if status.get("message") else []),
        "",
        "Suspects:",
    ]
    suspects = status.get("suspects") or []
    if not suspects:
        lines.append("  (none)")
    for s in suspects:
        lines.append(
            f"  rank {s.get('rank')} (local rank {s.get('localRank', '-')}, GPU "
            f"{s.get('gpuUUID', '-')}) pod {s.get('pod', '-')} on node {s.get('node', '-')} "
            f"(instance {s.get('instanceId', '-')})"
        )
    lines += ["", "Timeline (UTC):"]
    for entry in timeline(incident, events):
        lines.append(f"  {entry.at or '-':<20}  {entry.kind:<12} {entry.text}")
    confirmation = confirmation_of(incident)
    lines += ["", "Confirmation:"]
    confirmed = _condition(status, "Confirmed")
    if confirmation is None and not confirmed:
        lines.append("  (none)")
    else:
        if confirmed:
            lines.append(
                f"  Confirmed={confirmed.get('status')} ({confirmed.get('reason')}): "
                f"{confirmed.get('message', '')}"
            )
        if confirmation is not None:
            lines.append(
                f"  outcome {confirmation.get('outcome')} on node {confirmation.get('node', '-')}: "
                f"{confirmation.get('reason', '')}"
            )
            gpus = confirmation.get("gpus") or []
            if gpus:
                lines.append(f"  {'GPU':<5} {'LOCAL RANK':<10} {'UUID':<42} {'RESULT':<20} TIME")
                lines += [_gpu_line(g) for g in gpus]
            if confirmation.get("bundle"):
                lines.append(f"  bundle: {confirmation['bundle']}")
    lines += ["", "Evidence:"]
    evidence = spec.get("evidence")
    if evidence:
        lines += [
            "  " + line for line in json.dumps(evidence, indent=2, sort_keys=True).splitlines()
        ]
    else:
        lines.append("  (none)")
    lines += ["", "Review:"]
    current = (meta.get("annotations") or {}).get(ACTION_ANNOTATION)
    lines.append(f"  {ACTION_ANNOTATION}: {current or '(not set)'}")
    name = meta.get("name")
    namespace = meta.get("namespace")
    possible = [d for d in DECISIONS if review_refusal(incident, d, overwrite=True) is None]
    if possible:
        commands = {
            "replace": f"kubectl sdc approve {name} -n {namespace} --action replace",
            "reboot": f"kubectl sdc approve {name} -n {namespace} --action reboot",
            "release": f"kubectl sdc release {name} -n {namespace}",
        }
        lines += [f"  {commands[d]}" for d in possible]
    else:
        lines.append(
            f"  nothing to decide now: {review_refusal(incident, 'replace', overwrite=True)}"
        )
    return "\n".join(lines) + "\n"


# -- talking to the cluster ----------------------------------------------------------------


class _Cluster:
    """The few calls the CLI makes, with the kubeconfig kubectl would use."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config

        self.namespace = "default"
        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
            chosen = active
            if context is not None:
                contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
                chosen = next((c for c in contexts if c.get("name") == context), active)
            self.namespace = (chosen or {}).get("context", {}).get("namespace") or "default"
        except config.ConfigException:
            if kubeconfig is not None or context is not None:
                raise
            config.load_incluster_config()
            path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
            if os.path.exists(path):
                with open(path) as f:
                    self.namespace = f.read().strip() or "default"
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _raw(self, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = fn(*args, _preload_content=False, **kwargs)
        try:
            return dict(json.loads(response.data))
        finally:
            response.release_conn()

    def incident(self, namespace: str, name: str) -> dict[str, Any]:
        return self._raw(
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            INCIDENT_PLURAL,
            name,
        )

    def events_about(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        found = self._raw(
            self.core.list_namespaced_event,
            namespace,
            field_selector=f"involvedObject.kind={kind},involvedObject.name={name}",
        )
        return list(found.get("items") or [])

    def annotate(self, incident: Mapping[str, Any], decision: str) -> dict[str, Any]:
        meta = incident["metadata"]
        patch = {
            "metadata": {
                # With the resourceVersion the write fails (409) if anything changed since
                # the decision was checked against what was read.
                "resourceVersion": meta["resourceVersion"],
                "annotations": {ACTION_ANNOTATION: decision},
            }
        }
        return self._raw(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            meta["namespace"],
            INCIDENT_PLURAL,
            meta["name"],
            patch,
            field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json",
        )

    def policies(self) -> list[dict[str, Any]] | None:
        """Every SDCPolicy, or ``None`` where the user may not list them (a tenant)."""
        try:
            found = self._raw(self.custom.list_cluster_custom_object, GROUP, VERSION, POLICY_PLURAL)
        except Exception as exc:
            if _status_code(exc) in (401, 403, 404):
                return None
            raise
        return list(found.get("items") or [])

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        try:
            found = self._raw(self.core.read_namespace, namespace)
        except Exception as exc:
            if _status_code(exc) in (403, 404):
                return {}
            raise
        return dict((found.get("metadata") or {}).get("labels") or {})

    def approve_on_policy(
        self, policy: str, incident: Mapping[str, Any], decision: str
    ) -> dict[str, Any]:
        """Record a cluster admin's decision on the SDCPolicy (``approvals: cluster``)."""
        current = self._raw(
            self.custom.get_cluster_custom_object, GROUP, VERSION, POLICY_PLURAL, policy
        )
        patch = {
            "metadata": {
                # A concurrent change of the policy fails the write (409): decided again.
                "resourceVersion": current["metadata"]["resourceVersion"],
                "annotations": {f"{APPROVAL_PREFIX}{incident['metadata']['uid']}": decision},
            }
        }
        return self._raw(
            self.custom.patch_cluster_custom_object,
            GROUP,
            VERSION,
            POLICY_PLURAL,
            policy,
            patch,
            field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json",
        )

    def post_event(self, incident: Mapping[str, Any], reason: str, message: str) -> None:
        import secrets

        from .times import now_iso

        meta = incident["metadata"]
        now = now_iso()
        body = {
            "metadata": {
                "name": f"{meta['name']}.{secrets.token_hex(8)}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": incident.get("apiVersion"),
                "kind": incident.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message,
            "type": "Normal",
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.core.create_namespaced_event(meta["namespace"], body)

    # -- uninstall ----------------------------------------------------------------------

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._raw(self.core.list_node).get("items") or [])

    def node(self, name: str) -> dict[str, Any]:
        return self._raw(self.core.read_node, name)

    def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self.core.patch_node(
            name, patch, field_manager=FIELD_MANAGER, _content_type="application/merge-patch+json"
        )

    def all_incidents(self) -> list[dict[str, Any]]:
        found = self._raw(self.custom.list_cluster_custom_object, GROUP, VERSION, INCIDENT_PLURAL)
        return list(found.get("items") or [])

    def job(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        plural = JOB_KINDS.get((api_version, kind))
        if plural is None:
            return None
        group, _, version = api_version.partition("/")
        try:
            return self._raw(
                self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
            )
        except Exception as exc:
            if _status_code(exc) == 404:
                return None
            raise

    def labelled(self, kind: str, selector: str) -> list[tuple[str, str]]:
        fn = (
            self.core.list_config_map_for_all_namespaces
            if kind == "configmap"
            else self.core.list_pod_for_all_namespaces
        )
        items = self._raw(fn, label_selector=selector).get("items") or []
        return [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        fn = (
            self.core.delete_namespaced_config_map
            if kind == "configmap"
            else self.core.delete_namespaced_pod
        )
        try:
            fn(name, namespace)
        except Exception as exc:
            if _status_code(exc) != 404:
                raise

    def stop_deployment(self, namespace: str, name: str, timeout: float) -> bool:
        """Scale the operator's Deployment to zero and wait until none of its pods is left
        (the ReplicaSets' pods, not this hook's own, which carries the same labels): nothing
        may quarantine a node after the clean-up has listed them."""
        import time

        from kubernetes import client

        apps = client.AppsV1Api(self.api)
        try:
            deployment = self._raw(apps.read_namespaced_deployment, name, namespace)
        except Exception as exc:
            if _status_code(exc) == 404:
                return True
            raise
        apps.patch_namespaced_deployment_scale(
            name,
            namespace,
            {"spec": {"replicas": 0}},
            _content_type="application/merge-patch+json",
        )
        labels = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        # Only the pods its ReplicaSets made (they carry pod-template-hash): the hook's own
        # pod has the chart's labels too, selector labels included, and must not be waited on.
        selector = ",".join([*(f"{k}={v}" for k, v in sorted(labels.items())), "pod-template-hash"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self._raw(self.core.list_namespaced_pod, namespace, label_selector=selector)
            if not pods.get("items"):
                return True
            time.sleep(1.0)
        return False


def _uninstall(
    cluster: _Cluster,
    *,
    release_nodes: bool,
    dry_run: bool,
    output: str,
    stop: str | None,
    stop_timeout: float = 120.0,
) -> int:
    if stop and not dry_run:
        namespace, _, name = stop.partition("/")
        if not cluster.stop_deployment(namespace, name, timeout=stop_timeout):
            print(
                f"kubectl sdc: the operator {stop} did not stop within {stop_timeout:g} s "
                "(its pods are still there); nothing was cleaned up: run it again once they "
                "are gone",
                file=sys.stderr,
            )
            return 1
    incidents = cluster.all_incidents()
    jobs: dict[tuple[str, str, str], dict[str, Any]] = {}
    for incident in incidents:
        ref = (incident.get("spec") or {}).get("job") or {}
        namespace = str(incident["metadata"]["namespace"])
        key = (namespace, str(ref.get("kind")), str(ref.get("name")))
        if key not in jobs:
            found = cluster.job(namespace, str(ref.get("apiVersion")), key[1], key[2])
            if found is not None:
                jobs[key] = found
    configmaps = cluster.labelled("configmap", uninstall.MANAGED_SELECTOR)
    pods = cluster.labelled("pod", uninstall.CONFIRMATION_SELECTOR)
    plan = uninstall.plan(cluster.nodes(), incidents, jobs, configmaps, pods)
    if not dry_run:
        if release_nodes:
            for left in plan.nodes:
                _release_node(cluster, left.name)
        for namespace, name in plan.configmaps:
            cluster.delete("configmap", namespace, name)
        for namespace, name in plan.pods:
            cluster.delete("pod", namespace, name)
    if output == "json":
        print(json.dumps(plan.as_json(release_nodes and not dry_run), indent=2, sort_keys=True))
    else:
        sys.stdout.write(uninstall.render_plan(plan, released=release_nodes, dry_run=dry_run))
    return 0


def _release_node(cluster: _Cluster, name: str) -> None:
    """The operator's release patch, under the read's resourceVersion (re-read on 409)."""
    for _ in range(_RETRIES):
        patch = release_patch(cluster.node(name))
        if patch is None:
            return
        try:
            cluster.patch_node(name, patch)
            return
        except Exception as exc:
            if _status_code(exc) != 409:
                raise
    raise RuntimeError(f"node {name} keeps changing; release it again")


def _status_code(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def _gather_events(cluster: _Cluster, incident: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Events on the incident, its job, and its suspect nodes (the kubelet's way: node
    Events live in ``default``) since the incident was recorded."""
    meta = incident["metadata"]
    namespace = meta["namespace"]
    job = (incident.get("spec") or {}).get("job") or {}
    found = cluster.events_about(namespace, str(incident.get("kind")), meta["name"])
    if job.get("kind") and job.get("name"):
        found += cluster.events_about(namespace, job["kind"], job["name"])
    nodes = {s.get("node") for s in _status(incident).get("suspects") or [] if s.get("node")}
    since = str(meta.get("creationTimestamp") or "")
    for node in sorted(nodes):
        found += [
            e for e in cluster.events_about("default", "Node", node) if _event_time(e) >= since
        ]
    return found


def _split_name(name: str, namespace: str | None) -> tuple[str | None, str]:
    if "/" in name:
        ns, _, bare = name.partition("/")
        return ns, bare
    return namespace, name


def _describe(cluster: _Cluster, namespace: str, name: str, output: str) -> int:
    incident = cluster.incident(namespace, name)
    events = _gather_events(cluster, incident)
    if output == "json":
        entries = [{"at": e.at, "kind": e.kind, "text": e.text} for e in timeline(incident, events)]
        print(json.dumps({"incident": incident, "timeline": entries}, indent=2, sort_keys=True))
    else:
        sys.stdout.write(render_describe(incident, events))
    return 0


def _decide(cluster: _Cluster, namespace: str, name: str, decision: str, overwrite: bool) -> int:
    for _ in range(_RETRIES):
        incident = cluster.incident(namespace, name)
        approvals = approvals_for(incident, cluster.policies(), cluster.namespace_labels(namespace))
        if approvals.cluster:
            where = f"{APPROVAL_PREFIX}{incident['metadata']['uid']}"
            current = approvals.current
            refusal = review_refusal(incident, decision, overwrite=overwrite, current=current)
        else:
            where = ACTION_ANNOTATION
            current = (incident["metadata"].get("annotations") or {}).get(ACTION_ANNOTATION)
            refusal = review_refusal(incident, decision, overwrite=overwrite)
        if refusal is not None:
            print(f"kubectl sdc: refused: incident {namespace}/{name}: {refusal}", file=sys.stderr)
            return 1
        if current == decision:
            print(f"incident {namespace}/{name}: {where}={decision} was already recorded")
            return 0
        try:
            if approvals.cluster:
                assert approvals.policy is not None
                cluster.approve_on_policy(approvals.policy, incident, decision)
            else:
                cluster.annotate(incident, decision)
        except Exception as exc:
            if _status_code(exc) == 409:  # changed meanwhile: read again, decide again
                continue
            if approvals.cluster and _status_code(exc) == 403:
                print(
                    f"kubectl sdc: refused: incident {namespace}/{name}: SDCPolicy "
                    f"{approvals.policy} admitting namespace {namespace} says approvals: "
                    f"cluster, so only a cluster admin decides (patch on sdcpolicies.{GROUP} "
                    f"{approvals.policy}; yours is forbidden); nothing was recorded",
                    file=sys.stderr,
                )
                return 1
            raise
        break
    else:
        print(
            f"kubectl sdc: incident {namespace}/{name} keeps changing; try again", file=sys.stderr
        )
        return 1
    status = _status(incident)
    nodes = ", ".join(_quarantined(status))
    confirmed = _condition(status, "Confirmed")
    if decision != "release" and confirmed.get("status") == "False":
        print(
            f"note: the confirmation did not reproduce the fault ({confirmed.get('message', '')})",
            file=sys.stderr,
        )
    what = {
        "replace": f"ask HyperPod to replace node {nodes}",
        "reboot": f"ask HyperPod to reboot node {nodes}",
        "release": f"release node {nodes} (cordon, taint, label and annotation removed)",
    }[decision]
    on = f" on SDCPolicy {approvals.policy} (approvals: cluster)" if approvals.cluster else ""
    print(f"incident {namespace}/{name}: recorded {where}={decision}{on}; the operator will {what}")
    if approvals.unknown is not None:
        print(
            f"note: {approvals.unknown}: where the SDCPolicy admitting {namespace} says "
            f"approvals: cluster, the operator ignores {ACTION_ANNOTATION} (Event "
            "SDCDecisionIgnored) and a cluster admin decides",
            file=sys.stderr,
        )
    try:
        verb = "approved" if decision != "release" else "decided"
        cluster.post_event(
            incident,
            "SDCReviewDecision",
            f"{decision} {verb} with kubectl sdc ({where}={decision}{on})",
        )
    except Exception as exc:  # an Event is a courtesy: the decision is recorded already
        print(f"note: no Event posted ({_status_code(exc) or type(exc).__name__})", file=sys.stderr)
    return 0


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {raw!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-n", "--namespace", help="the incident's namespace (default: the context's)"
    )
    common.add_argument(
        "--kubeconfig", help="kubeconfig file (default: KUBECONFIG, ~/.kube/config)"
    )
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser = argparse.ArgumentParser(
        prog="kubectl sdc",
        description="Review hyperpod-sdc incidents (SDCIncident, short name sdci).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    describe = sub.add_parser(
        "describe", parents=[common], help="the incident's timeline and evidence"
    )
    describe.add_argument("incident")
    describe.add_argument("-o", "--output", choices=("text", "json"), default="text")
    approve = sub.add_parser(
        "approve", parents=[common], help="approve remediation of the quarantined node"
    )
    approve.add_argument("incident")
    approve.add_argument("--action", choices=("replace", "reboot"), default="replace")
    approve.add_argument("--overwrite", action="store_true", help="replace a pending decision")
    release = sub.add_parser("release", parents=[common], help="give the quarantined node back")
    release.add_argument("incident")
    release.add_argument("--overwrite", action="store_true", help="replace a pending decision")
    remove = sub.add_parser(
        "uninstall",
        parents=[common],
        help="clean up before helm uninstall: list what stays, resume nothing, keep incidents",
    )
    remove.add_argument(
        "--release-nodes",
        action="store_true",
        help="release the nodes quarantined by us (default: leave them, listed, with commands)",
    )
    remove.add_argument(
        "--dry-run", action="store_true", help="say what it would do; change nothing"
    )
    remove.add_argument(
        "--stop",
        metavar="NAMESPACE/DEPLOYMENT",
        help="scale the operator's Deployment to zero first and wait for its pods to go",
    )
    remove.add_argument(
        "--stop-timeout",
        type=_positive_seconds,
        default=120.0,
        metavar="SECONDS",
        help="how long --stop waits for the operator's pods to go (default 120); "
        "past it, nothing is cleaned up",
    )
    remove.add_argument("-o", "--output", choices=("text", "json"), default="text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster = _Cluster(args.kubeconfig, args.context)
    except Exception as exc:
        print(f"kubectl sdc: cannot load a kubeconfig: {exc}", file=sys.stderr)
        return 1
    if args.command == "uninstall":
        try:
            return _uninstall(
                cluster,
                release_nodes=args.release_nodes,
                dry_run=args.dry_run,
                output=args.output,
                stop=args.stop,
                stop_timeout=args.stop_timeout,
            )
        except Exception as exc:
            print(f"kubectl sdc: uninstall: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            cluster.api.close()
    namespace, name = _split_name(args.incident, args.namespace)
    namespace = namespace or cluster.namespace
    try:
        if args.command == "describe":
            return _describe(cluster, namespace, name, args.output)
        decision = args.action if args.command == "approve" else "release"
        return _decide(cluster, namespace, name, decision, args.overwrite)
    except Exception as exc:
        code = _status_code(exc)
        if code == 404:
            print(f"kubectl sdc: incident {namespace}/{name} not found", file=sys.stderr)
        elif code == 403:
            print(
                f"kubectl sdc: forbidden: {getattr(exc, 'reason', '')} (your role must allow "
                f"get/patch on sdcincidents.{GROUP} in {namespace})",
                file=sys.stderr,
            )
        else:
            print(f"kubectl sdc: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.api.close()


if __name__ == "__main__":
    sys.exit(main())
