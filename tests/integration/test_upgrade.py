"""Agents and operators of different releases against the real API server
(docs/protocol.md, "Versions"): the previous release's agent is heard by this operator, and
this release's agent is heard by the previous release's operator (its intake check,
tests/integration/previous_operator.py), each ending in one contained incident."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_common.protocol import PROTOCOL_HEADER, HeartbeatReport, Report, encode_report
from sdc_harness.cluster import Cluster, OperatorProcess, post, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from tests import previous_protocol as previous

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


def test_a_rolling_upgrade_continues_the_incident_in_flight_once_and_loses_no_report(
    cluster: Cluster,
    namespace: str,
    tmp_path: Path,
    start_operator: Callable[..., OperatorProcess],
) -> None:
    """``helm upgrade`` changing the image, as the Deployment rolls it (maxSurge 1,
    maxUnavailable 0): the previous release's replica leads with a SageMaker replace in
    flight when a replica of this release is ready beside it; the old one is terminated
    (SIGTERM), gives the Lease up, and the new one finishes the incident: one suspension,
    one quarantine, one SageMaker call. Meanwhile this release's agents report through the
    Service under a steady load of heartbeats, each on its kept connection (the first to the
    old replica, the second to the new one): every report is answered 2xx, those sent into
    the switch by the agent's retries on a new connection, in the version each replica
    speaks."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    cluster.admit(namespace, remediationPolicy="auto-replace")
    called, answer = threading.Event(), threading.Event()

    def hold(operation: str, params: dict[str, Any]) -> None:
        if operation == REPLACE:
            called.set()
            answer.wait(60)

    fake = FakeSageMaker(on_call=hold)
    service = Service()
    reporters: list[Reporter] = []
    feeding = threading.Event()
    submitted = [0, 0]
    feeder: threading.Thread | None = None
    try:
        settings: dict[str, Any] = {
            "extra_env": fake.env(),
            "remediation_policy": "auto-replace",
            "heartbeat_retry_after_seconds": "0.5",
        }
        old = start_operator(module="tests.integration.previous_operator", **settings)
        wait_for("the previous release's replica to lead", lambda: leads(old), timeout=30)
        new = start_operator(**settings)  # the surge replica of the new image, ready
        assert not leads(new)
        service.add(old.port)
        service.add(new.port)
        for reporter in (0, 2):
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
        # the first connects (to the old replica) before the second (to the new one)
        for i, reporter in enumerate((0, 2)):
            reporters[i].submit(verdict(job, reporter))
            assert reporters[i].flush(timeout=30)
        on_old, on_new = reporters
        assert (on_old.protocol_version, on_new.protocol_version) == (1, 2)
        assert (on_old.connections_opened, on_new.connections_opened) == (1, 1)

        def feed() -> None:  # each node's heartbeat every 0.2 s until told to stop
            step = 20
            while not feeding.wait(0.2):
                step += 1
                for i, reporter in enumerate((0, 2)):
                    reporters[i].submit(dataclasses.replace(beat(job, reporter), step=step))
                    submitted[i] += 1

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        assert called.wait(60), "the leader never asked SageMaker to replace the node"
        (incident,) = cluster.incidents(namespace)
        actions = [a["action"] for a in incident["status"]["actions"]]
        assert actions[:2] == ["suspend-job", "quarantine-node"], actions
        assert leads(old) and not leads(new)
        wait_for("heartbeats at the old replica", lambda: versions(old).get("1", 0) >= 3, 30)
        assert versions(old).get("2") is None

        old.proc.terminate()  # the Deployment's old pod, with the replace in flight
        wait_for("the new replica to lead", lambda: leads(new), timeout=30)
        answer.set()  # SageMaker answers the old replica within its grace period
        old.proc.wait(timeout=30)  # terminationGracePeriodSeconds: it exits on its own
        # the Endpoints still list it until the agent it served has connected again (and
        # may have been sent there first, and refused)
        wait_for("the old replica's agent to connect again", lambda: on_old.connections_opened > 1)
        service.remove(old.port)
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
        new.resynced(2)
        feeding.set()
        feeder.join()
        for r in reporters:
            assert r.flush(timeout=60), f"{r.pending()} report(s) not delivered"
        counters = [r.counters() for r in reporters]
        # the old replica's agent wrote one report in version 1 to the new one, whose answer
        # said 1, 2: version 2 from then on
        assert versions(new).get("1") == 1
    finally:
        feeding.set()
        answer.set()
        for r in reporters:
            r.close(timeout=1)
        service.stop()
        fake.stop()
    assert fake.invalid == []
    assert fake.count(REPLACE) == 1
    results = [(a["action"], a["result"]) for a in remediated["status"]["actions"]]
    for action in ("suspend-job", "quarantine-node", "replace-node"):
        assert results.count((action, "Succeeded")) == 1, results
    (replaced,) = [a for a in remediated["status"]["actions"] if a["action"] == "replace-node"]
    assert "not calling again" in replaced["message"]  # the new replica found the old one's call
    assert [i["metadata"]["name"] for i in cluster.incidents(namespace)] == [
        remediated["metadata"]["name"]
    ]
    for i, c in enumerate(counters):
        # every report answered 2xx: the verdict and every heartbeat; none dropped or refused
        assert (c["delivered"], c["dropped"], c["refused"]) == (1 + submitted[i], 0, 0), c
        assert (c["protocol_version"], c["unreported"]) == (2, {}), c  # the new one's
    assert on_new.connections_opened == 1  # the new replica's agent never noticed
    print(f"Service refused {service.refused} connection(s) to the terminated replica")
