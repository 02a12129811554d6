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

Everything shares this machine's cores: the API server, etcd, the operator and the senders.
"""

from __future__ import annotations

import argparse
import http.client
import json
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

from tests.integration.test_containment import Job, make_job, send, verdict  # noqa: E402

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity, encode_report  # noqa: E402
from sdc_harness.cluster import Cluster, OperatorProcess  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(cluster: Cluster, namespace: str, op: OperatorProcess, jobs: list[Job]) -> list[float]:
    seconds = []
    for job in jobs:
        w = watch.Watch()
        stream = w.stream(
            cluster.custom.list_namespaced_custom_object,
            "hyperpod-sdc.dev",
            "v1alpha1",
            namespace,
            "sdcincidents",
            timeout_seconds=60,
        )
        assert send(cluster, op, job, 0, verdict(job, 0))[0] == 202
        started = time.monotonic()
        assert send(cluster, op, job, 2, verdict(job, 2))[0] == 202
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


def throughput(op: OperatorProcess, bodies: list[bytes], tokens: list[str], total: int) -> float:
    port = int(op.url.rsplit(":", 1)[1])
    per_client = total // len(tokens)
    errors: list[str] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
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
        try:
            namespace = cluster.namespace()
            jobs = [make_job(cluster, namespace, f"job{i}") for i in range(args.incidents)]
            op = OperatorProcess(
                cluster, namespace, Path(tmp) / "op.log", extra_env=extra, **limits
            )
            try:
                seconds = latency(cluster, namespace, op, jobs)
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
                    **limits,
                    token_cache_seconds=cache,
                    rate_per_job="1000000",
                    rate_burst="1000000",
                    log_level="WARNING",
                )
                try:
                    throughput(op, bodies, tokens, args.clients * 10)  # warm-up
                    rates[label] = round(throughput(op, bodies, tokens, args.reports), 1)
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
                "operator": str(args.operator_src or ROOT),
                "reports": args.reports,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
