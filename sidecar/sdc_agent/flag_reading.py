"""When check 1's flags reach the host: at the step's checks, or during the next step's.

The layout shares a step's flags among the ranks on the device (:mod:`sdc_agent.nonfinite`)
and the gate holds a bad step back with them (:mod:`sdc_agent.gate`). The host reads them
at the step's checks (:meth:`FlagReading.read`), except where the optimizer skips a bad step
on the device and the device is a GPU: there they go to host memory without the host
waiting (:meth:`FlagReading.after_step`), and the next step's checks judge them
(:meth:`FlagReading.judge_late`), behind work already queued. Either way check 1's unit
(:class:`~sdc_agent.check_nonfinite.NonFiniteCheck`) gives the verdict; a halt flag (the
operator-unreachable policy) stops training before the current step is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .audit import ReplayAudit
from .check_nonfinite import LateMicroBatch, NonFiniteCheck
from .checks import StepState
from .clean_steps import CleanSteps
from .layout import ParallelLayout
from .nonfinite import HostFlags
from .reporting import GuardReporting

__all__ = ["FlagReading"]


@dataclass(slots=True)
class _LateFlags:
    """A step whose flags are on their way to the host (see :meth:`FlagReading.judge_late`)."""

    state: StepState
    flags: HostFlags
    micro_batch: LateMicroBatch


class FlagReading:
    """Where and when the host reads one Guard's check-1 flags (see the module docstring).

    ``stop``: called on a halt flag, returns what to raise (the Guard leaves its step
    first)."""

    def __init__(
        self,
        *,
        layout: ParallelLayout,
        check: NonFiniteCheck,
        audit: ReplayAudit,
        reporting: GuardReporting,
        clean: CleanSteps,
        wanted: bool,
        defer: bool,
        stop: Callable[[], BaseException],
    ) -> None:
        self._layout = layout
        self._check = check
        self._audit = audit
        self._reporting = reporting
        self._clean = clean
        self.wanted = wanted
        """Whether the flags travel at all (check 1 on, or the halt flag in use)."""
        self.defer = defer
        """The optimizer skips on a GPU: the host reads a step's flags during the next
        step's checks, never waiting for them in the step itself."""
        self._stop = stop
        self._read = False
        self._late: _LateFlags | None = None

    def begin(self) -> None:
        """A step begins: its flags are not read yet."""
        self._read = False

    def decide(self, state: StepState, group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """At the step's checks: the device flag the gate holds the step back with
        (``None``: no flags travel), read on the host now unless they are deferred (and
        no audit replays this step). A collective."""
        if not self.wanted:
            return None
        flags = self._layout.flags
        if not flags.sent:
            flags.send(group)  # no bucket went through the hook (no_sync?)
        skip = flags.skip_tensor()
        if not self.defer or self._audit.due:
            self._read = True
            host = flags.to_host()
            before, halt = host.read()
            if halt:
                raise self._stop()
            self._check.judge(state, before, after=host.after())
        return skip

    def after_step(self, state: StepState) -> None:
        """The optimizer step is queued: flags not read yet go to host memory without the
        host waiting; the next step's checks judge them (the step itself is held back on
        the device)."""
        if not self.wanted or self._read:
            return
        self._read = True
        self._late = _LateFlags(
            state=state,
            flags=self._layout.flags.to_host(),
            micro_batch=LateMicroBatch(self._audit.payload, self._audit.micro_batches),
        )

    def pending(self, state: StepState) -> bool:
        """``state``'s flags are on their way (its cleanliness waits for them)."""
        return self._late is not None and self._late.state is state

    def forget(self) -> None:
        """A restored checkpoint replaces whatever the step of late flags did."""
        self._late = None

    def last_clean_if_counted(self) -> int:
        """``last_clean_step`` once a step whose late flags came back clean counts
        (waiting for the copy; no collective). Nothing changes: every rank counts the step
        at the next step's checks, where the verified snapshot taken with it is taken on
        every rank alike (under pure FSDP a take is an exchange between ranks: one rank
        taking it alone, here, would wait for the others forever)."""
        late = self._late
        if late is not None and late.flags.clean():
            return self._clean.last_if_passed(late.state.step, "flags")
        return self._clean.last

    def judge_late(self, *, collective: bool, current: StepState | None) -> None:
        """Judge the flags of a step read late: clean, the step counts toward
        ``last_clean_step`` now; not, its verdicts are logged, reported and shown in the
        ``current`` step's result (``None``: between steps, reported at once).
        ``collective``: every rank calls it at the same point (the next step's checks), so
        a rank alone non-finite is replayed on another node; otherwise (``close``) it is
        judged without the replay. A halt flag stops training here, before the current
        step is applied."""
        late = self._late
        if late is None:
            return
        self._late = None
        before, halt = late.flags.read()
        if halt and collective:
            raise self._stop()
        known = len(late.state.verdicts)
        micro_batch = late.micro_batch if collective else LateMicroBatch(None, 1)
        self._check.judge(late.state, before, micro_batch, late.flags.after())
        found = late.state.verdicts[known:]
        self._clean.resolved(late.state.step, "flags", passed=not found)
        if not found:
            return
        if current is not None:
            late.state.verdicts[known:] = []
            current.late_verdicts.extend(found)  # logged and reported with this step's
            return
        found = [self._layout.locate(v) for v in found]
        self._reporting.log_verdicts(late.state.step, found)
        self._reporting.report_verdicts(found)
