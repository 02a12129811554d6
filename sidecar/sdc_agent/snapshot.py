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
rank; they must be equal on every rank of the data-parallel group. They, and the
optimizer's param groups, are read as the snapshot's step returns: where the tensors are
copied later (on CUDA, during the next step's checks), :meth:`Snapshot.sample` read them
then.

Sharded layouts (FSDP2, HSDP: ``shard_of`` given). The state is already sharded: a slice is
a shard coordinate, and a rank keeps its own local shards (``DTensor.to_local()``; tensors
that are not ``DTensor``, such as Adam's ``step``, are small and kept whole). Under HSDP the
ranks of every replica group with the same shard coordinate hold the same shard, so with
one replica group per node every slice already lives on ``replicate`` nodes and costs
nothing more than the rank's own shards; the suspect's shards are written by a healthy
replica. Under pure FSDP no shard has a replica: with ``copies`` 2 each rank also sends its
shards to the rank at the same local index on the next node (the same ring as above), over
a gloo group of the snapshot's own, each time the snapshot is taken. That second copy
crosses the network at every take: its cost is given apart (docs/agent.md).

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

The write uses no process group: the writers answered a roll call, so a group of them
would have to be made by them alone (``new_group(..., use_local_synchronization=True)``),
which torch names from how many groups each member has made, a count the first write
leaves unequal (the next write's group then never forms), and whose collectives wait for a
writer lost mid-write until the group's timeout, far past a pod's grace period. Instead
each writer saves its slices alone (``dcp.save(no_dist=True)``, files named by its rank),
hands its part of the checkpoint's metadata over the store, and the last to finish writes
the directory's ``.metadata`` from all parts: the directory is one DCP checkpoint, complete
only once every writer's files are there, and the others wait for it on the store up to
the deadline. The store's keys carry the run, the snapshot's generation (one more at each
restore) and its step, so a later write in the same processes never meets an earlier one's.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import io
import json
import logging
import math
import os
import pickle
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
        shard_of: Sequence[int] | None = None,
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
        self.generation = 0
        """Restores so far: a write's keys on the store carry it (every rank restores)."""
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._objects: dict[str, Any] = {}
        self._extras: dict[str, Any] = {}
        self._sampled: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        """Step -> what :meth:`sample` read when that step returned, for a later take."""
        self._cuda = next((p.is_cuda for p in module.parameters()), False)
        self._stream: Any = torch.cuda.Stream() if self._cuda else None
        self._event: Any = None
        self.shard_of: tuple[int, ...] | None = None if shard_of is None else tuple(shard_of)
        """Sharded layouts: each group rank's shard coordinate (a slice per coordinate)."""
        self.slices = self.world
        """How many slices the state is cut into (the world, or the shard coordinates)."""
        self.replicated = False
        """HSDP: other ranks hold the same shards (no copy crosses the network)."""
        self._exchange_group: Any = None
        self.exchange_seconds = 0.0
        """Pure FSDP: seconds spent sending and receiving second copies, all takes."""
        if self.shard_of is not None:
            self._check_sharded(copies)
        self.copies = self._agree_copies(copies, memory_fraction, available, comm_device)
        self.holders = self._holders(self.copies) if self.copies else []
        self.held = tuple(s for s, h in enumerate(self.holders) if group_rank in h)
        if self.shard_of is not None and not self.replicated and self.copies > 1:
            # Its own group: the exchange never interleaves with the job's collectives.
            self._exchange_group = dist.new_group(backend="gloo")

    # -- sizes and the fall-back -------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of the whole state (model and optimizer tensors) on one replica."""
        return sum(t.numel() * t.element_size() for _, t in self._tensors())

    def bytes_per_rank(self, copies: int | None = None) -> int:
        """Host bytes this rank keeps with ``copies`` (default: in force)."""
        copies = self.copies if copies is None else copies
        if copies == 0:
            return 0
        held = {s for s, h in enumerate(self._holders(copies)) if self.group_rank in h}
        total = 0
        if self.shard_of is not None:
            for _, t in self._tensors():
                per_row = t.numel() // max(1, t.shape[0])
                for s in held:
                    a, b = _chunks(t.shape[0], self.slices)[s]
                    total += (b - a) * per_row * t.element_size()
            return total
        for i, (_, t) in enumerate(self._tensors()):
            rows = _rows(t.shape[0] if t.dim() else 1, self.world)
            per_row = t.numel() // max(1, t.shape[0] if t.dim() else 1)
            for j, (a, b) in enumerate(rows):
                if (i + j) % self.world in held:
                    total += (b - a) * per_row * t.element_size()
        return total

    def _holders(self, copies: int) -> list[list[int]]:
        """For each slice, the group ranks that keep it, the first holder first."""
        if self.shard_of is None:
            return holders_of(self.topology, copies)
        if self.replicated:  # every replica keeps its shard anyway
            return [
                [r for r in range(self.world) if self.shard_of[r] == s] for s in range(self.slices)
            ]
        ring = holders_of(self.topology, copies)
        out: list[list[int]] = [[] for _ in range(self.slices)]
        for r, s in enumerate(self.shard_of):
            out[s] = ring[r]
        return out

    def _check_sharded(self, copies: int) -> None:
        """Sharded layouts: every ``DTensor`` of the state sharded along dimension 0 (as
        ``fully_shard`` does by default), replicated over any other mesh dimension."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        assert self.shard_of is not None
        self.slices = max(self.shard_of) + 1
        self.replicated = self.slices < self.world
        for key, t in self._tensors():
            if not isinstance(t, DTensor):
                continue
            *others, last = t.placements
            if t.dim() == 0 or last != Shard(0) or any(p != Replicate() for p in others):
                raise ConfigError(
                    f"snapshot_copies: {key} is placed {tuple(t.placements)} on its mesh; "
                    "snapshots of sharded layouts need every parameter sharded along its "
                    "first dimension (fully_shard's default, no shard_placement_fn)"
                )
        if self.replicated:
            nodes = min(
                len({self.topology.node_of(r) for r in range(self.world) if self.shard_of[r] == s})
                for s in range(self.slices)
            )
            if 0 < nodes < copies:
                warnings.warn(
                    f"snapshot_copies: {copies} copies wanted, but the replicas of a shard "
                    f"are on {nodes} node{'s' if nodes > 1 else ''} only: each slice is kept "
                    f"on {nodes}",
                    RuntimeWarning,
                    stacklevel=4,
                )

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

    def _sliced(self, v: object) -> bool:
        """Whether ``v`` is cut into slices (a tensor; in a sharded layout, a DTensor)."""
        if self.shard_of is None:
            return _is_t(v)
        from torch.distributed.tensor import DTensor

        return isinstance(v, DTensor)

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [(f"model/{k}", v) for k, v in self.module.state_dict().items() if self._sliced(v)]
        for idx, per in self.optimizer.state_dict()["state"].items():
            for k, v in per.items():
                if self._sliced(v):
                    out.append((f"optim/{idx}/{k}", v))
        return out

    def _rest(self) -> dict[str, Any]:
        """What is not sliced: the optimizer's param groups and other state, the model's
        other entries (small; kept whole)."""
        sd = self.optimizer.state_dict()
        state = {
            idx: {k: v for k, v in per.items() if not self._sliced(v)}
            for idx, per in sd["state"].items()
        }
        model = {k: v for k, v in self.module.state_dict().items() if not self._sliced(v)}
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
            tensors = self._tensors()
            for i, (key, t) in enumerate(tensors):
                if self.shard_of is not None:
                    self._take_shard(key, t)
                    continue
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
        if self._exchange_group is not None:
            self._exchange(tensors)
        sampled = self._sampled.pop(step) if step in self._sampled else self._read_objects()
        self._objects, self._extras = sampled
        self._sampled = {k: v for k, v in self._sampled.items() if k > step}
        self.step = step

    def _read_objects(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The optimizer's param groups and other small state, and the registered extras,
        as they are now (copies)."""
        extras = {name: copy.deepcopy(dict(src())) for name, src in self.extras.items()}
        return self._rest(), extras

    def sample(self, step: int) -> None:
        """``step`` is returning and may become the snapshot later, after the loop's own
        code ran (on CUDA: once its flags or check 3's exchange come back during the next
        step): read its objects and extras now, so that every snapshot holds them as its
        step returned, whichever path took it."""
        if self.copies:
            self._sampled[step] = self._read_objects()

    def restore(self, step: int) -> None:
        """Every rank reloaded ``step``'s state (``Guard.restore``): keep it, hold nothing,
        and start a new generation (a later write's keys differ from an earlier one's)."""
        self.holding = False
        self.generation += 1
        self._sampled.clear()
        self.take(step)

    def _take_shard(self, key: str, t: torch.Tensor) -> None:
        assert self.shard_of is not None
        s = self.shard_of[self.group_rank]
        a, b = _chunks(t.shape[0], self.slices)[s]
        local = t.to_local().detach()  # type: ignore[attr-defined]
        if local.shape[0] != b - a:
            raise SDCError(
                f"snapshot: {key}'s local shard has {local.shape[0]} rows, sdc_agent expected "
                f"{b - a} (slice {s} of {self.slices} of {t.shape[0]}): this torch shards "
                "differently"
            )
        if a == b:
            return
        self._copy_into((key, s), local)

    def _copy_into(self, at: tuple[str, int], part: torch.Tensor) -> None:
        buf = self._buffers.get(at)
        if buf is None or buf.shape != part.shape or buf.dtype != part.dtype:
            buf = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=self._cuda)
            self._buffers[at] = buf
        buf.copy_(part, non_blocking=self._cuda)
        if self._stream is not None:
            part.record_stream(self._stream)

    def _exchange(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Pure FSDP: send this rank's shards (from host memory) to the other holders of
        its slice, and receive those of the slices it holds for others."""
        assert self.shard_of is not None
        started = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()  # the host copies are what is sent
        mine = self.shard_of[self.group_rank]
        ops = []
        received: list[tuple[int, torch.Tensor]] = []
        for s, holders in enumerate(self.holders):
            if s == mine:
                payload = self._pack(s, tensors)
                for h in holders[1:]:
                    ops.append(
                        dist.P2POp(dist.isend, payload, self._global(h), self._exchange_group)
                    )
            elif self.group_rank in holders[1:]:
                buf = torch.empty(self._packed_size(s, tensors), dtype=torch.uint8)
                ops.append(
                    dist.P2POp(dist.irecv, buf, self._global(holders[0]), self._exchange_group)
                )
                received.append((s, buf))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for s, buf in received:
            self._unpack(s, buf, tensors)
        self.exchange_seconds += time.perf_counter() - started

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _slice_shape(self, t: torch.Tensor, s: int) -> tuple[int, ...]:
        a, b = _chunks(t.shape[0], self.slices)[s]
        return (b - a, *t.shape[1:])

    def _packed_size(self, s: int, tensors: list[tuple[str, torch.Tensor]]) -> int:
        return sum(math.prod(self._slice_shape(t, s)) * t.element_size() for _, t in tensors)

    def _pack(self, s: int, tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        parts = [
            self._buffers[(key, s)].reshape(-1).view(torch.uint8)
            for key, _ in tensors
            if (key, s) in self._buffers
        ]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def _unpack(self, s: int, flat: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> None:
        at = 0
        for key, t in tensors:
            shape = self._slice_shape(t, s)
            size = math.prod(shape) * t.element_size()
            if size == 0:
                continue
            part = flat[at : at + size].view(t.dtype).reshape(shape)
            at += size
            self._copy_into((key, s), part)

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
        prefix = f"hyperpod-sdc/snapshot/{self.run_id}/{self.generation}/{step}/"
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
            if plan["dir"] is not None:
                # An earlier write of this step (before an in-process restore): the
                # directory reads as incomplete until this write's .metadata replaces it.
                (Path(plan["dir"]) / f"{SNAPSHOT_PREFIX}{step}" / ".metadata").unlink(
                    missing_ok=True
                )
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
        part = self._save(path, set(mine), me, first=me == writers[0])
        store.set(f"{prefix}part/{me}", base64.b64encode(pickle.dumps(part)).decode())
        if store.add(f"{prefix}saved", 1) == len(writers):  # the last writer to finish
            parts = [
                pickle.loads(base64.b64decode(store.get(f"{prefix}part/{w}"))) for w in writers
            ]
            _merge_parts(path, parts)
            store.set(f"{prefix}complete", "1")
        try:
            left = started + self.write_seconds - time.monotonic()
            store.wait([f"{prefix}complete"], timedelta(seconds=max(0.1, left)))
        except RuntimeError:
            took = time.monotonic() - started
            reason = "not every writer finished within snapshot_write_seconds"
            return SnapshotWrite(
                step, None, False, writers, written_by, took, wrote=mine, reason=reason
            )
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

    def _save(self, path: str, mine: set[int], me: int, *, first: bool) -> Any:
        """Save this writer's slices (and, the first writer, the index and the objects)
        alone; returns its part of the checkpoint's metadata (see :func:`_merge_parts`)."""
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
            index = {"step": self.step, "world": self.world, "tensors": shapes}
            if self.shard_of is not None:
                index |= {"sharded": True, "slices": self.slices}
            state[_INDEX] = _bytes(index)
            state[_OPTIM_REST] = _bytes(self._objects)
            state[_EXTRAS] = _bytes(self._extras)
        Path(path).mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # "torch.distributed is disabled ...": each writer saves alone, on purpose.
            warnings.simplefilter("ignore", UserWarning)
            return dcp.save(
                state,
                storage_writer=_writer_part(path, me),
                planner=DefaultSavePlanner(flatten_state_dict=False),
                no_dist=True,
            )


def _writer_part(path: str, rank: int) -> Any:
    """One writer's share of a snapshot's DCP directory: its files named by its group rank
    (``__<rank>_0.distcp``), its metadata returned by ``dcp.save`` with the storage
    locations filled in and not written (the last writer writes ``.metadata`` for all)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class WriterPart(FileSystemWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return [
                dataclasses.replace(
                    plan, storage_data=dataclasses.replace(plan.storage_data, prefix=f"__{rank}_")
                )
                for plan in super().prepare_global_plan(plans)
            ]

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}

    return WriterPart(path)


def _merge_parts(path: str, parts: Sequence[Any]) -> None:
    """Write ``path/.metadata`` from every writer's part: the directory becomes one DCP
    checkpoint (``FileSystemWriter.finish`` writes it atomically, through a rename)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

    merged = Metadata(
        state_dict_metadata={k: v for part in parts for k, v in part.state_dict_metadata.items()}
    )
    results = [
        [
            WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
            for index, info in part.storage_data.items()
        ]
        for part in parts
    ]
    FileSystemWriter(path).finish(merged, results)


def load_snapshot(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load a snapshot written at detection into ``module`` (the model inside DDP, or the
    FSDP2 model) and ``optimizer``, at any world size and either layout (every rank reads
    the whole state and keeps its own shards of it; no collective). Returns the step and the
    registered extras' state dicts, by name."""
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
    sharded = bool(index.get("sharded"))
    slices = int(index["slices"]) if sharded else world
    tensors: dict[str, torch.Tensor] = {}
    for i, (key, info) in enumerate(index["tensors"].items()):
        shape = info["shape"]
        n = shape[0] if shape else 1
        parts = []
        cuts = _chunks(n, slices) if sharded else _rows(n, world)
        for j, (a, b) in enumerate(cuts):
            if a == b:
                continue
            s = j if sharded else (i + j) % world
            part = state.get(f"{key}#{s}")
            if part is None:
                raise SDCError(f"{path}: slice {s} of {key} is missing")
            parts.append(part)
        tensors[key] = torch.cat(parts).reshape(shape)
    rest = state[_OPTIM_REST]
    model_sd = dict(rest["model"])
    model_sd.update({k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")})
    module.load_state_dict(_placed_like(model_sd, module.state_dict()))
    if optimizer is not None:
        opt_state: dict[Any, dict[str, Any]] = {i: dict(v) for i, v in rest["state"].items()}
        for key, v in tensors.items():
            if key.startswith("optim/"):
                _, idx, name = key.split("/", 2)
                opt_state.setdefault(int(idx), {})[name] = v
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for idx, per in opt_state.items():
            like = params[int(idx)] if int(idx) < len(params) else None
            opt_state[idx] = {
                k: _placed_like({k: v}, {k: like})[k] if _is_t(v) else v for k, v in per.items()
            }
        optimizer.load_state_dict({"state": opt_state, "param_groups": rest["param_groups"]})
    return int(index["step"]), dict(state[_EXTRAS])


def _placed_like(full: dict[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """Each whole tensor of ``full`` as this rank's shards where ``target`` has a
    ``DTensor`` of its shape there (an FSDP2 model, sharded over however many ranks now):
    each rank keeps its own part, no collective."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = dict(full)
    for key, value in full.items():
        like = target.get(key)
        if isinstance(like, DTensor) and _is_t(value) and tuple(value.shape) == tuple(like.shape):
            out[key] = distribute_tensor(
                value.to(like.device_mesh.device_type),
                like.device_mesh,
                like.placements,
                src_data_rank=None,
            )
    return out


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s row ranges (FSDP2's and DTensor's ``Shard(0)``): ``ceil(n / parts)``
    rows each, the last ones shorter or empty."""
    size = -(-n // parts) if parts else 0
    return [(min(n, j * size), min(n, (j + 1) * size)) for j in range(parts)]


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
