"""What a Guard tells the operator: verdict reports from the elected nodes, heartbeats,
resume reports (the reporter thread that delivers them is :mod:`sdc_agent.reporter`).

Each node's local rank 0 holds the reporter. A verdict is reported by the few nodes
:func:`~sdc_agent.election.elect_reporters` picks (enough for the operator's agreement),
never by every node of a large job; heartbeats go out every ``heartbeat_every`` steps with
the time the checks took since the last one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist

from .config import GuardConfig
from .election import elect_reporters
from .errors import ConfigError, OperatorUnreachableError, ProtocolError
from .judging import NoiseModel
from .protocol import (
    MAX_MESSAGE,
    MAX_REPLAY_KINDS,
    MAX_SUSPECTS,
    HeartbeatReport,
    ReplayKind,
    ReporterIdentity,
    ResumeReport,
    Suspect,
    VerdictReport,
    encode_report,
)
from .reporter import Reporter, ReporterConfig
from .topology import Topology
from .verdict import Verdict

__all__ = ["CHECKS", "GuardReporting"]

log = logging.getLogger("sdc_agent")

CHECKS = ("nonfinite", "replay", "weights")

HEARTBEAT_HOLD_AFTER_VERDICT_SECONDS = 10.0
"""After a step with a verdict, a node's heartbeat waits this long, plus the Reporter's
jitter: past the operator's 5 s in which it sheds heartbeats after a verdict, so the job's
heartbeats do not meet its verdicts (docs/operator.md, "Verdicts first")."""
"""The checks whose time a heartbeat carries (``check_seconds``)."""


class GuardReporting:
    """One Guard's reports (see the module docstring). Creating it is a collective: whether
    the step's flags carry the operator-unreachable halt flag must agree on every rank."""

    def __init__(
        self,
        reporter: Reporter | Literal["auto"] | None,
        *,
        config: GuardConfig,
        topology: Topology,
        group_rank: int,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        run_id: str,
        replayer_of: Mapping[int, int],
        check_seconds: dict[str, float] | None = None,
    ) -> None:
        self.config = config
        self.topology = topology
        self.run_id = run_id
        self._group_rank = group_rank
        self._replayer_of = replayer_of
        me = topology.ranks[group_rank]
        self._me = me.node
        # Each node's local rank 0 holds the reporter: it sends the node's heartbeats and,
        # when elected, a verdict.
        self.reports = me.local_rank == 0
        if reporter == "auto":
            reporter_config = ReporterConfig.from_env()
            reporter = Reporter(reporter_config) if reporter_config is not None else None
        elif reporter is not None and not isinstance(reporter, Reporter):
            raise ConfigError(f"reporter: must be a Reporter, None or 'auto', got {reporter!r}")
        # Whether the step's flags carry the halt flag must be the same on every rank,
        # or some ranks would call a collective the others skip.
        wants_halt = torch.tensor(
            [int(reporter is not None and config.unreachable_policy == "stop")],
            device=comm_device,
        )
        dist.all_reduce(wants_halt, op=dist.ReduceOp.MAX, group=group)
        self.stop_when_unreachable = bool(wants_halt.item())
        self.reporter: Reporter | None = reporter if self.reports else None
        if reporter is not None and not self.reports:
            reporter.close(timeout=0)
        self.identity = ReporterIdentity(rank=me.rank, node=me.node, pod=me.pod)
        self.check_seconds = (
            check_seconds if check_seconds is not None else dict.fromkeys(CHECKS, 0.0)
        )
        """Seconds each check took since the last heartbeat (the checks add to it)."""
        self._heartbeat_at = time.monotonic()

    def log_verdicts(self, step: int, verdicts: Sequence[Verdict]) -> None:
        """Each verdict in the agent log (a WARNING on group rank 0)."""
        for v in verdicts:
            log.log(
                logging.WARNING if self._group_rank == 0 else logging.DEBUG,
                "sdc_agent verdict at step %d (%s check): %s",
                step,
                v.check,
                v.message,
            )

    def unreachable(self) -> OperatorUnreachableError:
        """What ``unreachable_policy='stop'`` raises once the ranks learn of a halt."""
        return OperatorUnreachableError(
            f"a verdict could not be delivered to the operator within "
            f"{self.config.report_deadline_seconds:g} s; unreachable_policy='stop' stops "
            "training here, before another step is applied"
        )

    def verdict_overdue(self) -> bool:
        """A verdict has waited longer than ``report_deadline_seconds`` for delivery."""
        return self.reporter is not None and self.reporter.verdict_overdue(
            self.config.report_deadline_seconds
        )

    def step_done(
        self,
        step: int,
        verdicts: list[Verdict],
        *,
        last_clean_step: int,
        fingerprint_kernel: str,
        gradient_tolerance: float | None,
        bit_reproducible: bool | None,
        noise: NoiseModel | None = None,
        snapshot_step: int | None = None,
    ) -> None:
        """Report the step's verdicts (where this node is elected) and, when due, the
        heartbeat (with the replay audit's thresholds per kind from ``noise``, once it
        audited). ``snapshot_step``: the step of the verified snapshot the ranks write at
        detection, given on the verdicts that make them write it (hardware, not
        transient), so that the operator's stop waits for its report."""
        if self.reporter is None:
            return
        now = time.time()
        if verdicts:
            # every node saw this step's verdict: its heartbeat keeps away from the
            # verdicts' storm (the operator sheds heartbeats then anyway)
            self.reporter.hold_heartbeats(HEARTBEAT_HOLD_AFTER_VERDICT_SECONDS)
        for v in verdicts:
            if self._me in self._reporters_of(v):
                writes = v.accuses_hardware and v.transient is not True
                report = self._verdict_report(v, now)
                if writes and snapshot_step is not None and snapshot_step <= v.last_clean_step:
                    report = dataclasses.replace(report, snapshot_step=snapshot_step)
                self.reporter.submit(report)
        every = self.config.heartbeat_every
        if every and step % every == 0:
            tick = time.monotonic()
            kinds: tuple[ReplayKind, ...] = ()
            if noise is not None and noise.bit_reproducible is not None:
                kinds = tuple(ReplayKind(*row) for row in noise.in_force(MAX_REPLAY_KINDS))
            self.reporter.submit(
                HeartbeatReport(
                    reporter=self.identity,
                    sent_at=now,
                    step=step,
                    last_clean_step=last_clean_step,
                    check_seconds=dict(self.check_seconds),
                    interval_seconds=max(0.0, tick - self._heartbeat_at),
                    fingerprint_kernel=fingerprint_kernel,
                    gradient_tolerance=gradient_tolerance,
                    bit_reproducible=bit_reproducible,
                    replay_dtype=noise.dtype if kinds and noise else None,
                    replay_cap=noise.cap if kinds and noise else None,
                    replay_kinds=kinds,
                    run_id=self.run_id,
                )
            )
            self._heartbeat_at = tick
            for name in self.check_seconds:  # in place: the checks hold this dict
                self.check_seconds[name] = 0.0

    def report_verdicts(self, verdicts: list[Verdict]) -> None:
        """Verdicts found outside a step's end (a step's flags read late)."""
        if self.reporter is None:
            return
        now = time.time()
        for v in verdicts:
            if self._me in self._reporters_of(v):
                self.reporter.submit(self._verdict_report(v, now))

    def resumed(self, step: int, location: str | None) -> None:
        """The job restored a checkpoint of ``step``: a ``resume`` report."""
        if self.reporter is not None:
            self.reporter.submit(
                ResumeReport(
                    reporter=self.identity, sent_at=time.time(), step=step, location=location
                )
            )

    def close(self, timeout: float) -> None:
        if self.reporter is not None:
            self.reporter.close(timeout)

    def _reporters_of(self, v: Verdict) -> tuple[str, ...]:
        group_of = {r.rank: i for i, r in enumerate(self.topology.ranks)}
        suspects = [group_of[r] for r in v.suspect_ranks if r in group_of]
        nodes = [r.node for r in self.topology.ranks]
        return elect_reporters(suspects, nodes, self._replayer_of, self.config.verdict_reporters)

    def _verdict_report(self, v: Verdict, now: float) -> VerdictReport:
        by_rank = {r.rank: r for r in self.topology.ranks}
        suspects = tuple(
            Suspect(
                rank=r,
                node=by_rank[r].node,
                local_rank=by_rank[r].local_rank,
                pod=by_rank[r].pod,
                gpu_uuid=by_rank[r].gpu_uuid,
            )
            for r in v.suspect_ranks
        )
        report = VerdictReport(
            reporter=self.identity,
            sent_at=now,
            check=v.check,
            classification=v.classification,
            step=v.step,
            last_clean_step=v.last_clean_step,
            localized=v.localized,
            transient=v.transient,
            suspects=suspects,
            message=v.message,
            evidence=v.evidence,
            corroborated=v.corroborated,
            run_id=self.run_id,
            bundle=v.bundle,
        )
        try:
            encode_report(report)
        except ProtocolError:  # too large or too long: keep the verdict, trim the details
            report = dataclasses.replace(
                report,
                message=report.message[: MAX_MESSAGE - 20] + " [truncated]"
                if len(report.message) > MAX_MESSAGE
                else report.message,
                suspects=report.suspects[:MAX_SUSPECTS],
                evidence={
                    "truncated": True,
                    "keys": sorted(v.evidence),
                    "suspects": len(report.suspects),
                },
            )
        return report
