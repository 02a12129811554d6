"""Checkpoints the operator can resume from: record them, find the right one.

Write the checkpoint as usual (``torch.save`` into a file or directory, or
``torch.distributed.checkpoint`` into a directory), named by its step (``step_1200``,
``checkpoint-1200``, ``1200.pt``, ``ckpt_00001200`` ...), then call
:func:`mark_checkpoint` with whether every check vouched for that step
(``step <= guard.last_clean_step``). It writes a small marker next to the checkpoint and,
given a reporter, tells the operator. When the operator resumes a job after an incident it
sets ``HYPERPOD_SDC_RESUME_MAX_STEP``; :func:`resume_max_step` reads it and
:func:`select_checkpoint` picks the newest verified checkpoint at or before that step.

Sharded jobs (FSDP2, HSDP): :func:`save_dcp` writes the model and optimizer as a
``torch.distributed.checkpoint`` directory (every rank writes its shards), :func:`load_dcp`
reads it back into a model sharded over any number of ranks (DCP reshards), and
:func:`state_digest` is a SHA-256 of the whole (unsharded) state, the same for the same
state whatever the sharding: what a test compares across a resume on another node count.
These import torch; the rest of this module does not.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdc_common.names import RESUME_MAX_STEP_ENV

from .errors import CheckpointNotFoundError, ConfigError
from .protocol import CheckpointReport, ReporterIdentity

if TYPE_CHECKING:
    import torch

__all__ = [
    "MARKER_SUFFIX",
    "RESUME_MAX_STEP_ENV",
    "Checkpoint",
    "find_checkpoints",
    "load_dcp",
    "mark_checkpoint",
    "resume_max_step",
    "save_dcp",
    "select_checkpoint",
    "state_digest",
]

MARKER_SUFFIX = ".sdc.json"
"""``<checkpoint>.sdc.json`` beside a checkpoint file or directory: ``{"step", "verified"}``."""

_STEP = re.compile(r"(\d+)(?!.*\d)")  # the last number in the name
_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".distcp")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: Path
    verified: bool | None
    """From the marker; ``None`` when the checkpoint has none."""
    layout: str
    """``dcp`` (a ``torch.distributed.checkpoint`` directory, it holds ``.metadata``),
    ``directory`` or ``file``."""


def resume_max_step(env: Mapping[str, str] | None = None) -> int | None:
    """The newest step the operator allows a resume from, or ``None`` (no incident)."""
    raw = (os.environ if env is None else env).get(RESUME_MAX_STEP_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        step = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{RESUME_MAX_STEP_ENV}: expected a step number, got {raw!r}") from None
    if step < 0:
        raise ConfigError(f"{RESUME_MAX_STEP_ENV}: must be >= 0, got {step}")
    return step


def mark_checkpoint(
    path: str | os.PathLike[str],
    step: int,
    *,
    verified: bool,
    reporter: object | None = None,
    identity: ReporterIdentity | None = None,
) -> Path:
    """Record that the checkpoint at ``path`` holds ``step`` and whether it was verified.

    Writes the marker atomically (a crash leaves the old marker or none). With a
    :class:`~sdc_agent.reporter.Reporter` and the reporting rank's ``identity``, also
    sends a checkpoint report. Call it on one rank, after the checkpoint is complete.
    """
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"step: must be an integer >= 0, got {step!r}")
    target = Path(path)
    if not target.exists():
        raise CheckpointNotFoundError(f"{target}: no such checkpoint to mark")
    marker = target.with_name(target.name + MARKER_SUFFIX)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "verified": verified}))
    os.replace(tmp, marker)
    if reporter is not None and identity is not None:
        reporter.submit(  # type: ignore[attr-defined]
            CheckpointReport(
                reporter=identity,
                sent_at=time.time(),
                step=step,
                location=str(target.resolve()),
                verified=verified,
            )
        )
    return marker


def _layout(path: Path) -> str | None:
    if path.is_dir():
        return "dcp" if (path / ".metadata").exists() else "directory"
    if path.is_file() and path.suffix in _SUFFIXES:
        return "file"
    return None


def find_checkpoints(root: str | os.PathLike[str]) -> list[Checkpoint]:
    """Every step-numbered checkpoint directly under ``root``, oldest first."""
    base = Path(root)
    if not base.is_dir():
        raise CheckpointNotFoundError(f"{base}: checkpoint directory does not exist")
    found = []
    for entry in base.iterdir():
        if entry.name.endswith((MARKER_SUFFIX, ".tmp")):
            continue
        layout = _layout(entry)
        stem = entry.name[: -len(entry.suffix)] if layout == "file" else entry.name
        match = _STEP.search(stem)
        if layout is None or match is None:
            continue
        step = int(match.group(1))
        verified: bool | None = None
        marker = entry.with_name(entry.name + MARKER_SUFFIX)
        if marker.is_file():
            try:
                data = json.loads(marker.read_text())
                verified = data["verified"] is True and data["step"] == step
            except (ValueError, KeyError, TypeError):
                verified = False  # a damaged marker vouches for nothing
        found.append(Checkpoint(step, entry, verified, layout))
    return sorted(found, key=lambda c: (c.step, str(c.path)))


def select_checkpoint(
    root: str | os.PathLike[str],
    max_step: int | None = None,
    *,
    require_verified: bool = True,
) -> Checkpoint:
    """The newest checkpoint at or before ``max_step`` (default: the environment's
    ``HYPERPOD_SDC_RESUME_MAX_STEP``, else no limit).

    With ``require_verified`` (the default) only checkpoints whose marker says verified
    qualify; unmarked ones do not, since nothing vouches for them. Raises
    :class:`CheckpointNotFoundError` saying what was there and why none qualified.
    """
    limit = resume_max_step() if max_step is None else max_step
    all_found = find_checkpoints(root)
    skipped_unverified = []
    for ckpt in reversed(all_found):
        if limit is not None and ckpt.step > limit:
            continue
        if require_verified and ckpt.verified is not True:
            skipped_unverified.append(ckpt.step)
            continue
        return ckpt
    where = f"at or before step {limit}" if limit is not None else "at all"
    seen = ", ".join(str(c.step) for c in all_found) or "none"
    extra = (
        f"; skipped as not verified: {', '.join(map(str, sorted(skipped_unverified)))}"
        if skipped_unverified
        else ""
    )
    raise CheckpointNotFoundError(
        f"no {'verified ' if require_verified else ''}checkpoint {where} in {root} "
        f"(steps found: {seen}{extra})"
    )


# -- sharded checkpoints (torch.distributed.checkpoint) ------------------------------------


def save_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Path:
    """Write ``model`` and ``optimizer`` as a DCP checkpoint directory at ``path``.

    Every rank calls it (a collective; each rank writes its own shards, rank 0 the
    ``.metadata`` last, so a directory without it is incomplete and never ``dcp``). Then
    mark it on one rank: ``guard.mark_checkpoint(path)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = Path(path)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(target))
    return target


def load_dcp(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Load a :func:`save_dcp` checkpoint into ``model`` and ``optimizer`` in place, on any
    number of ranks: DCP reads each rank's shards as this model is sharded now. Every rank
    calls it, before creating the Guard (then ``guard.restore(step)``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    target = Path(path)
    if _layout(target) != "dcp":
        raise CheckpointNotFoundError(f"{target}: not a complete DCP checkpoint (no .metadata)")
    # get_state_dict gives the optimizer its state first (a zero step), so every key the
    # checkpoint holds has a tensor of this sharding to be read into.
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(target))
    # (dcp.load fills the given dicts in place.)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the model's and the optimizer's whole state (parameter names, values,
    per-parameter optimizer state; not the hyperparameters), independent of how it is
    sharded. Every rank calls it (it gathers the full state: for tests and small models);
    every rank gets the same digest."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    digest = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            digest.update(str(value.dtype).encode())
            raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digest.update(bytes(raw.numpy().tobytes()))
        else:
            digest.update(repr(value).encode())

    for name in sorted(model_state):
        add(name, model_state[name])
    per_param: Any = optim_state.get("state", {})
    for name in sorted(per_param):
        for key, value in sorted(per_param[name].items()):
            add(f"{name}:{key}", value)
    out = [digest.hexdigest()]
    if dist.is_available() and dist.is_initialized():
        # cpu_offload leaves the full state on rank 0 only: its digest is the one.
        dist.broadcast_object_list(out, src=0)
    return out[0]
