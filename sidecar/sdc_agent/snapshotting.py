"""The Guard's verified snapshot: when it is taken, what it keeps, when it is written.

:class:`~sdc_agent.snapshot.Snapshot` is the state in host memory and its write; this is
the plumbing around it that the Guard drives: a snapshot is taken each time
``last_clean_step`` advances to the state the model holds (and at the start and at every
restore, whose states are trusted), the extras a job registers travel with it, the
operator is told which step will be written with a hardware verdict, and the write at
detection holds every later step back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .checks import StepState
from .clean_steps import CleanSteps
from .config import GuardConfig
from .errors import ConfigError
from .layout import ParallelLayout
from .reporter import Reporter
from .snapshot import Snapshot, SnapshotWrite, StateSource
from .topology import Topology
from .verdict import Verdict

__all__ = ["SnapshotKeeper"]


class SnapshotKeeper:
    """The snapshot of the newest clean state the model held (``snapshot``: ``None`` when
    ``snapshot_copies`` is 0 or host memory is too short)."""

    def __init__(
        self,
        *,
        config: GuardConfig,
        layout: ParallelLayout,
        optimizer: Any,
        topology: Topology,
        run_id: str,
        clean: CleanSteps,
        start: int,
        held: Callable[[], int],
    ) -> None:
        self.topology = topology
        self.config = config
        self._held = held
        """The step whose state the model holds now."""
        self.snapshot: Snapshot | None = None
        if config.snapshot_copies == 0:
            return
        snapshot = Snapshot(
            module=layout.module,
            optimizer=optimizer,
            topology=topology,
            group_rank=layout.group_rank,
            group=layout.group,
            comm_device=layout.comm_device,
            copies=config.snapshot_copies,
            memory_fraction=config.snapshot_memory_fraction,
            write_seconds=config.snapshot_write_seconds,
            directory=config.snapshot_dir,
            run_id=run_id,
            shard_of=layout.shard_of,
        )
        if snapshot.copies == 0:
            return
        self.snapshot = snapshot
        clean.on_advance = self._clean_advanced
        clean.on_pending = snapshot.sample
        snapshot.take(start)  # the starting state is trusted, as a restore's

    def _clean_advanced(self, step: int) -> None:
        # An older clean step's state is gone (the snapshot keeps the older one it has,
        # verified too).
        if self.snapshot is not None and self._held() == step:
            self.snapshot.take(step)

    def register(self, name: str, source: Any, *, idle_step: int | None) -> None:
        """See :meth:`sdc_agent.Guard.snapshot_state`. ``idle_step``: the step whose state
        the model holds between steps (``None``: a step is running)."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name: must be a non-empty string, got {name!r}")
        fn: StateSource = source.state_dict if hasattr(source, "state_dict") else source
        if not callable(fn):
            raise ConfigError(
                f"source: {name!r} needs state_dict() or to be a callable returning a dict"
            )
        snapshot = self.snapshot
        if snapshot is not None:
            snapshot.extras[name] = fn
            if snapshot.step is not None and snapshot.step == idle_step:
                snapshot.take(snapshot.step)  # the state held now, with the extra

    def before_update(self, state: StepState) -> None:
        """Before the optimizer step: a written snapshot holds every later step back."""
        if self.snapshot is not None:
            state.hold = state.hold or self.snapshot.holding
            self.snapshot.before_update()

    def to_write(self) -> int | None:
        """The step of the snapshot :meth:`write` would write now (``None``: none), told to
        the operator with the verdict so that its stop waits for it."""
        snapshot = self.snapshot
        if snapshot is None or snapshot.holding or snapshot.step is None:
            return None
        return snapshot.step

    def write(
        self, verdicts: Sequence[Verdict], *, reporter: Reporter | None, identity: Any
    ) -> SnapshotWrite | None:
        """Write the snapshot where ``verdicts`` accuse hardware persistently (``None``:
        nothing written)."""
        snapshot = self.snapshot
        if snapshot is None or snapshot.holding:
            return None
        hardware = [v for v in verdicts if v.accuses_hardware and v.transient is not True]
        if not hardware:
            return None
        suspects = {r for v in hardware for r in v.suspect_ranks}
        group_suspects = [i for i, r in enumerate(self.topology.ranks) if r.rank in suspects]
        written = snapshot.write_at_detection(group_suspects, reporter=reporter, identity=identity)
        # The job is about to stop: no further step is applied, on any rank, written or not.
        snapshot.holding = True
        return written

    def restored(self, step: int) -> None:
        """The job restored a checkpoint of ``step``: trusted, taken at once."""
        if self.snapshot is not None:
            self.snapshot.restore(step)

    def checkpoint_marked(self, path: str | Any) -> None:
        """Without ``snapshot_dir``, the snapshot is written next to the checkpoints."""
        if self.snapshot is not None and self.config.snapshot_dir is None:
            self.snapshot.directory = str(Path(path).resolve().parent)
