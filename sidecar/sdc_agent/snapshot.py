"""The verified snapshot: ``last_clean_step``'s state in host memory, spread over replicas.

When ``last_clean_step`` advances while the model still holds that step's state, each rank
copies its share of the state (the model's state dict, the optimizer's, and what the loop
registered with :meth:`Guard.snapshot_state`) to host memory. The copy is exactly as
trustworthy as ``last_clean_step``: every check with a say vouched for that step.

Slices. Every tensor is cut along its first dimension into ``world`` row ranges (chunk
``j`` of the ``i``-th tensor is slice ``(i + j) % world``, so small tensors spread too);
slice ``s`` is held by group rank ``s`` and by the rank at the same local index on each of
the next ``copies - 1`` nodes (the replay audit's ring). So every slice lives on
``copies`` different nodes and a rank holds about ``copies / world`` of the state.
Registered extras (step, scheduler, data position) are small and kept whole by every
rank; they must be equal on every rank of the data-parallel group.

Where CUDA is present the copies go to pinned buffers on a side stream, ordered after the
step that produced the state and before the next optimizer step on the device (no host
synchronisation). That path is not exercised by the CPU tests; on CPU the copy is a plain
``copy_`` in the loop.

Host memory. ``snapshot_memory_fraction`` of the node's available memory (``MemAvailable``
of ``/proc/meminfo``), shared by the node's ranks, may go to snapshots. A rank that cannot
fit ``copies`` slices says how many it can; the ranks agree on the smallest (one
all-reduce when the Guard is created) and warn: fewer copies (1: a slice is kept once, and
the node that kept it alone is trusted alone) or none.

At detection (a verdict that accuses hardware, not transient) every rank calls
:meth:`Snapshot.write_at_detection`: a roll call on the job's rendezvous store, bounded by
``snapshot_write_seconds``, decides who writes; each slice is written by its first holder
that answered and is not a suspect; the writers save one ``torch.distributed.checkpoint``
directory (keys ``<entry>#<slice>`` plus an index), and one of them marks it verified and
reports it. :func:`load_snapshot` reassembles it at any world size. The coordinator of the
roll call is the lowest rank that is not a suspect: if it is lost too, nothing is written
and the job falls back to its newest periodic verified checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import mark_checkpoint
from .errors import ConfigError, SDCError
from .topology import Topology

__all__ = [
    "SNAPSHOT_PREFIX",
    "Snapshot",
    "SnapshotWrite",
    "holders_of",
    "load_snapshot",
    "node_available_bytes",
]

log = logging.getLogger("sdc_agent")

SNAPSHOT_PREFIX = "sdc-snapshot-step_"
"""A snapshot of step ``k`` is written to ``<snapshot_dir>/sdc-snapshot-step_<k>``."""

_INDEX = "sdc/index"
_EXTRAS = "sdc/extras"
_OPTIM_REST = "sdc/optimizer"

StateSource = Callable[[], Mapping[str, Any]]


def holders_of(topology: Topology, copies: int) -> list[list[int]]:
    """For each slice (one per group rank), the group ranks that keep it: the rank
    itself, then the rank at the same local index on each of the next ``copies - 1``
    nodes (wrapping to the node's first rank where that node has fewer)."""
    nodes = topology.nodes
    by_node = {n: [r for r, ident in enumerate(topology.ranks) if ident.node == n] for n in nodes}
    out = []
    for s, ident in enumerate(topology.ranks):
        at = nodes.index(ident.node)
        holders = [s]
        for k in range(1, copies):
            ranks = by_node[nodes[(at + k) % len(nodes)]]
            holders.append(ranks[ident.local_rank % len(ranks)])
        out.append(holders)
    return out


def node_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or ``None`` where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rows(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    out, at = [], 0
    for j in range(parts):
        size = base + (1 if j < extra else 0)
        out.append((at, at + size))
        at += size
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotWrite:
    """What a write at detection did (every rank returns the same, bar ``wrote``)."""

    step: int
    path: str | None
    """The checkpoint directory, ``None`` when nothing was written."""
    complete: bool
    writers: tuple[int, ...]
    """Group ranks that answered the roll call and are not suspects."""
    written_by: dict[int, int]
    """Slice -> the group rank that wrote it."""
    seconds: float
    wrote: tuple[int, ...] = ()
    """The slices this rank wrote."""
    reason: str = ""
    """Why nothing was written, if it was not."""


class Snapshot:
    """The host-memory copy of ``last_clean_step``'s state (see the module docstring)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: Topology,
        group_rank: int,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        copies: int,
        memory_fraction: float,
        write_seconds: float,
        directory: str | None,
        run_id: str,
        available: int | None = None,
    ) -> None:
        if copies > topology.num_nodes:
            raise ConfigError(
                f"snapshot_copies: {copies} copies need as many nodes, the job has "
                f"{topology.num_nodes}"
            )
        self.module = module
        self.optimizer = optimizer
        self.topology = topology
        self.group_rank = group_rank
        self.group = group
        self.world = len(topology.ranks)
        self.write_seconds = write_seconds
        self.directory = directory
        self.run_id = run_id
        self.extras: dict[str, StateSource] = {}
        self.step: int | None = None
        """The step the host copy holds, ``None`` before the first."""
        self.holding = False
        """Set once a snapshot was written at detection: the loop applies nothing more."""
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._objects: dict[str, Any] = {}
        self._extras: dict[str, Any] = {}
        self._cuda = next((p.is_cuda for p in module.parameters()), False)
        self._stream: Any = torch.cuda.Stream() if self._cuda else None
        self._event: Any = None
        self.copies = self._agree_copies(copies, memory_fraction, available, comm_device)
        self.holders = holders_of(topology, self.copies) if self.copies else []
        self.held = tuple(s for s, h in enumerate(self.holders) if group_rank in h)

    # -- sizes and the fall-back -------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of the whole state (model and optimizer tensors) on one replica."""
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    def bytes_per_rank(self, copies: int | None = None) -> int:
        """Host bytes this rank keeps with ``copies`` (default: in force)."""
        copies = self.copies if copies is None else copies
        if copies == 0:
            return 0
        held = {s for s, h in enumerate(holders_of(self.topology, copies)) if self.group_rank in h}
        total = 0
        for i, (_, t) in enumerate(self._tensors()):
            rows = _rows(t.shape[0] if t.dim() else 1, self.world)
            per_row = t.numel() // max(1, t.shape[0] if t.dim() else 1)
            for j, (a, b) in enumerate(rows):
                if (i + j) % self.world in held:
                    total += (b - a) * per_row * t.element_size()
        return total

    def _agree_copies(
        self,
        wanted: int,
        fraction: float,
        available: int | None,
        comm_device: torch.device,
    ) -> int:
        if wanted == 0:
            return 0
        if available is None:
            available = node_available_bytes()
        local = self.topology.local_world_size(self.topology.node_of(self.group_rank))
        budget = None if available is None else int(available * fraction) // local
        fits = wanted
        while budget is not None and fits > 0 and self.bytes_per_rank(fits) > budget:
            fits -= 1
        agreed = torch.tensor([fits], dtype=torch.int64, device=comm_device)
        if self.group is not None or dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        result = int(agreed.item())
        if result < wanted:
            warnings.warn(
                f"snapshot_copies: host memory is short ({budget} bytes per rank for "
                f"snapshots on the tightest node, {self.bytes_per_rank(wanted)} needed for "
                f"{wanted} copies); keeping {result} cop{'y' if result == 1 else 'ies'}"
                + (" (snapshots off)" if result == 0 else ""),
                RuntimeWarning,
                stacklevel=4,
            )
        return result

    # -- the state ---------------------------------------------------------------------

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"model/{k}", v) for k, v in self.module.state_dict().items() if _is_t(v)]
        for idx, per in self.optimizer.state_dict()["state"].items():
            for k, v in per.items():
                if _is_t(v):
                    out.append((f"optim/{idx}/{k}", v))
        return out

    def _rest(self) -> dict[str, Any]:
        """What is not a tensor: the optimizer's param groups and non-tensor state, the
        model's non-tensor entries (small; kept whole)."""
        sd = self.optimizer.state_dict()
        state = {
            idx: {k: v for k, v in per.items() if not _is_t(v)} for idx, per in sd["state"].items()
        }
        model = {k: v for k, v in self.module.state_dict().items() if not _is_t(v)}
        return copy.deepcopy({"param_groups": sd["param_groups"], "state": state, "model": model})

    def take(self, step: int) -> None:
        """Copy this rank's slices of the state as it is now (``step``'s) to host memory."""
        if self.copies == 0:
            return
        held = set(self.held)
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with torch.no_grad(), ctx:
            for i, (key, t) in enumerate(self._tensors()):
                flat = t.detach().reshape(t.shape[0], -1) if t.dim() else t.detach().reshape(1, 1)
                for j, (a, b) in enumerate(_rows(flat.shape[0], self.world)):
                    s = (i + j) % self.world
                    if s not in held or a == b:
                        continue
                    part = flat[a:b]
                    buf = self._buffers.get((key, s))
                    if buf is None or buf.shape != part.shape or buf.dtype != part.dtype:
                        buf = torch.empty(
                            part.shape, dtype=part.dtype, device="cpu", pin_memory=self._cuda
                        )
                        self._buffers[(key, s)] = buf
                    buf.copy_(part, non_blocking=self._cuda)
                    if stream is not None:
                        part.record_stream(stream)
            if stream is not None:
                self._event = torch.cuda.Event()
                self._event.record(stream)
        self._objects = self._rest()
        self._extras = {name: copy.deepcopy(dict(src())) for name, src in self.extras.items()}
        self.step = step

    def before_update(self) -> None:
        """The next optimizer step must not overwrite what a copy still reads (CUDA: the
        training stream waits for the copy's event on the device; the host does not)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            self._event = None

    # -- at detection ------------------------------------------------------------------

    def write_at_detection(
        self,
        suspects: Sequence[int],
        *,
        reporter: Any = None,
        identity: Any = None,
    ) -> SnapshotWrite:
        """Write the snapshot (every rank calls it; see the module docstring)."""
        started = time.monotonic()
        step = -1 if self.step is None else self.step
        if self.copies == 0 or self.step is None:
            return SnapshotWrite(step, None, False, (), {}, 0.0, reason="no snapshot held")
        if self._event is not None:
            self._event.synchronize()
        store = dist.distributed_c10d._get_default_store()
        prefix = f"hyperpod-sdc/snapshot/{self.run_id}/{step}/"
        me = self.group_rank
        suspect = set(suspects)
        # Only the rank that marked a checkpoint may know the directory: it travels along.
        answer = {"reporter": reporter is not None, "dir": self.directory}
        store.set(f"{prefix}alive/{me}", json.dumps(answer))
        healthy = [r for r in range(self.world) if r not in suspect]
        if not healthy:
            return SnapshotWrite(step, None, False, (), {}, 0.0, reason="every rank a suspect")
        coordinator = healthy[0]
        if me == coordinator:
            plan = self._plan(store, prefix, healthy, started + self.write_seconds / 4)
            store.set(f"{prefix}plan", json.dumps(plan))
        try:
            store.wait([f"{prefix}plan"], timedelta(seconds=max(0.1, self.write_seconds / 2)))
        except RuntimeError:
            return SnapshotWrite(
                step, None, False, (), {}, time.monotonic() - started, reason="no plan in time"
            )
        plan = json.loads(store.get(f"{prefix}plan"))
        writers = tuple(plan["writers"])
        written_by = {int(k): v for k, v in plan["written_by"].items()}
        took = time.monotonic() - started
        if plan["dir"] is None:
            reason = "no snapshot_dir (and no checkpoint marked yet)"
            return SnapshotWrite(step, None, False, writers, written_by, took, reason=reason)
        path = str(Path(plan["dir"]) / f"{SNAPSHOT_PREFIX}{step}")
        if not plan["complete"]:
            reason = f"slices {plan['missing']} have no healthy holder"
            return SnapshotWrite(step, None, False, writers, written_by, took, reason=reason)
        if me not in writers:
            return SnapshotWrite(step, path, True, writers, written_by, took)
        mine = tuple(s for s, r in written_by.items() if r == me)
        group = dist.new_group(list(writers), backend="gloo", use_local_synchronization=True)
        self._save(path, set(mine), group, first=me == writers[0])
        dist.barrier(group=group)
        if me == plan["marker"]:
            mark_checkpoint(path, step, verified=True, reporter=reporter, identity=identity)
        self.holding = True
        seconds = time.monotonic() - started
        log.warning(
            "sdc_agent wrote the verified snapshot of step %d to %s in %.2f s (%d writers)",
            step,
            path,
            seconds,
            len(writers),
        )
        return SnapshotWrite(step, path, True, writers, written_by, seconds, wrote=mine)

    def _plan(self, store: Any, prefix: str, healthy: list[int], until: float) -> dict[str, Any]:
        keys = {r: f"{prefix}alive/{r}" for r in healthy}
        while True:
            answered = [r for r in healthy if store.check([keys[r]])]
            if len(answered) == len(healthy) or time.monotonic() >= until:
                break
            time.sleep(0.01)
        written_by: dict[int, int] = {}
        missing = []
        for s, holders in enumerate(self.holders):
            first = next((h for h in holders if h in answered), None)
            if first is None:
                missing.append(s)
            else:
                written_by[s] = first
        answers = {r: json.loads(store.get(keys[r])) for r in answered}
        with_reporter = [r for r in answered if answers[r]["reporter"]]
        dirs = [answers[r]["dir"] for r in answered if answers[r]["dir"]]
        return {
            "dir": dirs[0] if dirs else None,
            "writers": answered,
            "written_by": written_by,
            "complete": not missing,
            "missing": missing,
            "marker": (with_reporter or answered or [-1])[0],
        }

    def _save(self, path: str, mine: set[int], group: Any, *, first: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        state: dict[str, Any] = {
            f"{key}#{s}": buf for (key, s), buf in self._buffers.items() if s in mine
        }
        if first:
            shapes = {
                key: {"shape": list(t.shape), "dtype": str(t.dtype)} for key, t in self._tensors()
            }
            # Objects go as bytes we serialize: DCP reads them back whole (it would take
            # a dict apart, and an optimizer's state dict is one it treats specially).
            state[_INDEX] = _bytes({"step": self.step, "world": self.world, "tensors": shapes})
            state[_OPTIM_REST] = _bytes(self._objects)
            state[_EXTRAS] = _bytes(self._extras)
        Path(path).mkdir(parents=True, exist_ok=True)
        dcp.save(
            state,
            checkpoint_id=path,
            process_group=group,
            planner=DefaultSavePlanner(flatten_state_dict=False),
        )


def load_snapshot(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load a snapshot written at detection into ``module`` (the model inside DDP) and
    ``optimizer``, at any world size (every rank reads the whole state; no collective).
    Returns the step and the registered extras' state dicts, by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = FileSystemReader(str(path))
    meta = reader.read_metadata()
    state: dict[str, Any] = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[key] = None
        else:
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():
        # "torch.distributed is disabled ...": each rank reads alone, on purpose.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    state.update(planner.state_dict)  # where the objects landed
    for key in (_INDEX, _OPTIM_REST, _EXTRAS):
        raw = state.get(key)
        if isinstance(raw, io.BytesIO):
            raw.seek(0)
            state[key] = torch.load(raw, weights_only=False)  # our own, written above
    index = state.get(_INDEX)
    if not isinstance(index, dict):
        raise SDCError(f"{path}: not an sdc_agent snapshot (no {_INDEX})")
    world = int(index["world"])
    tensors: dict[str, torch.Tensor] = {}
    for i, (key, info) in enumerate(index["tensors"].items()):
        shape = info["shape"]
        n = shape[0] if shape else 1
        parts = []
        for j, (a, b) in enumerate(_rows(n, world)):
            if a == b:
                continue
            part = state.get(f"{key}#{(i + j) % world}")
            if part is None:
                raise SDCError(f"{path}: slice {(i + j) % world} of {key} is missing")
            parts.append(part)
        tensors[key] = torch.cat(parts).reshape(shape)
    rest = state[_OPTIM_REST]
    model_sd = dict(rest["model"])
    model_sd.update({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")})
    module.load_state_dict(model_sd)
    if optimizer is not None:
        opt_state: dict[Any, dict[str, Any]] = {i: dict(v) for i, v in rest["state"].items()}
        for key, v in tensors.items():
            if key.startswith("optim/"):
                _, idx, name = key.split("/", 2)
                opt_state.setdefault(int(idx), {})[name] = v
        optimizer.load_state_dict({"state": opt_state, "param_groups": rest["param_groups"]})
    return int(index["step"]), dict(state[_EXTRAS])


def _bytes(obj: object) -> io.BytesIO:
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


def _is_t(v: object) -> bool:
    return isinstance(v, torch.Tensor)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
