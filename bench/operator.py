"""Operator latency and intake throughput against a real API server on loopback.

    flock /tmp/hyperpod-cpu.lock .venv/bin/python bench/operator.py [--incidents 50] \
        [--reports 2000] [--clients 8] [--operator-src DIR]

Starts the API server (scripts/kube-apiserver.sh), the operator as a real process, and
prints one JSON object:

- ``report_to_contained_seconds``: for each of ``--incidents`` incidents (each its own job
  on its own three nodes, one at a time), from sending the report that completes agreement
  to the API server's watch showing the incident ``Contained`` (job suspended, node
  quarantined, status written). Median, 99th percentile, max.
- ``intake``: heartbeats per second accepted with ``--clients`` concurrent senders from
  ``--clients`` pods, TokenReview on, once with the default review cache (30 s) and once
  with every report reviewed (cache 0).

``--operator-src DIR`` runs the operator from another checkout's ``operator/`` and
``sidecar/`` (the "before" figures: ``git archive main | tar -x -C /tmp/op-main``).

``--production`` runs it as the chart deploys it: TLS with an ECDSA P-256 certificate and
the chart's settings (values.yaml, as ``bench/operator_scale.py --production`` reads them),
each pod reporting from its own loopback address; the verdicts go to the verdict port on a
connection opened for each (as the agent sends them), the heartbeats on one kept
connection per sender. For the throughput only, the per-source, per-job and TokenReview
rate limits are raised (the chart's would answer most of a sender's 250 reports 429 and
refuse reviewing every report: the figure would be the limiter's); the output says so.

Everything shares this machine's cores: the API server, etcd, the operator and the senders.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import watch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # sdc_harness

from tests.integration import storm  # noqa: E402
from tests.integration.test_containment import Job, make_job, send, verdict  # noqa: E402

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity, encode_report  # noqa: E402
from sdc_harness.cluster import Cluster, OperatorProcess  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _post_tls(url: str, body: bytes, token: str, context: ssl.SSLContext, source: str) -> int:
    """One report on a TLS connection opened for it from ``source``, as the agent sends a
    verdict to the verdict port; the answer's status."""
    parts = url.split("://", 1)[1]
    host, port = parts.rsplit(":", 1)
    conn = http.client.HTTPSConnection(
        host, int(port), timeout=30, context=context, source_address=(source, 0)
    )
    try:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        conn.request("POST", "/v1/reports", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def latency(
    cluster: Cluster,
    namespace: str,
    op: OperatorProcess,
    jobs: list[Job],
    context: ssl.SSLContext | None = None,
) -> list[float]:
    """With ``context`` (``--production``): each verdict from its node's own address to the
    verdict port over TLS."""

    def report(index: int, job: Job, reporter: int) -> int:
        if context is None:
            return send(cluster, op, job, reporter, verdict(job, reporter))[0]
        token = cluster.token(job.namespace, job.pods[reporter])
        body = encode_report(verdict(job, reporter))
        return _post_tls(
            op.verdict_url, body, token, context, storm.source_of(3 * index + reporter)
        )

    seconds = []
    for index, job in enumerate(jobs):
        w = watch.Watch()
        stream = w.stream(
            cluster.custom.list_namespaced_custom_object,
            "hyperpod-sdc.dev",
            "v1alpha1",
            namespace,
            "sdcincidents",
            timeout_seconds=60,
        )
        assert report(index, job, 0) == 202
        started = time.monotonic()
        assert report(index, job, 2) == 202
        for event in stream:
            obj: dict[str, Any] = event["object"]
            if (
                obj["spec"]["job"]["name"] == job.name
                and (obj.get("status") or {}).get("phase") == "Contained"
            ):
                seconds.append(time.monotonic() - started)
                break
        w.stop()
    return seconds


def throughput(
    op: OperatorProcess,
    bodies: list[bytes],
    tokens: list[str],
    total: int,
    context: ssl.SSLContext | None = None,
) -> float:
    """Reports per second, ``total`` over ``len(tokens)`` senders each on one kept
    connection (with ``context``: TLS, each sender from its own address)."""
    port = int(op.url.rsplit(":", 1)[1])
    per_client = total // len(tokens)
    errors: list[str] = []

    def client(i: int) -> None:
        conn = (
            http.client.HTTPSConnection(
                "127.0.0.1", port, timeout=30, context=context,
                source_address=(storm.source_of(10_000 + i), 0),
            )
            if context is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        )  # fmt: skip
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {tokens[i]}"}
        for _ in range(per_client):
            conn.request("POST", "/v1/reports", body=bodies[i], headers=headers)
            response = conn.getresponse()
            response.read()
            if response.status != 202:
                errors.append(f"{response.status}")
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(tokens))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{len(errors)} reports refused, first: {errors[0]}")
    return per_client * len(tokens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--incidents", type=int, default=50)
    parser.add_argument("--reports", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--operator-src", type=Path, default=None)
    parser.add_argument(
        "--production",
        action="store_true",
        help="as the chart deploys it: TLS (ECDSA P-256), the chart's settings, an address "
        "per pod, verdicts to the verdict port (the throughput's rate limits raised: said in "
        "the output)",
    )
    args = parser.parse_args()
    extra = {}
    if args.operator_src is not None:
        src = args.operator_src
        extra["PYTHONPATH"] = f"{src / 'operator'}:{src / 'sidecar'}"
    # every sender is on 127.0.0.1: the per-address limit is for attackers, not this bench
    limits = {
        "rate_per_source": "1000000",
        "rate_source_burst": "1000000",
        "connections_per_source": "1000000",
        # every agent here reports from 127.0.0.1; in a cluster each pod has its own address
        "token_reviews_per_source": "1000000",
        "token_review_source_burst": "1000000",
        "token_reviews_per_second": "1000000",  # "review every report" must not be refused
        "token_review_burst": "1000000",
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp) / "apiserver")
        context: ssl.SSLContext | None = None
        chart: dict[str, str] = {}
        if args.production:
            from bench.operator_scale import chart_settings, chart_tls

            ca_cert, cert, key = chart_tls(Path(tmp) / "tls")
            context = ssl.create_default_context(cafile=str(ca_cert))
            chart = {
                **chart_settings(),
                "log_level": "WARNING",
                "scheme": "https",
                "tls_cert_file": str(cert),
                "tls_key_file": str(key),
            }
        try:
            namespace = cluster.namespace()
            jobs = [make_job(cluster, namespace, f"job{i}") for i in range(args.incidents)]
            op = OperatorProcess(
                cluster, namespace, Path(tmp) / "op.log", extra_env=extra, **(chart or limits)
            )
            try:
                seconds = latency(cluster, namespace, op, jobs, context)
            finally:
                op.stop()

            senders = make_job(cluster, namespace, "senders", n=args.clients)
            tokens = [cluster.token(namespace, pod) for pod in senders.pods]
            bodies = [
                encode_report(
                    HeartbeatReport(
                        ReporterIdentity(i, senders.node_name(i), senders.pods[i]),
                        time.time(),
                        100,
                        50,
                    )
                )
                for i in range(args.clients)
            ]
            rates = {}
            for label, cache in (("review_cached", "300"), ("review_every_report", "0")):
                op = OperatorProcess(
                    cluster,
                    namespace,
                    Path(tmp) / f"op-{label}.log",
                    extra_env=extra,
                    **{
                        **chart,
                        **limits,
                        "token_cache_seconds": cache,
                        "rate_per_job": "1000000",
                        "rate_burst": "1000000",
                        "log_level": "WARNING",
                    },
                )
                try:
                    throughput(op, bodies, tokens, args.clients * 10, context)  # warm-up
                    rates[label] = round(throughput(op, bodies, tokens, args.reports, context), 1)
                finally:
                    op.stop()
        finally:
            cluster.stop()
    print(
        json.dumps(
            {
                "report_to_contained_seconds": {
                    "incidents": len(seconds),
                    "median": round(statistics.median(seconds), 4),
                    "p99": round(percentile(seconds, 0.99), 4),
                    "max": round(max(seconds), 4),
                },
                "intake_reports_per_second": rates,
                "clients": args.clients,
                "configuration": (
                    "the chart's: TLS (ECDSA P-256), values.yaml's settings, an address per "
                    "pod, verdicts to the verdict port on a connection each, heartbeats on a "
                    "kept connection per sender; for the throughput only, the per-source, "
                    "per-job and TokenReview rate limits raised (the chart's would measure "
                    "its limiter)"
                    if args.production
                    else "plain HTTP, every sender from 127.0.0.1, rate limits raised: not "
                    "the chart's (--production)"
                ),
                "operator": str(args.operator_src or ROOT),
                "reports": args.reports,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
