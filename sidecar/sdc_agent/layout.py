"""Parallelism layouts: where a guarded job's gradients, replicas and collectives are.

The checks (:mod:`sdc_agent.checks`) never look at the wrapper a job trains with; a layout
adapter tells them. It owns the hooks on the model, the gradients' arithmetic and
collectives, the step's device flags (:class:`~sdc_agent.nonfinite.StepFlags`, which ride
in the step's last gradient bucket, or right behind its last collective) and the drill's
gradient fault sites, and it calls its :class:`Coordinator` (the :class:`~sdc_agent.Guard`)
when a training forward begins and when a bucket of local gradients is ready, before its
collective.

:class:`DDPLayout` is the first adapter: one data-parallel group in which every rank is a
replica, gradients in DDP's buckets, all-reduced through DDP's communication hook.
:class:`~sdc_agent.layout_fsdp.FSDPLayout` (FSDP2, HSDP) is the second: its parameter
groups' reduce-scatter inputs as :class:`GradientBucket`, each parameter's local gradient
through ``Coordinator.local_gradient``, its own :meth:`ParallelLayout.no_sync` and flags,
for check 3 which ranks hold replicas of what (:attr:`ParallelLayout.replica_classes`),
and for the replay audit the bracket that makes its parameters whole
(:meth:`ParallelLayout.replaying`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import GuardConfig
from .errors import ConfigError
from .fault_sites import FaultSites
from .faults import FaultInjector
from .nonfinite import StepFlags
from .replay import RngState
from .verdict import Verdict

__all__ = ["Coordinator", "DDPLayout", "GradientBucket", "ParallelLayout"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class GradientBucket(Protocol):
    """Local gradients ready for their collective (DDP's ``GradBucket`` is one): a flat
    buffer and, as views of it, the gradients of its parameters."""

    def index(self) -> int: ...

    def is_last(self) -> bool: ...

    def buffer(self) -> torch.Tensor: ...

    def parameters(self) -> Sequence[torch.Tensor]: ...

    def gradients(self) -> Sequence[torch.Tensor]: ...


class Coordinator(Protocol):
    """What a layout calls back (the Guard)."""

    def forward_begins(self) -> None:
        """A training forward begins (grad mode on, not a settling pass)."""

    def gradients_ready(self, bucket: GradientBucket) -> None:
        """A bucket of local gradients, before any fault site or collective touched it."""

    def local_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """One parameter's local gradient, complete, before its collective (a sharded
        layout, whose buckets are not views of the parameters' gradients)."""


class ParallelLayout(ABC):
    """One layout's answers (see the module docstring)."""

    name: str
    model: nn.Module
    """What the job trains (the wrapper)."""
    module: nn.Module
    """The unwrapped model whose parameters the checks read."""
    group: dist.ProcessGroup | None
    """The data-parallel group: every rank of it takes part in the checks' collectives."""
    rank: int
    group_rank: int
    world_size: int
    device: torch.device
    """The model's device: where the step's flags live."""
    comm_device: torch.device
    """Where the checks' own collectives run (CUDA for NCCL, else the CPU)."""
    flags: StepFlags
    """The step's device flags, filled during backward, shared with the last collective."""
    flags_wanted: bool
    """Whether the flags travel at all (check 1 on, or the halt flag in use)."""
    faults: FaultSites
    injector: FaultInjector

    @abstractmethod
    def attach(self, coordinator: Coordinator) -> None:
        """Register the layout's hooks on the model."""

    @abstractmethod
    def detach(self) -> None:
        """Remove the hooks that can be removed."""

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Backward passes inside accumulate without a collective."""

    @abstractmethod
    def syncs_gradients(self) -> bool:
        """The next backward runs the gradient collective."""

    @abstractmethod
    def inject(self, site: str, bucket: GradientBucket, tensor: torch.Tensor) -> None:
        """The drill's faults of ``site`` into ``tensor`` (the bucket's buffer, or the
        collective's result)."""

    collective: str = "all-reduce"
    """The gradient collective, as verdicts name it."""
    replica_classes: tuple[int, ...] | None = None
    """Check 3's classes of replicas, by group rank (:mod:`sdc_agent.weights`); ``None``:
    every rank is a replica of every other."""
    shard_of: tuple[int, ...] | None = None
    """Sharded layouts: each group rank's shard coordinate (the verified snapshot keeps a
    rank's own shards); ``None``: every rank holds the whole state."""
    grads_by_hook = False
    """The replay audit's own gradients of the first micro-batch come through
    ``Coordinator.local_gradient`` (not the buckets). A later micro-batch's, in every
    layout, are read by a hook on each of the parameters autograd computes gradients for
    (the module's, or :attr:`unsharded`) before they are added to the earlier ones'."""
    unsharded: list[nn.Parameter] | None = None
    """The parameters a replay computes gradients for, where they are not the module's
    (the leaves autograd hands every backward's gradients to)."""

    def replaying(self) -> contextlib.AbstractContextManager[Any]:
        """Held around every replay of the audit (a collective where it gathers)."""
        return contextlib.nullcontext()

    def mesh_coordinates(self, rank: int) -> dict[str, int] | None:
        """``rank``'s coordinates in the data-parallel mesh (``None``: no mesh)."""
        return None

    def locate(self, verdict: Verdict) -> Verdict:
        """The suspects' mesh coordinates in the evidence (sharded layouts): rank -> mesh
        coordinates -> pod -> node, the operator reading the rest as before."""
        if self.mesh_coordinates(self.rank) is None or "mesh_coordinates" in verdict.evidence:
            return verdict
        evidence = dict(verdict.evidence)
        evidence["layout"] = self.name
        evidence["mesh_coordinates"] = {
            str(r): self.mesh_coordinates(r) for r in verdict.suspect_ranks
        }
        return dataclasses.replace(verdict, evidence=evidence)

    def settle(self, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> None:
        """Before the first step after a restore: whatever makes that step bitwise the
        step an uninterrupted run took (nothing by default)."""
        return


class DDPLayout(ParallelLayout):
    """``DistributedDataParallel``: one replica per rank, DDP's buckets, its comm hook."""

    name = "ddp"

    def __init__(self, model: nn.Module, config: GuardConfig) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"model: must be wrapped in torch.nn.parallel.DistributedDataParallel, "
                f"got {type(model).__name__}"
            )
        self.model = model
        self.module = model.module
        self.config = config
        self.group = getattr(model, "process_group", None)
        self.rank = dist.get_rank()
        self.group_rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        first = next(model.module.parameters(), None)
        # Not the current CUDA device, which is cuda:0 on every rank that never called
        # set_device.
        self.device = first.device if first is not None else torch.device("cpu")
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and self.device.type != "cuda":
            raise ConfigError(f"model: an NCCL group needs the model on CUDA, got {self.device}")
        self.comm_device = self.device if "nccl" in backend else torch.device("cpu")
        self.flags = StepFlags(self.world_size, self.group_rank, self.device)
        self.flags_wanted = config.nonfinite_check
        self.injector = FaultInjector(config.faults, self.rank)
        self.faults = FaultSites(self.injector, self.module)
        self._settling = False  # in settle: the hook only all-reduces
        self._coordinator: Coordinator | None = None
        self._forward_handle: Any = None

    def attach(self, coordinator: Coordinator) -> None:
        self.injector.attach(self.module)
        self._coordinator = coordinator
        self.model.register_comm_hook(state=None, hook=_held_weakly(self))  # type: ignore[operator]
        self._forward_handle = self.model.register_forward_pre_hook(self._forward_pre)

    def detach(self) -> None:
        # The comm hook stays with DDP (a model's hook cannot be removed); detached, it does
        # what DDP does without one. Dropping the coordinator (the Guard) ends the cycle
        # Guard -> layout -> Guard: a closed Guard its caller drops is freed at once, with
        # the model and the model's process group (see _held_weakly).
        self.injector.detach()
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        self._coordinator = None

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.model.no_sync()  # type: ignore[operator]

    def syncs_gradients(self) -> bool:
        return bool(getattr(self.model, "require_backward_grad_sync", True))

    def settle(self, batch: Any, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> None:
        """One forward and backward that is not a step, so DDP rebuilds its buckets before
        the first real step after a restore: gradients, RNG and buffers (BatchNorm
        statistics) are put back, no check runs, no step is counted.

        A fresh DDP model reduces its first step's gradients in its initial bucket layout,
        then rebuilds the buckets in the order gradients became ready. The all-reduce sums
        element by element in an order that depends on the element's place in the bucket,
        so (with more than two ranks) that first step is not bitwise the step an
        uninterrupted run took at this point."""
        rng = RngState.capture(self.device)  # the model's generator, not cuda:0's
        buffers = [b.detach().clone() for b in self.model.buffers()]
        self._settling = True
        try:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(self.model, batch).backward()
        finally:
            self._settling = False
            optimizer.zero_grad(set_to_none=True)
            rng.restore(self.device)
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers, strict=True):
                    b.copy_(saved)

    def inject(self, site: str, bucket: GradientBucket, tensor: torch.Tensor) -> None:
        """The drill's faults of ``site`` into ``tensor`` (the bucket's buffer, or the
        collective's result)."""
        _inject(self.faults, site, bucket, tensor)

    def _forward_pre(self, _module: nn.Module, _args: Any) -> None:
        if self._settling or not torch.is_grad_enabled():
            return  # evaluation forwards are not steps
        assert self._coordinator is not None
        self._coordinator.forward_begins()

    def _comm_hook(
        self, _state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self._settling or self._coordinator is None:
            # Settling, or detached: the same arithmetic, nothing observed or injected.
            return _plain_all_reduce(buffer, self.group, self.world_size)
        self._coordinator.gradients_ready(bucket)  # GradBucket is a GradientBucket
        # The same arithmetic as DDP without a hook (its reducer multiplies by 1/world
        # size), fused with check 1's look at every element: one pass over the bucket.
        self.flags.scale_and_check(buffer, self.config.nonfinite_check)
        # The step's flags ride in its last bucket (StepFlags.mark): no collective of their
        # own. A bucket that cannot carry them (not floating point) sends them behind it,
        # as does a job with check 1 off that has only the halt flag: there a training NaN
        # in the bucket's first element would read as a flag that no check judges.
        last = bucket.is_last() and self.flags_wanted
        marked = last and self.config.nonfinite_check and self.flags.mark(buffer, self.group)
        fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        if last and not marked:
            self.flags.send(self.group)

        if not self.faults and not marked:
            return fut.then(lambda f: f.value()[0])
        # The callback holds the flags and the fault sites, not this layout: gloo's worker
        # thread that runs it lets go of it only when it next gets the GIL, which can be
        # after the training loop's end (on a busy machine, after destroy_process_group()).
        # Through the layout it would hold the model and its process group until then.
        flags = self.flags if marked else None
        faults = self.faults

        def after(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()[0]
            if flags is not None:
                flags.seen(reduced)  # before a drill's fault touches it
            if faults:
                _inject(faults, "grad_reduced", bucket, reduced)
            return reduced

        return fut.then(after)


def _inject(faults: FaultSites, site: str, bucket: GradientBucket, tensor: torch.Tensor) -> None:
    faults.gradients(
        site,
        index=bucket.index(),
        buffer=bucket.buffer(),
        parameters=bucket.parameters(),
        gradients=bucket.gradients(),
        tensor=tensor,
    )


def _plain_all_reduce(
    buffer: torch.Tensor, group: dist.ProcessGroup | None, world_size: int
) -> torch.futures.Future[torch.Tensor]:
    """What DDP does with a bucket when it has no comm hook: the mean over the group."""
    buffer.mul_(1.0 / world_size)
    return (
        dist.all_reduce(buffer, group=group, async_op=True)
        .get_future()
        .then(lambda f: f.value()[0])
    )


def _held_weakly(
    layout: DDPLayout,
) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """The comm hook DDP keeps: :meth:`DDPLayout._comm_hook` through a weak reference.

    DDP holds its hook from C++, where the garbage collector cannot see it. A hook that held
    the layout would make layout -> model -> reducer -> hook -> layout a cycle nothing frees:
    the reducer, and with it the process group, would outlive ``destroy_process_group()``,
    and gloo's worker threads would still be running when the interpreter exits (where
    torch 2.13 sometimes aborts the process: "terminate called without an active
    exception"). Once the layout is gone or detached (``Guard.close``) the hook does what
    DDP does without one.
    """
    ref = weakref.ref(layout)
    group, world_size = layout.group, layout.world_size

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        alive = ref()
        if alive is not None:
            return alive._comm_hook(state, bucket)
        return _plain_all_reduce(bucket.buffer(), group, world_size)

    # DDP checks a hook's annotations by identity with the real types, and postponed
    # evaluation (``from __future__ import annotations``) left strings there.
    hook.__annotations__.update(
        bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]}
    )
    return hook
