"""The attack run, against the operator as a real process: a hostile tenant, a slow or
broken client. Each case is refused with a JSON 4xx, logged at INFO at most, and changes
nothing in the cluster."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity, encode_report
from sdc_harness.cluster import TRAINING_OPERATOR, Cluster, OperatorProcess, post, wait_for
from sdc_operator.attestation import ATTESTATION_ANNOTATION, CREATED_BY_ANNOTATION
from sdc_operator.webhook import ADMISSION_PATH

from .test_containment import Job, make_job, send, verdict
from .test_intake import snapshot


def raw(url: str, data: bytes, *, wait: float = 10.0) -> tuple[int, dict[str, Any]]:
    """Send ``data`` as it is on a new connection; the status and JSON body answered."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def heartbeat(job: Job, i: int = 0) -> bytes:
    return encode_report(
        HeartbeatReport(ReporterIdentity(i * 2, job.node_name(i), job.pods[i]), time.time(), 20, 10)
    )


def assert_quiet(op: OperatorProcess) -> None:
    log = op.log()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


def test_a_namespace_no_policy_admits_is_refused_and_changes_nothing(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    other = cluster.namespace(admitted=False)
    job = make_job(cluster, other)
    op = start_operator(namespaces=f"{namespace},{other}")
    before = snapshot(cluster, job)
    for reporter in (0, 2):
        status, answer, _ = send(cluster, op, job, reporter, verdict(job, reporter))
        assert (status, answer["error"]) == (403, "namespace_not_admitted"), answer
        assert f"namespace {other} is not admitted by any SDCPolicy" in answer["message"]
    assert snapshot(cluster, job) == before
    # An admin admits it by label: reports are heard at once (the policy is watched) ...
    label = f"team-{other}"
    cluster.policy(f"by-label-{other}", {"namespaceSelector": {"matchLabels": {"sdc": label}}})
    cluster.core.patch_namespace(other, {"metadata": {"labels": {"sdc": label}}})
    token = cluster.token(other, job.pods[0])
    wait_for("admission by label", lambda: post(op.url, heartbeat(job), token)[0] == 202)
    # ... and no longer once the label is gone.
    cluster.core.patch_namespace(other, {"metadata": {"labels": {"sdc": None}}})
    wait_for("refusal again", lambda: post(op.url, heartbeat(job), token)[0] == 403)
    assert snapshot(cluster, job)[1:] == before[1:]
    assert_quiet(op)


def test_pods_made_by_hand_for_a_job_accuse_nobody(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """A tenant who may create pods points them at an opted-in job (a controller owner
    reference) on nodes the job never used: their tokens are refused, and a genuine
    reporter naming one of them as a suspect is refused too."""
    job = make_job(cluster, namespace)
    body = cluster.job(namespace, "big", replicas=6)  # three of six pods made so far
    nodes = [cluster.node() for _ in range(5)]
    names = ["big-master-0", "big-worker-0", "big-worker-1"]
    for pod, node in zip(names, nodes, strict=False):
        cluster.pod(namespace, pod, node["metadata"]["name"], body)
    genuine = Job(namespace, "big", body, nodes[:3], names)
    copied = cluster.core.read_namespaced_pod("big-worker-1", namespace).metadata.annotations
    forged = {
        "no attestation": (nodes[3], {}),
        "a copied attestation": (nodes[4], copied),
        "a made-up attestation": (
            nodes[3],
            {CREATED_BY_ANNOTATION: TRAINING_OPERATOR, ATTESTATION_ANNOTATION: "v1:AAAA"},
        ),
    }
    op = start_operator()
    before = [snapshot(cluster, j) for j in (job, genuine)]
    for i, (what, (node, written)) in enumerate(forged.items()):
        name = f"big-worker-{2 + i}"  # a name the job's next pods would have
        cluster.pod(
            namespace, name, node["metadata"]["name"], body, attested=False, annotations=written
        )
        fake = Job(namespace, "big", body, [*nodes[:3], node], [*names, name])
        report = verdict(fake, 3, suspect_node=1)
        status, answer, _ = send(cluster, op, fake, 3, report)
        assert (status, answer["error"]) == (403, "not_attested"), (what, answer)
        # the genuine pods name the hand-made one as the suspect
        for reporter in (0, 2):
            status, answer, _ = send(cluster, op, fake, reporter, verdict(fake, reporter, 3))
            assert (status, answer["error"]) == (422, "unknown_suspect"), (what, answer)
            assert f"suspects[0]: pod {namespace}/{name}" in answer["message"]
    # A genuine pod deleted and made again by hand under its name, with its attestation
    # copied, but without the labels that send pods to the webhook (so the webhook never
    # stripped the copy): the HMAC fits, the pod still accuses nobody.
    cluster.core.delete_namespaced_pod("big-worker-1", namespace, grace_period_seconds=0)
    wait_for(
        "the pod to go",
        lambda: (
            "big-worker-1"
            not in [p.metadata.name for p in cluster.core.list_namespaced_pod(namespace).items]
        ),
    )
    cluster.pod(
        namespace,
        "big-worker-1",
        nodes[4]["metadata"]["name"],
        body,
        attested=False,
        annotations=copied,
    )
    status, answer, _ = send(cluster, op, genuine, 2, verdict(genuine, 2, suspect_node=1))
    assert (status, answer["error"]) == (403, "not_attested"), answer
    assert "labels the admission webhook selects" in answer["message"]
    assert [snapshot(cluster, j) for j in (job,)] == before[:1]
    assert cluster.incidents(namespace) == []
    op.stop()

    # Without the webhook (attestation off) the names still have to fit the job.
    op = start_operator(require_attestation="false")
    for i, name in enumerate(["evil-0", "big-worker-9", "big-launcher-0"]):  # worker x5
        cluster.pod(namespace, name, nodes[3 + i % 2]["metadata"]["name"], body, attested=False)
        fake = Job(namespace, "big", body, [*nodes[:3], nodes[3 + i % 2]], [*names, name])
        status, answer, _ = send(cluster, op, fake, 3, verdict(fake, 3, suspect_node=1))
        assert (status, answer["error"]) == (403, "not_a_job_pod"), (name, answer)
    assert [snapshot(cluster, j) for j in (job, genuine)] == before
    assert_quiet(op)


def test_a_pod_that_never_ran_on_its_node_accuses_nobody(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """A tenant pins a genuine replica of their own job (``spec.nodeName``) to a node that
    cannot run it (no free GPU: the kubelet refuses it, the pod never starts). Naming it as
    the suspect must not put that node in quarantine; once it runs there, it may."""
    body = cluster.job(namespace, "pinned", replicas=4)
    nodes = [cluster.node() for _ in range(4)]
    names = ["pinned-master-0", "pinned-worker-0", "pinned-worker-1", "pinned-worker-2"]
    for i, (pod, node) in enumerate(zip(names, nodes, strict=True)):
        cluster.pod(namespace, pod, node["metadata"]["name"], body, running=i < 3)
    job = Job(namespace, "pinned", body, nodes, names)
    op = start_operator()
    before = snapshot(cluster, job)
    for reporter in (0, 2):
        status, answer, _ = send(cluster, op, job, reporter, verdict(job, reporter, 3))
        assert (status, answer["error"]) == (422, "unknown_suspect"), answer
        assert "never ran on node" in answer["message"]
    assert snapshot(cluster, job) == before
    assert cluster.incidents(namespace) == []
    cluster.core.patch_namespaced_pod_status(names[3], namespace, {"status": {"phase": "Running"}})
    wait_for(
        "the suspect's phase in the operator's cache",
        lambda: send(cluster, op, job, 0, verdict(job, 0, 3))[0] == 202,
    )
    assert_quiet(op)


# timing: 1 s header and body timeouts; the 50 slow clients must be closed within 6 s (5 s
# margin), each trickling body answered 408 within 6 s (5 s margin); a kept connection idle
# 1.5 s (0.5 s past the header timeout, 1.5 s short of the idle timeout) is answered, and
# closed once idle past the 3 s idle timeout, by 11.5 s idle: 8.5 s margin
@pytest.mark.timing
def test_slow_clients_are_cut_off(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(
        header_timeout_seconds="1", body_timeout_seconds="1", idle_timeout_seconds="3"
    )
    host, port = op.url.rsplit("/", 1)[-1].split(":")
    head = (
        f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {cluster.token(namespace, job.pods[0])}\r\n"
    ).encode()
    # An agent's kept connection: idle longer than the header timeout between reports and
    # still answered on the same connection; idle past the idle timeout, closed. It runs
    # beside the slow clients below (its 4.5 s of idling need not add to their time).
    token = cluster.token(namespace, job.pods[1])
    kept_result: list[str] = []

    def keep() -> None:
        kept = http.client.HTTPConnection(host, int(port), timeout=10)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        statuses = []
        first = None
        for _ in range(2):
            kept.request("POST", "/v1/reports", body=heartbeat(job, 1), headers=headers)
            answered = kept.getresponse()
            answered.read()
            statuses.append(answered.status)
            if kept.sock is None:
                kept_result.append("the operator closed the connection after its answer")
                return
            first = first or kept.sock
            time.sleep(1.5)
        if statuses != [202, 202] or kept.sock is not first:
            kept_result.append(f"answers {statuses}, the same connection: {kept.sock is first}")
            return
        kept_result.append("answered twice")
        # closed once idle 3 s: the operator's close ends the wait (it fails after 11.5 s idle)
        first.settimeout(10)
        try:
            closed = first.recv(1) == b""
        except OSError as exc:
            closed = False
            kept_result.append(f"{type(exc).__name__}: {exc}")
        kept_result.append("closed when idle" if closed else "kept past the idle timeout")
        kept.close()

    kept_thread = threading.Thread(target=keep)
    kept_thread.start()

    # 50 clients that send their headers one byte at a time
    slow = [socket.create_connection((host, int(port))) for _ in range(50)]
    opened = time.monotonic()
    closed: dict[int, float] = {}
    sent = 0
    while len(closed) < len(slow) and time.monotonic() - opened < 15:
        for i, sock in enumerate(slow):
            if i in closed:
                continue
            readable, _, _ = select.select([sock], [], [], 0)
            try:
                if readable and not sock.recv(4096):
                    raise ConnectionResetError
                sock.send(head[sent % len(head) : sent % len(head) + 1])
            except OSError:
                closed[i] = time.monotonic() - opened
        sent += 1
        time.sleep(0.05)
    for sock in slow:
        sock.close()
    assert len(closed) == 50, f"{50 - len(closed)} slow clients still open after 15 s"
    assert max(closed.values()) < 6, sorted(closed.values())[-5:]

    # a body that trickles in is answered 408, as JSON
    body = heartbeat(job)
    answer: dict[str, Any] = {}

    def trickle(
        head: bytes = head, port: int = int(port), begun: threading.Event | None = None
    ) -> None:
        answer.clear()
        with socket.create_connection((host, port), timeout=15) as sock:
            sock.sendall(head + f"Content-Length: {len(body)}\r\n\r\n".encode())
            if begun is not None:
                begun.set()
            for i in range(0, len(body) - 1, 5):
                if select.select([sock], [], [], 0.3)[0]:
                    break  # answered
                try:
                    sock.sendall(body[i : i + 5])
                except OSError:
                    break
            data = sock.recv(65536)
            status_line, _, rest = data.partition(b"\r\n")
            answer.update(
                status=int(status_line.split()[1]), body=json.loads(rest.split(b"\r\n\r\n")[1])
            )

    started = time.monotonic()
    begun = threading.Event()
    thread = threading.Thread(target=trickle, kwargs={"begun": begun})
    thread.start()
    assert begun.wait(15), "the trickling client could not send its headers"
    # meanwhile the operator answers everyone else at once
    assert post(op.url, heartbeat(job, 2), cluster.token(namespace, job.pods[2]))[0] == 202
    thread.join()
    assert (answer["status"], answer["body"]["error"]) == (408, "timeout")
    assert time.monotonic() - started < 6

    # the admission webhook's path (on its own port) takes no token: a trickling review is
    # cut off as fast
    started = time.monotonic()
    trickle(
        f"POST {ADMISSION_PATH} HTTP/1.1\r\nHost: {host}\r\n"
        "Content-Type: application/json\r\n".encode(),
        op.admission_port,
    )
    assert (answer["status"], answer["body"]["error"]) == (408, "timeout")
    assert time.monotonic() - started < 6

    kept_thread.join(30)
    assert kept_result == ["answered twice", "closed when idle"], kept_result
    assert_quiet(op)


def test_a_verdict_refused_for_its_token_sheds_no_heartbeat(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Heartbeats are shed for a few seconds after a verdict was answered (verdicts first),
    but not after a body that only says it is a verdict: anyone who reaches the port could
    otherwise keep every job's heartbeats shed with one bogus request every few seconds."""
    from .flood import bogus_token

    job = make_job(cluster, namespace)
    op = start_operator()
    status, answer, _ = post(op.url, encode_report(verdict(job, 0)), bogus_token())
    assert status == 401, answer
    token = cluster.token(namespace, job.pods[1])
    status, answer, _ = post(op.url, heartbeat(job, 1), token)
    assert status == 202, answer  # within the 5 s a real verdict sheds heartbeats for
    assert_quiet(op)


def test_every_refusal_is_json_and_logged_at_most_at_info(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    host = op.url.rsplit("/", 1)[-1]

    def request(method: str, path: str, headers: str = "", body: bytes = b"") -> bytes:
        return (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    cases = [
        # (what, bytes sent, status, error)
        (
            "a token over the header limit",
            request("POST", "/v1/reports", f"Authorization: Bearer {'x' * 40_000}\r\n"),
            431,
            "headers_too_large",
        ),
        (
            "a token over the token limit",
            request(
                "POST",
                "/v1/reports",
                f"Authorization: Bearer {'x' * 20_000}\r\nContent-Type: application/json\r\n",
                b"{}",
            ),
            401,
            "unauthenticated",
        ),
        ("an unknown path", request("GET", "/admin"), 404, "not_found"),
        ("the wrong method", request("GET", "/v1/reports"), 405, "method_not_allowed"),
        (
            "not HTTP at all",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
            400,
            "bad_http",
        ),
    ]
    for what, data, status, error in cases:
        got, answer = raw(op.url, data)
        assert (got, answer.get("error")) == (status, error), (what, got, answer)
        assert answer.get("message"), what
    # a deleted pod's fresh token: the API server rejects a token whose pod is gone (401)
    cluster.pod(namespace, "train-worker-7", job.node_name(0), job.body)
    token = cluster.token(namespace, "train-worker-7")
    cluster.core.delete_namespaced_pod("train-worker-7", namespace, grace_period_seconds=0)
    wait_for(
        "the pod gone",
        lambda: (
            "train-worker-7"
            not in {p.metadata.name for p in cluster.core.list_namespaced_pod(namespace).items}
        ),
    )
    status, answer, _ = post(op.url, heartbeat(job), token)
    assert (status, answer["error"]) == (401, "unauthenticated"), answer
    assert_quiet(op)
