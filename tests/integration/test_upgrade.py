"""Agents and operators of different releases against the real API server
(docs/protocol.md, "Versions"): the previous release's agent is heard by this operator, and
this release's agent is heard by the previous release's operator (its intake check,
tests/integration/previous_operator.py), each ending in one contained incident; and the
chart's two replicas rolled from the previous release's own operator
(tests/integration/previous_release.py) to this one's with an incident in flight
(docs/operator.md, "Upgrade and CRD versions")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes import client

from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_common.protocol import PROTOCOL_HEADER, HeartbeatReport, Report, encode_report
from sdc_harness.cluster import OPERATOR_NAMESPACE, Cluster, OperatorProcess, post, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from tests import previous_protocol as previous

from .previous_release import THIS, Release
from .test_containment import incident_in, make_job, verdict


def as_previous(report: Report) -> Any:
    """The same report, built by the previous release's agent: the fields it has (those added
    since must be unset: that agent could not send them)."""
    cls = getattr(previous, type(report).__name__)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for f in dataclasses.fields(report):
        if f.name in ("kind", "version", "unreported"):
            continue
        if f.name in known:
            values[f.name] = getattr(report, f.name)
        else:
            assert getattr(report, f.name) == f.default, (
                f"{f.name} is new since the previous release"
            )
    values["reporter"] = previous.ReporterIdentity(**dataclasses.asdict(report.reporter))
    if "suspects" in values:
        values["suspects"] = tuple(
            previous.Suspect(**dataclasses.asdict(s)) for s in values["suspects"]
        )
    return cls(**values)


def beat(job: Any, reporter: int) -> HeartbeatReport:
    v = verdict(job, reporter)
    return HeartbeatReport(reporter=v.reporter, sent_at=time.time(), step=20, last_clean_step=10)


def test_a_previous_agent_is_heard_by_this_operator(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    tokens = {r: cluster.token(namespace, job.pods[r]) for r in (0, 2)}

    def accepted(report: Report, reporter: int) -> bool:
        body = previous.encode_report(as_previous(report))
        assert json.loads(body)["version"] == 1
        status, answer, headers = post(op.url, body, tokens[reporter])
        assert headers[PROTOCOL_HEADER] == "1, 2" and "ignored" not in answer
        if status == 429 and answer["error"] == "shed":  # heartbeats wait behind verdicts
            return False
        assert status == 202, answer
        return True

    for reporter in (0, 2):
        assert accepted(verdict(job, reporter), reporter)
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["status"]["node"] == job.node_name(1)
    for reporter in (0, 2):

        def beat_accepted(r: int = reporter) -> bool:
            return accepted(beat(job, r), r)

        wait_for("a heartbeat accepted", beat_accepted, timeout=20)
    assert 'hyperpod_sdc_report_versions_total{version="1"} 4.0' in op.metrics()


def test_this_agent_is_heard_by_the_previous_operator(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(module="tests.integration.previous_operator")
    # it is the previous release: it refuses version 2 with its own words, and no header
    token = cluster.token(namespace, job.pods[0])
    status, answer, headers = post(op.url, encode_report(beat(job, 0)), token)
    assert (status, answer["message"]) == (
        422,
        "version: unsupported protocol version 2; this side speaks 1",
    )
    assert PROTOCOL_HEADER not in headers
    reporters = []
    for reporter in (0, 2):
        token_file = tmp_path / f"token-{reporter}"
        token_file.write_text(cluster.token(namespace, job.pods[reporter]))
        r = Reporter(ReporterConfig(operator_url=op.url, token_file=str(token_file)))
        r.submit(beat(job, reporter))
        r.submit(verdict(job, reporter))
        reporters.append(r)
    for r in reporters:
        assert r.flush(timeout=20)
        counters = r.counters()
        r.close()
        assert (counters["delivered"], counters["refused"]) == (2, 0)
        assert (counters["protocol_version"], counters["unreported"]) == (1, {})
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["status"]["node"] == job.node_name(1)


RECORDED = Path(__file__).parent / "recorded" / "incident-waiting-0.1.0.json"
"""An incident as the release before this one wrote it (one node's report, waiting for a
second), with the names of that run replaced by placeholders."""


def test_an_incident_written_by_the_previous_release_is_read_by_this_operator(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    from sdc_operator.incidents import JobRef, incident_name

    job = make_job(cluster, namespace)
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", namespace, meta["name"], meta["uid"])
    name = incident_name(ref, verdict(job, 0))
    text = RECORDED.read_text().replace("@JOB_UID@", meta["uid"]).replace("@NAMESPACE@", namespace)
    for i in range(3):
        node = job.node_name(i)
        text = text.replace(f"@NODE{i}@", node).replace(f"@INSTANCE{i}@", node[len("hyperpod-") :])
    recorded = json.loads(text)
    recorded["metadata"]["name"] = name
    status = recorded.pop("status")
    args = ("hyperpod-sdc.dev", "v1alpha1", namespace, "sdcincidents")
    cluster.custom.create_namespaced_custom_object(*args, recorded)
    cluster.custom.patch_namespaced_custom_object_status(*args, name, {"status": status})
    op = start_operator()
    # the second node's report agrees with the one the recorded status holds
    code, answer, _ = post(
        op.url, encode_report(verdict(job, 2)), cluster.token(namespace, job.pods[2])
    )
    assert code == 202 and answer["incident"] == f"{namespace}/{name}", answer
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["metadata"]["name"] == name
    assert sorted(r["node"] for r in incident["status"]["reports"]) == sorted(
        job.node_name(i) for i in (0, 2)
    )


class Service:
    """The chart's Service in front of the replicas, as kube-proxy routes it: each new
    connection goes to the next endpoint in turn. An endpoint whose pod is gone but not yet
    removed from the Endpoints refuses, and the client's connection is closed unanswered
    (what an agent sees in the moment a terminated replica is still listed)."""

    def __init__(self) -> None:
        self.endpoints: list[int] = []
        self.refused = 0
        self._turn = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def add(self, port: int) -> None:
        with self._lock:
            self.endpoints.append(port)

    def remove(self, port: int) -> None:
        with self._lock:
            self.endpoints.remove(port)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # stopped
                return
            with self._lock:
                port = self.endpoints[self._turn % len(self.endpoints)]
                self._turn += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                with self._lock:
                    self.refused += 1
                client.close()
                continue
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _relay(client: socket.socket, upstream: socket.socket) -> None:
        def pipe(source: socket.socket, sink: socket.socket) -> None:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
                sink.shutdown(socket.SHUT_WR)
            except OSError:  # a side reset: the other one is told by the close below
                pass

        back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        back.start()
        pipe(client, upstream)
        back.join(60)
        client.close()
        upstream.close()

    def stop(self) -> None:
        self._server.close()


CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}
REPLACE = "BatchReplaceClusterNodes"


def leads(op: OperatorProcess) -> bool:
    return "hyperpod_sdc_leader 1.0" in op.metrics()


def versions(op: OperatorProcess) -> dict[str, float]:
    """``hyperpod_sdc_report_versions_total`` by version: the reports the replica accepted."""
    found = {}
    for line in op.metrics().splitlines():
        if line.startswith('hyperpod_sdc_report_versions_total{version="'):
            name, value = line.rsplit(" ", 1)
            found[name.split('"')[1]] = float(value)
    return found


def delivered(reporter: Reporter) -> int:
    return int(cast(int, reporter.counters()["delivered"]))


def settled(cluster: Cluster, namespace: str, op: OperatorProcess, passes: int = 2) -> None:
    """Wait until ``op``, the leader, has been through ``passes`` more passes of its periodic
    work, so that what it has not done by then it was not going to do: whole resync passes
    (:meth:`OperatorProcess.resynced`). The previous release counts none; there the signal
    is its member Lease written ``passes + 1`` more times, by the loop that runs every
    ``resync_seconds`` (1 s here) beside the resync's."""
    if "hyperpod_sdc_resyncs_total" in op.metrics():
        op.resynced(passes)
        return
    identity = f"{socket.gethostname()}-{op.proc.pid}"  # the settings' default identity
    name = f"leader-{namespace}-member-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"
    coordination = client.CoordinationV1Api(cluster.api)

    def written() -> str:
        return str(coordination.read_namespaced_lease(name, OPERATOR_NAMESPACE).spec.renew_time)

    seen = [written()]

    def renewed() -> bool:
        if (now := written()) != seen[-1]:
            seen.append(now)
        return len(seen) > passes + 1

    wait_for(f"{passes} passes of the previous release's periodic loop", renewed, timeout=30)


def leader_among(replicas: list[OperatorProcess]) -> OperatorProcess | None:
    """The running replica that leads, if one does."""
    return next((op for op in replicas if op.proc.poll() is None and leads(op)), None)


@dataclasses.dataclass
class Rolled:
    """What a roll of both replicas from one release to the other ended with."""

    remediated: dict[str, Any]
    incidents: list[str]
    counters: list[dict[str, Any]]
    """Each agent's ``Reporter.counters()``: the first two served first by each old replica,
    the third by the first new one."""
    submitted: list[int]
    """Reports each agent was given (its verdict or first heartbeat, then the stream)."""
    connections: list[int]
    first_versions: list[int]
    """The protocol version each agent wrote once its first report was answered."""
    old_versions: list[dict[str, float]]
    """The versions of the reports each old replica accepted (:func:`versions`), read
    before it was stopped; empty from the previous release, which did not count them."""
    new_versions: list[dict[str, float]]
    leaders: list[str]
    """Who led, in turn (``previous-0`` ... ``this-1``): the Lease's path through the roll."""
    replaces: int
    invalid: list[str]
    refused: int


def roll_both_replicas(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
    *,
    old_release: Release,
    new_release: Release,
    first: str,
) -> Rolled:
    """The chart's two replicas of ``old_release`` rolled to two of ``new_release`` as the
    Deployment's RollingUpdate does it (replicas 2, maxSurge 1, maxUnavailable 0:
    charts/hyperpod-sdc/templates/deployment.yaml): a new replica is ready, an old one is
    terminated (``first``: the ``leader`` or the ``standby``) while the second new one
    starts, then the second old one is terminated once that is ready. The old leader has a
    SageMaker replace held in flight from before the roll until a replica that stays has
    taken the Lease over. Three agents of this release report through the Service all along,
    heartbeats every 0.2 s each: the first two connected to the two old replicas, the third
    to the first new one."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    cluster.admit(namespace, remediationPolicy="auto-replace")
    called, answer = threading.Event(), threading.Event()

    def hold(operation: str, params: dict[str, Any]) -> None:
        if operation == REPLACE:
            called.set()
            answer.wait(300)

    fake = FakeSageMaker(on_call=hold)
    service = Service()
    reporters: list[Reporter] = []
    feeding = threading.Event()
    submitted = [1, 1, 1]
    feeder: threading.Thread | None = None
    names: dict[int, str] = {}
    leaders: list[str] = []
    old_versions: list[dict[str, float]] = []
    try:
        settings: dict[str, Any] = {
            "remediation_policy": "auto-replace",
            "heartbeat_retry_after_seconds": "0.5",
        }

        def start(release: Release, replicas: list[OperatorProcess]) -> OperatorProcess:
            env = {**fake.env(), **release.env}
            op = start_operator(extra_env=env, **settings)
            names[id(op)] = f"{release.name}-{len(replicas)}"
            replicas.append(op)
            service.add(op.port)
            return op

        old: list[OperatorProcess] = []
        new: list[OperatorProcess] = []
        start(old_release, old)
        wait_for("the first replica to lead", lambda: leads(old[0]), timeout=30)
        leaders.append(names[id(old[0])])
        start(old_release, old)
        for reporter in (0, 2, 1):
            token_file = tmp_path / f"token-{reporter}"
            token_file.write_text(cluster.token(namespace, job.pods[reporter]))
            config = ReporterConfig(
                operator_url=service.url,
                token_file=str(token_file),
                heartbeat_jitter_seconds=0,
                initial_backoff_seconds=0.2,
                max_backoff_seconds=2,
            )
            reporters.append(Reporter(config))
        # each new connection goes to the next endpoint: the first agent's to the leader,
        # the second's to the standby
        for i, reporter in enumerate((0, 2)):
            reporters[i].submit(verdict(job, reporter))
            assert reporters[i].flush(timeout=30)
        assert called.wait(60), "the leader never asked SageMaker to replace the node"
        (incident,) = cluster.incidents(namespace)
        actions = [a["action"] for a in incident["status"]["actions"]]
        assert actions[:2] == ["suspend-job", "quarantine-node"], actions
        assert leader_among(old) is old[0] and not leads(old[1])

        # helm upgrade (or rollback): the surge replica, ready; the third agent's connection
        start(new_release, new)
        reporters[2].submit(beat(job, 1))
        assert reporters[2].flush(timeout=30)
        assert new[0].sample("hyperpod_sdc_reports_total") == 1  # it went to the new replica
        first_versions = [r.protocol_version for r in reporters]

        def feed() -> None:
            step = 20
            while not feeding.wait(0.2):
                step += 1
                for i, reporter in enumerate((0, 2, 1)):
                    reporters[i].submit(dataclasses.replace(beat(job, reporter), step=step))
                    submitted[i] += 1

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        for op in old:  # the stream reaches both old replicas before the roll goes on

            def heard(op: OperatorProcess = op) -> bool:
                return op.sample("hyperpod_sdc_reports_total") >= 4

            wait_for("heartbeats at an old replica", heard)

        order = [old[0], old[1]] if first == "leader" else [old[1], old[0]]
        for step, leaving in enumerate(order):
            old_versions.append(versions(leaving))
            was_leader = leads(leaving)
            leaving.proc.terminate()  # the ReplicaSet's scale-down: SIGTERM
            if step == 0:  # the Deployment creates the second new pod at once
                start(new_release, new)
            if was_leader:
                staying = [op for op in (*old, *new) if op is not leaving]

                def taken(staying: list[OperatorProcess] = staying) -> OperatorProcess | None:
                    return leader_among(staying)

                taker = wait_for("another replica to lead", taken, timeout=30)
                leaders.append(names[id(taker)])
                answer.set()  # SageMaker answers the old leader within its grace period
            leaving.proc.wait(timeout=30)  # it exits on its own
            # the Endpoints list it until every agent has been answered again since it exited
            # (the one it served, sent there first, is refused and retries)
            since = [delivered(r) for r in reporters]

            def answered_since(since: list[int] = since) -> bool:
                return all(delivered(r) > n for r, n in zip(reporters, since, strict=True))

            wait_for("every agent answered since the replica exited", answered_since, timeout=30)
            service.remove(leaving.port)
        remediated = wait_for(
            "Remediated",
            lambda: next(
                (
                    i
                    for i in cluster.incidents(namespace)
                    if i["status"].get("phase") == "Remediated"
                ),
                None,
            ),
            timeout=60,
        )
        final = wait_for("a new replica to lead", lambda: leader_among(new), timeout=30)
        if leaders[-1] != names[id(final)]:
            leaders.append(names[id(final)])
        settled(cluster, namespace, final)
        feeding.set()
        feeder.join()
        for r in reporters:
            assert r.flush(timeout=60), f"{r.pending()} report(s) not delivered"
        counters = [r.counters() for r in reporters]
        new_versions = [versions(op) for op in new]
    finally:
        feeding.set()
        answer.set()
        for r in reporters:
            r.close(timeout=1)
        service.stop()
        fake.stop()
    print(f"the Lease went {' -> '.join(leaders)}; Service refused {service.refused} connection(s)")
    return Rolled(
        remediated=remediated,
        incidents=[i["metadata"]["name"] for i in cluster.incidents(namespace)],
        counters=counters,
        submitted=list(submitted),
        connections=[r.connections_opened for r in reporters],
        first_versions=first_versions,
        old_versions=old_versions,
        new_versions=new_versions,
        leaders=leaders,
        replaces=fake.count(REPLACE),
        invalid=list(fake.invalid),
        refused=service.refused,
    )


def continued_once(rolled: Rolled) -> None:
    """One incident, one suspension, one quarantine, one SageMaker call (made by the first
    leader, found made by the one that finished), every report answered 2xx."""
    assert rolled.invalid == []
    assert rolled.replaces == 1
    actions = rolled.remediated["status"]["actions"]
    results = [(a["action"], a["result"]) for a in actions]
    for action in ("suspend-job", "quarantine-node", "replace-node"):
        assert results.count((action, "Succeeded")) == 1, results
    (replaced,) = [a for a in actions if a["action"] == "replace-node"]
    assert "not calling again" in replaced["message"]  # a later leader found the call made
    assert rolled.incidents == [rolled.remediated["metadata"]["name"]]
    for c, submitted in zip(rolled.counters, rolled.submitted, strict=True):
        # every report answered 2xx: the verdict and every heartbeat; none dropped or refused
        assert (c["delivered"], c["dropped"], c["refused"]) == (submitted, 0, 0), c
    assert rolled.connections[2] == 1  # the agent on a replica that stays never noticed


@pytest.mark.slow  # 4 operator processes: 16 to 55 s each on the loaded 2 cores
@pytest.mark.parametrize("first", ["leader", "standby"])
def test_a_rolling_upgrade_of_both_replicas_continues_the_incident_once_and_loses_no_report(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
    first: str,
    previous_release: Release,
) -> None:
    """``helm upgrade`` changing the image: the previous release's two replicas rolled to
    two of this release, the leader terminated first or second (the ReplicaSet picks
    either), with the replace in flight. The incident continues exactly once; every report
    is answered 2xx, each agent ends writing version 2."""
    rolled = roll_both_replicas(
        cluster,
        namespace,
        tmp_path,
        start_operator,
        old_release=previous_release,
        new_release=THIS,
        first=first,
    )
    continued_once(rolled)
    assert rolled.leaders[0] == "previous-0" and rolled.leaders[-1].startswith("this-")
    # the old replicas refused version 2 (422 naming version): the agents they served
    # fell back to 1 at once; the third agent, served by this release, wrote 2
    assert rolled.first_versions == [1, 1, 2]
    for c in rolled.counters:
        assert (c["protocol_version"], c["unreported"], c["not_received"]) == (2, {}, []), c
    # each agent that moved from an old replica sent one report in version 1 to a new one,
    # whose answer named 1, 2; version 2 from then on
    assert sum(v.get("1", 0) for v in rolled.new_versions) == 2, rolled.new_versions
