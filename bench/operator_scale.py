"""A detection storm from one job of N nodes, against the operator as a real process.

    flock /tmp/hyperpod-cpu.lock .venv/bin/python bench/operator_scale.py [--nodes 64 256 512]
    flock /tmp/hyperpod-cpu.lock .venv/bin/python bench/operator_scale.py --nodes 1024
    .venv/bin/python bench/operator_scale.py --operator-src /tmp/op-main --nodes 64 128

For each N: a fresh API server (scripts/kube-apiserver.sh), N nodes, one PyTorchJob of N
pods (attested as the training operator's), N bound tokens, the operator. Then, every
node's agent on its own connection with the agent's 5 s timeout and back-off
(tests/integration/storm.py):

1. ``heartbeats_cold``: every node sends its first heartbeat at once (each token reviewed);
   ``heartbeats_warm``: and again;
2. ``verdict`` storms, twice on the same job with different suspects: ``elected``, the
   three reporters the agents elect by default (HYPERPOD_SDC_VERDICT_REPORTERS=3), and
   ``every_node`` (old agents, or HYPERPOD_SDC_VERDICT_REPORTERS=0).

It prints one JSON object: per N and storm, the first attempts (answers, p50/p99),
seconds from releasing the senders to the watch showing the incident ``Contained`` (job
suspended, node quarantined), ``/healthz`` worst answer, API requests per report (the
operator's own counter, and the API server's count, watches left out), the operator's CPU
seconds and peak RSS; then a least-squares line through CPU seconds, peak RSS and
containment time against N, and what it predicts for 2,000 nodes.

``--operator-src DIR`` runs the operator from another checkout's ``operator/`` and
``sidecar/`` (the "before" figures, e.g. ``git archive main | tar -x -C /tmp/op-main``);
such an operator may know none of the newer settings and metrics.

Everything shares this machine's cores: the API server, etcd, the operator and the senders.

``--production`` runs each size as the chart deploys the operator: TLS with an ECDSA P-256
certificate, the chart's operator settings (values.yaml: rate limits, connection limits,
lease, resync), each agent from its own loopback address (127.1.x.y), the chart's memory
limit (a cgroup v1 limit where the machine allows one), and each storm (elected reporters,
every node) released together with every node's heartbeat. The agents are real Reporters,
spread over ``--generator-processes`` processes (bench/generator.py), their connections
opened before the storms. It prints how much CPU the load generator used beside the
operator's, the lease's fate, and where it departs from the chart:

    flock /tmp/cpu.lock .venv/bin/python bench/operator_scale.py --production \
        --nodes 512 1024 2048
    flock /tmp/cpu.lock .venv/bin/python bench/operator_scale.py --production --nodes 1024 \
        --replicas 2 [--replica-down]
    flock /tmp/cpu.lock .venv/bin/python bench/operator_scale.py --production --nodes 2048 \
        --profile /tmp/op.prof    # then: python -m pstats /tmp/op.prof
    flock /tmp/cpu.lock .venv/bin/python bench/operator_scale.py --production --nodes 2048 \
        --trace /tmp/op.json      # every API call, the loop's lateness (bench/traced_operator.py)

In production every node's agent runs on its node. Here the generator's 2,048 Reporter
threads share two cores with the operator's few, and the kernel shares the cores by
thread: in the first half second of an elected storm the generator used about 0.95 of the
1 core-second the machine had, the operator 0.04. The default arrangement is therefore the
pessimistic bound. ``--elected-apart --generator-nice 19`` is the optimistic one: the three
elected reporters' agents each in a process of its own at the bench's niceness, the other
nodes' at niceness 19, so the verdicts' senders, the operator and the API server take the
cores first and the rest of the load is sent only when they leave a core idle: the
operator never meets more of the burst than it can absorb (the chart reserves the operator
200m of CPU, not a core of its own). In its storm of every node the first verdicts always
come from the three agents apart, so its "contained" is close to the elected storm's, not
a storm of every node's verdicts at once (``--generator-nice 19`` alone sets none apart);
and the generator reads its answers late, so its "first attempts answered within 5 s"
measures the starved generator, not the operator:

    flock /tmp/cpu.lock .venv/bin/python bench/operator_scale.py --production --nodes 2048 \
        --elected-apart --generator-nice 19
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # sdc_harness

from tests.integration import storm  # noqa: E402

from sdc_harness.cluster import Cluster, OperatorProcess, wait_for  # noqa: E402

SETTINGS = {
    # every simulated agent sends from 127.0.0.1: the per-address limit is for attackers
    "rate_per_source": "1000000",
    "rate_source_burst": "1000000",
    "connections_per_source": "1000000",
    "token_reviews_per_source": "1000000",
    "token_review_source_burst": "1000000",
    # main's defaults (a burst of 400 a job) would refuse a storm of 512 on their own
    "rate_burst": "100000",
    "rate_per_job": "100000",
    "log_level": "WARNING",
}


def _code_version() -> str:
    """The checkout the bench and the operator ran from (``git describe --always
    --dirty``: ``-dirty`` where its files differ from the commit)."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown (not a git checkout)"


def fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = a + b x, and what it predicts for 2,000 nodes."""
    n = len(xs)
    if n < 2:
        return {}
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    a = my - b * mx
    return {
        "intercept": round(a, 4),
        "per_node": round(b, 6),
        "at_2000_nodes": round(a + b * 2000, 3),
        "at_4096_nodes": round(a + b * 4096, 3),
    }


def storm_once(
    cluster: Cluster,
    namespace: str,
    op: OperatorProcess,
    job: storm.Job,
    tokens: list[str],
    reporters: list[int],
    suspect: int,
    step: int,
) -> dict[str, Any]:
    watcher = storm.Contained(cluster, namespace, step)
    probe = storm.HealthProbe(op.metrics_url)
    api_before = storm.operator_api_requests(op.metrics())
    server_before = storm.apiserver_requests(cluster)
    cpu_before = storm.cpu_seconds(op.proc.pid)
    senders, released = storm.burst(
        op.url, storm.verdicts(job, reporters, suspect, step), [tokens[i] for i in reporters]
    )
    contained = watcher.wait(120)
    time.sleep(1.0)  # what containment wrote, counted
    out = storm.summary(senders)
    reports = out["attempts"] or 1
    out.update(
        contained_s=round(contained - released, 3) if contained else None,
        healthz_worst_s=round(probe.stop(), 3),
        operator_api_requests_per_report=round(
            (storm.operator_api_requests(op.metrics()) - api_before) / reports, 3
        ),
        apiserver_requests_per_report=round(
            (storm.apiserver_requests(cluster) - server_before) / reports, 3
        ),
        operator_cpu_s=round(storm.cpu_seconds(op.proc.pid) - cpu_before, 2),
    )
    if watcher.incident:
        status = watcher.incident["status"]
        out["incident"] = {
            "node_quarantined": status.get("node") == job.node_name(suspect),
            "reports_recorded": len(status.get("reports") or []),
        }
    return out


def run(nodes: int, operator_src: Path | None, tmp: Path) -> dict[str, Any]:
    cluster = Cluster(tmp / f"apiserver-{nodes}")
    try:
        namespace = cluster.namespace()
        made = time.monotonic()
        job, tokens = storm.job_of(cluster, namespace, nodes)
        setup_s = time.monotonic() - made
        extra: dict[str, str] = {}
        if operator_src is not None:
            extra["PYTHONPATH"] = f"{operator_src / 'operator'}:{operator_src / 'sidecar'}"
        op = OperatorProcess(
            cluster, namespace, tmp / f"op-{nodes}.log", extra_env=extra, **SETTINGS
        )
        try:
            result: dict[str, Any] = {"nodes": nodes, "setup_s": round(setup_s, 1)}
            idle_rss = storm.rss_peak_mb(op.proc.pid)
            for label in ("heartbeats_cold", "heartbeats_warm"):
                api_before = storm.operator_api_requests(op.metrics())
                server_before = storm.apiserver_requests(cluster)
                senders, _ = storm.burst(op.url, storm.heartbeats(job), tokens)
                time.sleep(0.5)
                got = storm.summary(senders)
                got["operator_api_requests_per_heartbeat"] = round(
                    (storm.operator_api_requests(op.metrics()) - api_before) / nodes, 3
                )
                got["apiserver_requests_per_heartbeat"] = round(
                    (storm.apiserver_requests(cluster) - server_before) / nodes, 3
                )
                result[label] = got
            result["elected"] = storm_once(
                cluster,
                namespace,
                op,
                job,
                tokens,
                storm.elected(nodes, nodes // 3),
                nodes // 3,
                15,
            )
            result["every_node"] = storm_once(
                cluster, namespace, op, job, tokens, list(range(nodes)), (2 * nodes) // 3, 30
            )
            result["operator_peak_rss_mb"] = round(storm.rss_peak_mb(op.proc.pid), 1)
            result["operator_rss_after_setup_mb"] = round(idle_rss, 1)
        finally:
            op.stop()
        return result
    finally:
        cluster.stop()


CHART = ROOT / "charts" / "hyperpod-sdc"
CHART_MEMORY_LIMIT_MIB = 1024
"""The chart's resources.limits.memory (1Gi)."""
DEPARTURES = [
    "one replica unless --replicas 2 (the chart runs two behind a Service; with two, the "
    "agents are split between the replicas by node, as the Service would split their "
    "connections)",
    "an admin kubeconfig: the chart's RBAC is not applied",
    "pods carry the creator marker the admission webhook would write, written by the bench",
    "HYPERPOD_SDC_NAMESPACES is the job's namespace (the chart watches every namespace)",
    "the agents' heartbeat jitter is 0 (the default is 10 s) and their heartbeats are "
    "submitted with the verdicts, not through the Guard, so the agent's hold after a step "
    "with a verdict (Reporter.hold_heartbeats) does not apply: every heartbeat of the job "
    "arrives together with the verdicts, the worst case",
    "the agents (the generator: one real Reporter thread per node) run in "
    "--generator-processes processes on the same cores as the operator, the API server and "
    "etcd (with --elected-apart, the elected reporters' each in a process of its own; "
    "generator_nice: the shared processes' niceness; with both, the three nodes apart send "
    "the first verdicts of the storm of every node ahead of the others); their CPU is "
    "printed beside the operator's (generator_cpu_s)",
    "every agent's kept connection is opened (TLS handshake, token review) by a paced warm-up "
    "heartbeat before the storms, as the agent keeps it in production: the storms are requests "
    "on warm connections, not a storm of handshakes",
    "the operator's memory limit is a cgroup v1 limit on its growth after start-up where "
    "the machine allows one, else peak RSS from /proc compared with the chart's limit",
]


def chart_settings() -> dict[str, str]:
    """The chart's operator values (values.yaml), as the operator's settings."""
    import re

    import yaml

    sys.path.insert(0, str(ROOT / "operator"))
    from sdc_operator.settings import ENV_OF_FIELD

    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    out = {}
    for key, value in values.items():
        field = re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()
        if field in ENV_OF_FIELD and not isinstance(value, list | dict) and value != "":
            out[field] = str(value).lower() if isinstance(value, bool) else str(value)
    out.pop("namespaces", None)
    return out


def chart_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and the operator's serving certificate and key under ``directory``, ECDSA
    P-256 as the chart generates them: (CA certificate, certificate, key)."""
    from sdc_harness.tls import issue

    directory.mkdir()
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=bench-ca", "-keyout", str(ca_key),
         "-out", str(ca_cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    key, cert = issue(directory, (ca_key, ca_cert), "tls", algorithm="ec")
    return ca_cert, cert, key


def production(
    nodes: int,
    tmp: Path,
    replicas: int = 1,
    processes: int = 8,
    profile: Path | None = None,
    down: bool = False,
    keep_logs: Path | None = None,
    trace: Path | None = None,
    old_agents: bool = False,
    generator_nice: int = 0,
    cluster: Cluster | None = None,
    pause_s: float = 6.0,
    elected_apart: bool = False,
) -> dict[str, Any]:
    """One size in the chart's configuration: TLS with an ECDSA P-256 certificate, the
    chart's settings, one real Reporter per node from its own loopback address, keeping its
    one connection (opened before the storms, as in production), spread over ``processes``
    generator processes; storms of the elected reporters and of every node, each released
    together with every node's heartbeat (a node's Reporter sends its verdict first).
    ``profile``: the (first) operator runs under cProfile, its statistics written there.
    ``down``: with two replicas, the leader is stopped before the warm-up (a rollout with
    one replica down): every agent reports to the survivor, as through the Service.
    ``keep_logs``: the operators' logs are copied there. The agents send their verdicts
    to the operator's verdict port, as the chart's webhook tells them to; ``old_agents``:
    they know no verdict port (agents of releases before it), everything goes on their
    kept connection to the main port. ``generator_nice``: the generator's processes at
    that niceness (19: the operator, the API server and etcd take the cores before the
    agents, as where the agents run on other machines). ``elected_apart``: the elected
    reporters' agents each in a process of its own at niceness 0. ``cluster``: an API server
    already started (the suite's), in a namespace of its own, instead of one started (and
    stopped) here. ``pause_s``: the operator's quiet after the warm-up and after each storm
    (the verdicts' 5 s shedding over before the next storm's figures are taken); the suite,
    which checks deliveries and containment, not their times, passes 0."""
    from bench.generator import Generator

    ca_cert, cert, key = chart_tls(tmp / f"tls-{nodes}")
    own = cluster is None
    cluster = cluster or Cluster(tmp / f"apiserver-{nodes}")
    try:
        namespace = cluster.namespace()
        made = time.monotonic()
        job, tokens = storm.job_of(cluster, namespace, nodes)
        sources: list[str | None] = [storm.source_of(i) for i in range(nodes)]
        setup_s = time.monotonic() - made
        settings: Any = {**chart_settings(), "log_level": "WARNING"}
        notes = []
        if int(settings.get("rate_burst", 0)) < 2 * nodes:
            # the chart's comment: keep rateBurst above twice the largest job's node count
            settings["rate_burst"] = str(2 * nodes + 1000)
            notes.append(f"rate_burst {settings['rate_burst']}, as values.yaml says for this size")
        if int(settings.get("max_connections", 0)) < nodes + 512:
            settings["max_connections"] = str(nodes + 512)
            notes.append(f"max_connections {settings['max_connections']} (one per node + 512)")
        ops = []
        for r in range(replicas):
            extra = {}
            module = "sdc_operator"
            if profile is not None and r == 0:
                extra = {"SDC_BENCH_PROFILE": str(profile)}
                module = "bench.profiled_operator"
            elif trace is not None and r == 0:
                extra = {"SDC_BENCH_TRACE": str(trace)}
                module = "bench.traced_operator"
            ops.append(
                OperatorProcess(
                    cluster,
                    namespace,
                    tmp / f"op-{nodes}-{r}.log",
                    scheme="https",
                    tls_cert_file=str(cert),
                    tls_key_file=str(key),
                    extra_env=extra,
                    module=module,
                    **settings,
                )
            )
        groups = [_memory_cgroup(op.proc.pid) for op in ops]
        alive = list(ops)
        if down and replicas > 1:
            # the replica holding the Lease goes (the worse case): SIGTERM, as a rollout
            # deletes its pod; the Service sends every agent to the survivor
            wait_for("a leader", lambda: any("is the leader" in op.log() for op in ops), 60)
            leader = next(op for op in ops if "is the leader" in op.log())
            leader.stop()
            alive = [op for op in ops if op is not leader]
        # the Service splits the agents' connections between the replicas
        urls = [alive[i % len(alive)].url for i in range(nodes)]
        verdict_urls: list[str | None] = [
            None if old_agents else alive[i % len(alive)].verdict_url for i in range(nodes)
        ]
        elected = storm.elected(nodes, nodes // 3)  # the first storm's reporters
        generator = Generator(
            urls,
            tokens,
            tmp / f"tokens-{nodes}",
            ca_cert,
            sources,
            processes,
            verdict_urls,
            nice=generator_nice,
            apart=elected if elected_apart else None,
        )
        try:
            result: dict[str, Any] = {
                "nodes": nodes,
                "replicas": replicas,
                "generator_processes": generator.processes,
                "generator_nice": generator_nice,
                "elected_apart": elected_apart,
                "setup_s": round(setup_s, 1),
                "settings_raised": notes,
                "agents": "old: no verdict port, every report on the main port"
                if old_agents
                else "verdicts, checkpoint and resume records to the verdict port",
            }
            result["operator_rss_after_start_mb"] = [
                round(storm.rss_peak_mb(op.proc.pid), 1) for op in alive
            ]
            result["memory_limit"] = (
                f"cgroup: growth limited to {groups[0][1] / 2**20:.0f} MiB"
                if groups[0]
                else "no cgroup: peak RSS checked"
            )
            warm = generator.warm(list(enumerate(storm.heartbeat_reports(job))))
            result["warm_up"] = {
                **{k: v for k, v in warm.items() if k != "senders"},
                "heartbeats": storm.summary(warm["senders"]),
                "note": "every agent's kept connection opened (TLS handshake, token review) "
                "with a heartbeat before the storms, as the agent keeps it in production: "
                "the storms below are requests on warm connections",
            }
            if len(alive) < len(ops):
                result["replica_down"] = (
                    "the leader was stopped (SIGTERM) before the warm-up; every agent "
                    "reports to the survivor"
                )
            time.sleep(pause_s)  # the operator's quiet after the burst
            for label, reporters, suspect, step in (
                ("elected_with_heartbeats", elected, nodes // 3, 115),
                ("every_node_with_heartbeats", list(range(nodes)), (2 * nodes) // 3, 215),
            ):
                watcher = storm.Contained(cluster, namespace, step)
                cpu = [storm.cpu_seconds(op.proc.pid) for op in alive]
                reports: list[tuple[int, Any]] = [
                    (i, storm.verdict(job, i, suspect, step=step, last_clean=step - 5))
                    for i in reporters
                ] + list(enumerate(storm.heartbeat_reports(job)))
                senders, released, spent = generator.release(reports)
                wall = time.time() - (time.monotonic() - released)
                contained = watcher.wait(120)
                answered = [
                    x
                    for x in senders
                    if x.attempts
                    and x.attempts[0][0].isdigit()
                    and x.attempts[0][1] < storm.TIMEOUT_SECONDS
                ]
                name = (watcher.incident or {}).get("metadata", {}).get("name", "")
                logged = [_logged_at(op.log(), namespace, name) for op in ops]
                # (with two replicas one may log the agreement and the other the stop)
                agreed = [t for got in logged for t in got["agreed"]]
                done = [t for got in logged for t in got["contained"]]
                operator_cpu = [
                    round(storm.cpu_seconds(op.proc.pid) - c, 2)
                    for op, c in zip(alive, cpu, strict=True)
                ]
                got = {
                    "contained_s": round(contained - released, 3) if contained else None,
                    "agreed_in_operator_log_s": round(min(agreed) - wall, 3) if agreed else None,
                    "contained_in_operator_log_s": round(min(done) - wall, 3) if done else None,
                    "verdicts": storm.summary(senders[: len(reporters)]),
                    "heartbeats": storm.summary(senders[len(reporters) :]),
                    "first_attempts_answered_within_5_s": round(len(answered) / len(senders), 4),
                    "connections_opened": spent["connections_opened"],
                    "verdict_port_connections": spent["verdict_port_connections"],
                    "operator_cpu_s": operator_cpu,
                    "generator_cpu_s": spent["generator_cpu_s"],
                    "generator_to_operator_cpu": round(
                        spent["generator_cpu_s"] / max(0.01, sum(operator_cpu)), 2
                    ),
                    "wall_s": round(time.monotonic() - released, 2),
                    "released_at_unix": round(wall, 3),
                }
                result[label] = got
                time.sleep(pause_s)
            result["operator_peak_rss_mb"] = [
                round(storm.rss_peak_mb(op.proc.pid), 1) for op in alive
            ]
            result["under_chart_limit"] = all(
                r < CHART_MEMORY_LIMIT_MIB for r in result["operator_peak_rss_mb"]
            )
            result["operator_alive"] = [op.proc.poll() is None for op in alive]
            result["lease_lost"] = ["no longer acting" in op.log() for op in alive]
            result["leaders"] = [op.log().count("is the leader") for op in ops]
            result["leader_after_the_storms"] = ["is the leader" in op.log() for op in alive]
            result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        finally:
            generator.close()
            for op, group in zip(ops, groups, strict=True):
                op.stop()
                if group:
                    group[0].rmdir()
                if keep_logs is not None:
                    keep_logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(op.log_path, keep_logs / op.log_path.name)
        return result
    finally:
        if own:
            cluster.stop()


def _logged_at(log: str, namespace: str, name: str) -> dict[str, list[float]]:
    """When the operator logged incident ``namespace/name``'s transitions (unix seconds,
    its log's millisecond clock): ``agreed`` (Detected) and ``contained`` (job stopped).
    Free of the generator's own delays: the watch that times ``contained_s`` is a thread of
    the generator."""
    import datetime

    marker = f" WARNING sdc_operator.engine: incident {namespace}/{name}: "
    out: dict[str, list[float]] = {"agreed": [], "contained": []}
    for line in log.splitlines():
        if not name or marker not in line or f"{marker}confirmation" in line:
            continue
        at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out["contained" if f"{marker}job stopped" in line else "agreed"].append(at)
    return out


def _memory_cgroup(pid: int) -> tuple[Path, int] | None:
    """``pid`` moved into a cgroup v1 memory group that limits its growth so that it
    stays under the chart's limit; ``None`` where the machine allows none."""
    path = Path("/sys/fs/cgroup/memory") / f"bench-operator-{pid}"
    try:
        path.mkdir()
    except OSError:
        return None
    limit = int((CHART_MEMORY_LIMIT_MIB - storm.rss_peak_mb(pid)) * 2**20)
    (path / "memory.limit_in_bytes").write_text(str(limit))
    (path / "cgroup.procs").write_text(str(pid))
    return path, limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--operator-src", type=Path, default=None)
    parser.add_argument(
        "--production",
        action="store_true",
        help="the chart's configuration: TLS (ECDSA), the chart's settings, an address per "
        "agent, heartbeat bursts with the verdicts (what departs from the chart is printed)",
    )
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2))
    parser.add_argument(
        "--replica-down",
        action="store_true",
        help="with --replicas 2: the leader is stopped before the storms (a rollout with one "
        "replica down) and every agent reports to the survivor",
    )
    parser.add_argument(
        "--generator-processes",
        type=int,
        default=8,
        help="processes the agents are spread over (default 8)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="--production: run the (first) operator under cProfile and write its statistics "
        "to this file, one size only (read it with python -m pstats)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="--production: run the (first) operator with a timeline of its API calls, its "
        "event loop's lateness and its stacks, written to this file as JSON "
        "(bench/traced_operator.py), one size only",
    )
    parser.add_argument(
        "--old-agents",
        action="store_true",
        help="--production: the agents know no verdict port (agents of releases before it): "
        "every report goes on their kept connection to the intake's main port",
    )
    parser.add_argument(
        "--generator-nice",
        type=int,
        default=0,
        help="--production: the generator's processes at this niceness (19: the operator, "
        "the API server and etcd get the cores before the agents, as where the agents run on "
        "other machines; what the generator's CPU costs the figures)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        help="--production: copy the operators' logs (op-NODES-REPLICA.log) to this folder",
    )
    parser.add_argument(
        "--elected-apart",
        action="store_true",
        help="--production: the elected reporters' agents each in a generator process of "
        "its own at the bench's niceness (in production a node's agent shares neither its "
        "process nor its cores with other nodes' agents); with --generator-nice 19 the other "
        "nodes' agents take the cores last: the optimistic bound (see the module's doc)",
    )
    args = parser.parse_args()
    if args.production:
        with tempfile.TemporaryDirectory() as tmp:
            runs = []
            for nodes in args.nodes:
                runs.append(
                    production(
                        nodes,
                        Path(tmp),
                        args.replicas,
                        args.generator_processes,
                        args.profile,
                        args.replica_down,
                        args.keep_logs,
                        args.trace,
                        args.old_agents,
                        args.generator_nice,
                        elected_apart=args.elected_apart,
                    )
                )
                print(json.dumps(runs[-1]), file=sys.stderr)
        xs = [float(r["nodes"]) for r in runs]
        fits = {}
        for label in ("elected_with_heartbeats", "every_node_with_heartbeats"):
            ys = [r[label]["contained_s"] for r in runs]
            if all(isinstance(y, int | float) for y in ys):
                fits[f"{label}.contained_s"] = fit(xs, ys)
        fits["operator_peak_rss_mb"] = fit(xs, [max(r["operator_peak_rss_mb"]) for r in runs])
        print(
            json.dumps(
                {
                    "command": " ".join(["bench/operator_scale.py", *sys.argv[1:]]),
                    "code": _code_version(),
                    "cpus": os.cpu_count(),
                    "departures_from_the_chart": DEPARTURES,
                    "runs": runs,
                    "fits": fits,
                }
            )
        )
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for nodes in args.nodes:
            results.append(run(nodes, args.operator_src, Path(tmp)))
            print(json.dumps(results[-1]), file=sys.stderr)
    xs = [float(r["nodes"]) for r in results]
    curves: dict[str, Any] = {}
    for storm_name in ("elected", "every_node"):
        for metric in ("operator_cpu_s", "contained_s"):
            ys = [r[storm_name].get(metric) for r in results]
            if all(isinstance(y, int | float) for y in ys):
                curves[f"{storm_name}.{metric}"] = fit(xs, [float(y) for y in ys])
    curves["operator_peak_rss_mb"] = fit(xs, [r["operator_peak_rss_mb"] for r in results])
    print(
        json.dumps(
            {
                "operator": str(args.operator_src or ROOT),
                "agent_timeout_s": storm.TIMEOUT_SECONDS,
                "runs": results,
                "fits": curves,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
