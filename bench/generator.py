"""The load generator of ``bench/operator_scale.py --production``: one real
:class:`sdc_agent.reporter.Reporter` per node (``tests.integration.storm.Agent``, each bound
to its own loopback address), spread over several processes so that no one interpreter
holds thousands of sending threads behind one GIL.

With 2,048 Reporter threads in one process the generator used 3-5 times the operator's CPU
(load average 101), and the figures measured the generator. Here each process holds
``nodes / processes`` agents; the coordinator (the bench) sends every process its share of
a storm with a release time, and each process answers with its senders' attempts and the
CPU it used.

Before the first storm every agent opens its one kept connection (TLS handshake, token
review) with a heartbeat, a few agents at a time per process (:meth:`Generator.warm`): the
agent keeps that connection alive in production, so a storm is requests on warm
connections, not a storm of handshakes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tests.integration import storm

from sdc_agent.protocol import Report


def _cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _serve(
    pipe: Connection,
    urls: list[str],
    tokens: list[str],
    directory: Path,
    ca: Path | None,
    sources: list[str | None],
    verdict_urls: list[str | None],
    nice: int = 0,
) -> None:
    """One generator process: its agents (their threads at ``nice``), then commands from
    the coordinator until ``close``."""
    if nice:
        os.nice(nice)  # before the agents' threads start: they inherit it
    agents = storm.agents(urls, tokens, directory, ca, sources, verdict_urls)
    pipe.send(("ready", os.getpid()))
    while True:
        command, argument = pipe.recv()
        if command == "close":
            for agent in agents:
                agent.close(timeout=0.1)
            pipe.send(("closed", None))
            return
        if command == "warm":
            reports, at_once = argument
            began, cpu = time.monotonic(), _cpu_seconds()
            senders: list[storm.Sender] = []
            for start in range(0, len(reports), at_once):
                got, _ = storm.release(agents, reports[start : start + at_once])
                senders += got
            open_now = sum(1 for a in agents if a._conn is not None and a._conn.sock is not None)
            pipe.send(
                (
                    "warm",
                    {
                        "senders": senders,
                        "seconds": time.monotonic() - began,
                        "cpu_s": _cpu_seconds() - cpu,
                        "connections_open": open_now,
                    },
                )
            )
        elif command == "release":
            reports, at, timeout = argument
            opened = sum(a.connections_opened for a in agents)
            to_verdict_port = sum(a.verdict_connections for a in agents)
            time.sleep(max(0.0, at - time.monotonic()))
            cpu = _cpu_seconds()
            senders, released = storm.release(agents, reports, timeout)
            pipe.send(
                (
                    "released",
                    {
                        "senders": senders,
                        "released": released,
                        "cpu_s": _cpu_seconds() - cpu,
                        "connections_opened": sum(a.connections_opened for a in agents) - opened,
                        "verdict_port_connections": sum(a.verdict_connections for a in agents)
                        - to_verdict_port,
                    },
                )
            )


def placement(
    nodes: int, processes: int, nice: int, apart: list[int]
) -> tuple[list[tuple[list[int], int]], list[tuple[int, int]]]:
    """Which process holds which node: ``(its nodes, its niceness)`` per process (the
    nodes not ``apart`` dealt out in turn over at most ``processes`` processes at
    ``nice``, then one process at the bench's own niceness (``0``) per node ``apart``), and
    per node ``(its process, its index there)``."""
    apart = [node for node in dict.fromkeys(apart) if 0 <= node < nodes]
    shared = [node for node in range(nodes) if node not in apart]
    count = max(1, min(processes, len(shared)))
    plan = [(shared[p::count], nice) for p in range(count) if shared[p::count]]
    plan += [([node], 0) for node in apart]
    where = [(0, 0)] * nodes
    for p, (mine, _) in enumerate(plan):
        for local, node in enumerate(mine):
            where[node] = (p, local)
    return plan, where


class Generator:
    """``len(urls)`` agents (node ``i`` reports to ``urls[i]``, and its verdicts to
    ``verdict_urls[i]`` where given, with ``tokens[i]`` from ``sources[i]``) over
    ``processes`` processes, dealt out in turn, and a process of its own for each node in
    ``apart``. ``nice``: the shared processes' niceness (19: the operator and the API
    server take the cores first, as where the agents run on other machines); the nodes
    ``apart`` keep the bench's own niceness. The bench can set the elected reporters apart:
    in production a node's agent shares its process with its own training only, not with
    255 other nodes' agents and their GIL, and its CPU is its node's."""

    def __init__(
        self,
        urls: list[str],
        tokens: list[str],
        directory: Path,
        ca: Path | None,
        sources: list[str | None],
        processes: int,
        verdict_urls: list[str | None] | None = None,
        nice: int = 0,
        apart: list[int] | None = None,
    ) -> None:
        self.nodes = len(urls)
        verdict_urls = verdict_urls or [None] * self.nodes
        plan, self._where = placement(self.nodes, processes, nice, apart or [])
        self.processes = len(plan)
        self._sizes = [len(mine) for mine, _ in plan]
        context = multiprocessing.get_context("spawn")  # no threads of ours inherited
        self._pipes: list[Connection] = []
        self._procs: list[Any] = []
        for p, (mine, niceness) in enumerate(plan):
            here, there = context.Pipe()
            proc = context.Process(
                target=_serve,
                args=(
                    there,
                    [urls[i] for i in mine],
                    [tokens[i] for i in mine],
                    directory / f"process-{p}",
                    ca,
                    [sources[i] for i in mine],
                    [verdict_urls[i] for i in mine],
                    niceness,
                ),
                daemon=True,
            )
            proc.start()
            self._pipes.append(here)
            self._procs.append(proc)
        self.pids = [self._expect(pipe, "ready") for pipe in self._pipes]

    def _expect(self, pipe: Connection, what: str, timeout: float = 300) -> Any:
        if not pipe.poll(timeout):
            raise TimeoutError(f"a generator process did not answer {what!r} in {timeout} s")
        kind, value = pipe.recv()
        assert kind == what, (kind, what)
        return value

    def _split(self, reports: list[tuple[int, Report]]) -> list[list[tuple[int, Report]]]:
        """Each process's share of ``reports``, by its local agent index, in order."""
        shares: list[list[tuple[int, Report]]] = [[] for _ in range(self.processes)]
        for node, report in reports:
            process, local = self._where[node]
            shares[process].append((local, report))
        return shares

    def _merge(
        self, reports: list[tuple[int, Report]], answers: list[dict[str, Any]]
    ) -> list[storm.Sender]:
        """The senders of every process, back in the order of ``reports``."""
        taken = [iter(answer["senders"]) for answer in answers]
        return [next(taken[self._where[node][0]]) for node, _ in reports]

    def warm(self, reports: list[tuple[int, Report]], at_once: int = 16) -> dict[str, Any]:
        """Every agent opens its kept connection with ``reports`` (a heartbeat each), at most
        ``at_once`` agents at a time in each process."""
        for pipe, share in zip(self._pipes, self._split(reports), strict=True):
            pipe.send(("warm", (share, at_once)))
        answers = [self._expect(pipe, "warm") for pipe in self._pipes]
        return {
            "senders": self._merge(reports, answers),
            "seconds": round(max(a["seconds"] for a in answers), 2),
            "generator_cpu_s": round(sum(a["cpu_s"] for a in answers), 2),
            "connections_open": sum(a["connections_open"] for a in answers),
            "handshakes_at_once_at_most": sum(min(at_once, size) for size in self._sizes),
        }

    def release(
        self, reports: list[tuple[int, Report]], timeout: float = 150, lead: float = 0.5
    ) -> tuple[list[storm.Sender], float, dict[str, Any]]:
        """Every ``(node, report)`` submitted to its agent at the same moment in every
        process (``lead`` seconds from now); the senders in the order of ``reports``, the
        monotonic release time, and the generator's CPU seconds and connections opened."""
        at = time.monotonic() + lead
        for pipe, share in zip(self._pipes, self._split(reports), strict=True):
            pipe.send(("release", (share, at, timeout)))
        answers = [self._expect(pipe, "released", timeout + 60) for pipe in self._pipes]
        return (
            self._merge(reports, answers),
            min(a["released"] for a in answers),
            {
                "generator_cpu_s": round(sum(a["cpu_s"] for a in answers), 2),
                "connections_opened": sum(a["connections_opened"] for a in answers),
                "verdict_port_connections": sum(a["verdict_port_connections"] for a in answers),
            },
        )

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(("close", None))
        for pipe, proc in zip(self._pipes, self._procs, strict=True):
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self._expect(pipe, "closed", 30)
            proc.join(10)
            if proc.is_alive():
                proc.kill()
