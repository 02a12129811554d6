"""Bogus-token flood against the operator as a real process, with a real incident in the
middle of it.

    flock /tmp/hyperpod-cpu.lock .venv/bin/python bench/operator_flood.py \\
        [--rate 1000] [--seconds 30] [--distinct 300] [--sources 30]

Starts the API server and the operator (default settings), then floods ``/v1/reports`` at
``--rate`` requests per second for ``--seconds`` from ``--sources`` loopback addresses,
with ``--distinct`` JWT-shaped bogus tokens reused in turn (tests/integration/flood.py).
Half-way through, a job's two nodes report a verdict. Prints one JSON object: the flood
as sent and answered, seconds from the second real report to the incident ``Contained``,
and the TokenReviews the API server served during the flood (its own metric) against the
number of distinct tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # sdc_harness

from tests.integration.flood import Flood, bogus_token, token_reviews  # noqa: E402
from tests.integration.test_containment import incident_in, make_job, verdict  # noqa: E402

from sdc_agent.protocol import encode_report  # noqa: E402
from sdc_harness.cluster import Cluster, OperatorProcess, post  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--distinct", type=int, default=300)
    parser.add_argument("--sources", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp) / "apiserver")
        try:
            namespace = cluster.namespace()
            job = make_job(cluster, namespace)
            op = OperatorProcess(cluster, namespace, Path(tmp) / "op.log", log_level="WARNING")
            try:
                tokens = [cluster.token(namespace, pod) for pod in job.pods]
                before = token_reviews(cluster)
                flood = Flood(
                    op.url,
                    args.rate,
                    [bogus_token() for _ in range(args.distinct)],
                    sources=args.sources,
                )
                flood.start()
                time.sleep(args.seconds / 2)
                for reporter in (0, 2):
                    body = encode_report(verdict(job, reporter))
                    status, answer, _ = post(op.url, body, tokens[reporter])
                    assert status == 202, answer
                second = time.monotonic()
                incident_in(cluster, namespace, "Contained", timeout=60)
                contained = time.monotonic() - second
                time.sleep(max(0.0, flood.started + args.seconds - time.monotonic()))
                sent = flood.stop()
                reviews = token_reviews(cluster) - before
                errors = op.log().count(" ERROR ")
            finally:
                op.stop()
        finally:
            cluster.stop()
    print(
        json.dumps(
            {
                "flood": sent,
                "sources": args.sources,
                "contained_after_second_report_s": round(contained, 3),
                "token_reviews": reviews,
                "token_reviews_per_distinct_token": round(reviews / (args.distinct + 2), 3),
                "error_log_lines": errors,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
