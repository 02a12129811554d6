"""Which rank writes a replay verdict's evidence bundle, where, and the name the verdict
carries (the bundle format and its writer are :mod:`sdc_agent.bundle`).

When the replay audit localizes a persistent fault, the micro-batch that went wrong and a
healthy result for it sit on one healthy rank: for a suspect whose own work was wrong
(the usual case: a broken GPU is wrong in its own work and in its replays), the rank
that replayed it, which holds the micro-batch, its own replay (the reference, which a
third node agreed with) and the suspect's result; for a suspect that was wrong only
as a replayer, the owner of the micro-batch it replayed, which holds that micro-batch
and its own result. That rank, the *writer*, takes the snapshot on the training thread
and hands it to a :class:`~sdc_agent.bundle.BundleWriter`; every rank computes the same
choice, so one bundle is written per verdict, not one per rank.

Every rank names the same path: ``<dir>/sdc-evidence/<run>-<step>-r<suspect rank>``, with
``<dir>`` the writer's bundle directory, else that of the lowest rank that knows one
(usually rank 0, which marks the checkpoints), so the directory must be one every node
can reach (the job's shared checkpoint volume). Two small collectives settle it, on
verdict steps only. No directory anywhere: no bundle, one WARNING, the verdict without a
name. The verdict goes out as soon as the bundle is named; the writing finishes in the
background, and a confirmation started before then waits for it (``--wait``).

Later verdicts that accuse the same rank in the same run name the bundle already written
for it: the first failing micro-batch confirms the fault as well as any later one, and a
persistent fault caught at every audit must not fill the checkpoint volume.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .bundle import (
    GRADIENTS_OF,
    REFERENCE_VERSION,
    BundleSettings,
    BundleWriter,
    EvidenceSnapshot,
    Tolerance,
    bundle_path,
    take_snapshot,
)
from .evidence import Summary, output_modules
from .fingerprint import combine_fingerprints, format_fingerprint
from .protocol import Suspect
from .replay import Payload, Recheck, ReplayFinding, judge
from .topology import Topology, all_gather_bytes

if TYPE_CHECKING:
    from torch import nn

    from .audit import AuditOutcome, ReplayAudit

__all__ = [
    "BundleSource",
    "EvidenceKeeper",
    "EvidenceWork",
    "choose_source",
    "name_replay_bundle",
    "reference_from_summary",
    "suspect_result_of",
]

log = logging.getLogger("sdc_agent")

REFERENCE_SOURCE = "replay audit"


@dataclass(frozen=True, slots=True)
class BundleSource:
    """Where a verdict's evidence is (group ranks; the same on every rank)."""

    suspect: int
    """The rank the bundle is about (its node is where the confirmation runs)."""
    writer: int
    """The healthy rank that holds the micro-batch and the reference, and writes."""
    work_of: int
    """The rank whose micro-batch it is (the suspect's, or the writer's own)."""


@dataclass(frozen=True, slots=True)
class EvidenceWork:
    """What the writer holds for the bundle (on the writer only)."""

    payload: Payload
    reference: Summary
    """The healthy result, which a third node agreed with."""
    suspect_result: Summary | None
    """What the suspect computed for the same micro-batch, where the writer has it."""


def choose_source(
    finding: ReplayFinding, rechecks: Sequence[Recheck], replayer_of: Mapping[int, int]
) -> BundleSource | None:
    """The evidence of a localized, corroborated finding with a persistent suspect: the
    lowest such suspect whose writer is not itself a suspect. ``None`` for anything else
    (transient faults, unlocalized or uncorroborated findings, not hardware)."""
    if finding.classification != "rank" or not finding.localized:
        return None
    if finding.corroborated is not True:
        return None
    suspects = set(finding.suspects)
    for recheck in sorted(rechecks, key=lambda r: r.owner):
        outcome, suspect, transient = judge(recheck)
        if suspect is None or transient is not False:
            continue
        if outcome == "owner":  # its own work was wrong: its replayer holds it
            source = BundleSource(suspect, recheck.replayer, recheck.owner)
        elif outcome == "replayer":  # its replay was wrong: the owner holds the work
            source = BundleSource(suspect, recheck.owner, recheck.owner)
        else:
            continue
        if source.writer in suspects or replayer_of.get(source.work_of) is None:
            continue
        return source
    return None


def reference_from_summary(
    summary: Summary, names: Sequence[str], outputs: Sequence[str] = (), **extra: Any
) -> dict[str, Any]:
    """The audit's summary of a computation as a bundle's reference (the layout of
    :func:`sdc_agent.bundle.reference_of`, from the fingerprints and statistics the audit
    already has: no recomputation, no copy of the gradients). A parameter without a
    gradient (fingerprint ``(0, 0)``) is ``None``, as :func:`reference_of` records it.
    ``outputs``: the output modules' names; where the summary has their statistics, they
    are added as ``output_stats`` (``{module: [sum of absolute values, sum of squares]}``,
    an optional field that readers of older bundles never needed and the confirmation
    does not compare)."""
    if len(names) != len(summary.fingerprints):
        raise ValueError(f"{len(names)} names for {len(summary.fingerprints)} fingerprints")
    rows = torch.tensor(summary.fingerprints or [(0, 0)], dtype=torch.int64).reshape(-1, 2)
    combined = combine_fingerprints(rows[: len(names)]) if names else torch.zeros(2)
    missing = [
        fp == (0, 0) and st == (0.0, 0.0)
        for fp, st in zip(summary.fingerprints, summary.stats, strict=True)
    ]
    out: dict[str, Any] = {
        "version": REFERENCE_VERSION,
        "gradients_of": GRADIENTS_OF,
        "loss_bits": summary.loss_bits,
        "loss": summary.loss,
        "gradient_fingerprint": format_fingerprint(combined.to(torch.int64)),
        "per_parameter": {
            n: None if gone else format_fingerprint(fp)
            for n, fp, gone in zip(names, summary.fingerprints, missing, strict=True)
        },
        "gradient_norms": {
            n: None if gone else float(max(st[1], 0.0) ** 0.5)
            for n, st, gone in zip(names, summary.stats, missing, strict=True)
        },
        "gradient_stats": {
            n: None if gone else [st[0], st[1]]
            for n, st, gone in zip(names, summary.stats, missing, strict=True)
        },
        "source": REFERENCE_SOURCE,
    }
    if outputs and len(outputs) == len(summary.outputs):
        pairs = zip(outputs, summary.outputs, strict=True)
        out["output_stats"] = {n: [a, b] for n, (a, b) in pairs}
    out.update(extra)
    return out


def suspect_result_of(summary: Summary, names: Sequence[str]) -> dict[str, Any]:
    """What the suspect computed, as the confirmation compares it (loss bits and the
    combined gradient fingerprint, so a recomputation that gives the suspect's own
    wrong result back is recognised)."""
    ref = reference_from_summary(summary, names)
    return {k: ref[k] for k in ("loss_bits", "loss", "gradient_fingerprint", "per_parameter")}


class EvidenceKeeper:
    """The Guard's side of evidence bundles: the directory it knows, the writer thread,
    and the bundles already named in this run (one per accused rank)."""

    def __init__(
        self,
        settings: BundleSettings,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        me: int,
    ) -> None:
        self.settings = settings
        self.group = group
        self.comm_device = comm_device
        self.me = me
        self.checkpoint_dir: str | None = None
        """The directory of the last checkpoint this rank marked."""
        self.named: dict[int, str] = {}
        """Suspect group rank -> the bundle named for it in this run."""
        self._writer: BundleWriter | None = None
        self._warned = False

    @property
    def directory(self) -> str | None:
        """Where this rank would put bundles: ``bundle_dir``, else the checkpoints' dir
        (absolute: the verdict names the path for another process on another node)."""
        if self.settings.bundle_dir:
            return os.path.abspath(self.settings.bundle_dir)
        return self.checkpoint_dir

    def note_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self.checkpoint_dir = str(Path(path).resolve().parent)

    @property
    def writer(self) -> BundleWriter:
        if self._writer is None:
            self._writer = BundleWriter()
        return self._writer

    def name_bundle(
        self,
        source: BundleSource,
        work: EvidenceWork | None,
        *,
        path_of: Callable[[str], Path],
        snapshot: Callable[[EvidenceWork], EvidenceSnapshot],
    ) -> str | None:
        """The bundle for ``source``'s verdict: named on every rank alike (a collective,
        except for a suspect already named), written by the writer in the background.
        ``path_of(directory)`` gives the bundle's path; ``snapshot(work)`` takes the
        writer's snapshot (on the training thread)."""
        if source.suspect in self.named:
            return self.named[source.suspect]
        writing = self.me == source.writer
        # Round one: every rank's directory, and whether the writer can take one now.
        mine = {
            "dir": self.directory,
            "room": writing and work is not None and self.writer.has_room(),
        }
        views = [
            json.loads(raw)
            for raw in all_gather_bytes(json.dumps(mine).encode(), self.group, self.comm_device)
        ]
        writer_view = views[source.writer]
        directory = writer_view["dir"] or next((v["dir"] for v in views if v["dir"]), None)
        if directory is None:
            if writing and not self._warned:
                self._warned = True
                log.warning(
                    "sdc_agent: no evidence bundle for the verdict: no rank knows a directory "
                    "for it; set bundle_dir (env %s) or call guard.mark_checkpoint(path)",
                    "HYPERPOD_SDC_BUNDLE_DIR",
                )
            return None
        if not writer_view["room"]:
            if writing:
                log.warning(
                    "sdc_agent: no evidence bundle for the verdict: the writer is still busy "
                    "with earlier ones"
                )
            return None
        # Round two: the writer's snapshot taken (or not).
        taken: EvidenceSnapshot | None = None
        if writing:
            assert work is not None
            try:
                taken = snapshot(work)
            except Exception as exc:  # user code (deepcopy, pickling): anything can fail
                log.warning("sdc_agent: no evidence bundle (%s: %s)", type(exc).__name__, exc)
        ok = torch.tensor([1 if (taken is not None or not writing) else 0], device=self.comm_device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not int(ok.item()):
            return None
        path = path_of(directory)
        if taken is not None:
            queued = self.writer.submit(taken, directory)
            if queued != path:  # never raise on the training thread; every rank names it
                log.warning(
                    "sdc_agent: the evidence bundle %s could not be queued for writing (%s); "
                    "the verdict names it, and its confirmation will say it is missing",
                    path,
                    queued,
                )
        self.named[source.suspect] = str(path)
        return str(path)

    def close(self, timeout: float) -> None:
        """Finish a bundle still being written (up to ``timeout`` seconds)."""
        if self._writer is not None:
            self._writer.close(timeout)


def name_replay_bundle(
    keeper: EvidenceKeeper,
    outcome: AuditOutcome,
    *,
    audit: ReplayAudit,
    topology: Topology,
    module: nn.Module,
    step: int,
    run_id: str,
    loss_scale: Callable[[], float | None],
) -> str | None:
    """The evidence bundle of a localized, persistent replay verdict: named alike on every
    rank, written by the one healthy rank that holds the micro-batch and its reference
    (see the module docstring). A collective. ``module`` is the unwrapped model;
    ``loss_scale`` gives the GradScaler's scale (read only where a bundle is taken)."""
    source = outcome.source
    assert source is not None
    ranks = topology.ranks
    s = ranks[source.suspect]
    suspect = Suspect(
        rank=s.rank, node=s.node, local_rank=s.local_rank, pod=s.pod, gpu_uuid=s.gpu_uuid
    )
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    writer = ranks[source.writer]

    def snapshot(work: EvidenceWork) -> EvidenceSnapshot:
        # What the confirmation compares with: gradients within the learned noise; the
        # loss bit for bit (a finding within the loss's own learned noise, rounding
        # level, is never corroborated, so its node is never quarantined and confirmed).
        learned = audit.noise.tolerance((source.suspect, source.writer))
        role = "replayer" if source.work_of != source.writer else "owner"
        return take_snapshot(
            module=module,
            payload=work.payload,
            reference=reference_from_summary(
                work.reference,
                names,
                [n for n, _ in output_modules(module)],
                computed_by=writer.rank,
                node=writer.node,
            ),
            suspect=suspect,
            step=step,
            run_id=run_id,
            tolerance=Tolerance(
                bit_reproducible=learned.loss == 0 and learned.gradients == 0,
                gradient_tolerance=learned.gradients,
            ),
            loss_fn=audit.loss_fn,
            settings=keeper.settings,
            work_of=ranks[source.work_of].rank,
            recorded_by={
                "rank": writer.rank,
                "node": writer.node,
                "pod": writer.pod,
                "local_rank": writer.local_rank,
                "role": role,
            },
            suspect_result=None
            if work.suspect_result is None
            else suspect_result_of(work.suspect_result, names),
            loss_scale=loss_scale(),
            evidence=outcome.evidence,
        )

    return keeper.name_bundle(
        source,
        outcome.work,
        path_of=lambda directory: bundle_path(directory, run_id, step, suspect.rank),
        snapshot=snapshot,
    )
