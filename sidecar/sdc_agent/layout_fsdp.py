"""The FSDP2 and HSDP layout: ``fully_shard`` over a 1-D mesh (every rank holds a shard,
no shard has a replica) or a 2-D mesh ``(replicate, shard)`` (HSDP: each shard is held by
one rank of every replica group).

Where the checks see what (torch 2.13's ``torch.distributed.fsdp.fully_shard``):

- **Local gradients, before the collective.** A post-accumulate-grad hook on each of
  FSDP2's unsharded parameters sees the rank's own gradient the moment autograd
  completes it (the replay audit fingerprints the first micro-batch's there, and the
  drill's ``grad_local`` faults enter there). Under accumulation
  (``set_requires_gradient_sync(False)``) FSDP keeps adding each micro-batch's gradient
  to that one, so a later micro-batch's own gradient is read a moment earlier, by a hook
  on the same parameter that sees what its backward hands over before it is added
  (:meth:`~sdc_agent.audit.ReplayAudit.micro_batch`; it changes nothing); with a
  reduce-scatter every micro-batch FSDP empties it after each backward, and both read
  the same. Check 1 scans them in the reduce-scatter's flat input, through a
  custom reduce-scatter (:meth:`FSDPModule.set_custom_reduce_scatter`) that calls FSDP's
  own: one pass, the kernel check 1 uses for DDP, multiplying by exactly 1. A non-finite
  value there names the rank that computed it.
- **Reduced gradients, after it.** FSDP's all-reduce hook (after the HSDP all-reduce, or
  after the reduce-scatter in pure FSDP) sees this rank's reduced shard; check 1 scans it
  too (one pass over 1/shard of the gradients). A non-finite value there while every
  input was finite names the collective and the rank that received the shard: it cannot
  tell the sender's link from the receiver's memory. The step's flags travel in one small
  all-reduce behind the last group's hook: unlike DDP's (which ride in its last bucket,
  :mod:`sdc_agent.nonfinite`), each rank receives only its own shard, so a NaN put in one
  element would reach one rank, and whether another rank's shard went non-finite after
  the collective is known only to that rank.
- **Replicas.** In HSDP the ranks with the same shard coordinate hold replicas of the
  same shard: check 3 compares each shard across them (:attr:`replica_classes`). In pure
  FSDP no shard has a replica: check 3 has nothing to compare (see the update check).
- **Replays.** The audit recomputes a partner's micro-batch on FSDP2's own unsharded
  parameters: :meth:`replaying` unshards every group on every rank (FSDP's all-gathers,
  in the same order everywhere) and sets FSDP's per-module state to the one activation
  checkpointing recomputes in, where FSDP's forward hooks neither gather nor register
  backward hooks; the replay itself then runs no collective and leaves the real
  (sharded) gradients alone. Cost: during an audit every rank holds the whole model's
  parameters unsharded (one replica's worth, FSDP's own buffers, no second copy).

Refused at ``Guard`` creation, naming the dimension: a mesh that does not span every rank
(another parallelism dimension: pipeline stages, a tensor-parallel group outside the
data-parallel mesh), parameters whose ``DTensor`` mesh has dimensions besides FSDP's (a
tensor-parallel dimension), and modules with several parameter groups
(``shard_placement_fn`` with per-parameter meshes).

This reads a few private FSDP2 attributes (the param groups, their mesh, their reduce
flags and the per-module training state); a torch release that renames them gets a
clear :class:`~sdc_agent.errors.ConfigError`, not a silent gap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import GuardConfig
from .errors import ConfigError, SDCError
from .fault_sites import FaultSites
from .faults import FaultInjector, corrupt_
from .layout import Coordinator, GradientBucket, ParallelLayout
from .nonfinite import StepFlags

__all__ = ["FSDPLayout", "is_fsdp"]


def is_fsdp(model: object) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _groups_of(module: nn.Module) -> list[Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        raise ConfigError(
            f"model: this torch ({torch.__version__}) keeps FSDP2's parameter groups where "
            "sdc_agent does not look for them (FSDPState._fsdp_param_groups)"
        )
    return list(groups)


class _Bucket:
    """One parameter group's gradients at its collective, as a :class:`GradientBucket`."""

    def __init__(
        self,
        index: int,
        last: bool,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor],
        views: Sequence[torch.Tensor],
    ) -> None:
        self._index, self._last, self._buffer = index, last, buffer
        self._params, self._views = params, views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> Sequence[torch.Tensor]:
        return self._params

    def gradients(self) -> Sequence[torch.Tensor]:
        return self._views


class _GroupHooks:
    """The custom reduce-scatter and all-reduce hook of one FSDP parameter group."""

    def __init__(self, layout: FSDPLayout, index: int, group: Any) -> None:
        self.layout = layout
        self.index = index
        self.group = group
        inner = getattr(group, "_reduce_scatter_comm", None)
        if inner is None:
            raise ConfigError(
                "model: this torch keeps FSDP2's reduce-scatter where sdc_agent does not "
                "look for it (FSDPParamGroup._reduce_scatter_comm)"
            )
        self.inner: Any = inner
        self.user_hook = getattr(group, "_all_reduce_hook", None)
        self.params = [fp.sharded_param for fp in group.fsdp_params]
        self.padded = [int(fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]
        self.sizes = [int(fp.sharded_param._local_tensor.numel()) for fp in group.fsdp_params]

    # The ReduceScatter interface (torch.distributed.fsdp._fully_shard._fsdp_api).
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.layout._reduce_scatter(self, input_tensor)
        return self.inner(
            output_tensor=output_tensor,
            input_tensor=input_tensor,
            group=group,
            op=op,
            async_op=async_op,
        )

    def all_reduce_hook(self, reduced: torch.Tensor) -> None:
        self.layout._reduced(self, reduced)
        if self.user_hook is not None:
            self.user_hook(reduced)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's span of a shard-shaped flat buffer (this rank's reduced shard,
        or the first chunk of the reduce-scatter input)."""
        out, offset = [], 0
        for padded, size in zip(self.padded, self.sizes, strict=True):
            out.append(flat[offset : offset + size])
            offset += padded
        return out


class FSDPLayout(ParallelLayout):
    """``fully_shard`` (FSDP2) over one mesh dimension, or HSDP over two (see the module
    docstring)."""

    grads_by_hook = True

    def __init__(self, model: nn.Module, config: GuardConfig) -> None:
        if not is_fsdp(model):
            raise ConfigError(
                f"model: must be an FSDP2 module (fully_shard), got {type(model).__name__}"
            )
        self.model = model
        self.module = model  # FSDP2 keeps the model's own class and parameter names
        self.config = config
        self.group = None
        self.rank = dist.get_rank()
        self.group_rank = self.rank
        self.world_size = dist.get_world_size()
        fsdp_named = [(n, m) for n, m in model.named_modules() if is_fsdp(m)]
        self.fsdp_modules: list[nn.Module] = [m for _, m in fsdp_named]
        self._groups: list[tuple[nn.Module, Any]] = []
        for fqn, m in fsdp_named:
            groups = _groups_of(m)
            if len(groups) > 1:
                where = f"module {fqn!r}" if fqn else "the root module"
                raise ConfigError(
                    f"model: {where} has {len(groups)} FSDP parameter groups "
                    "(shard_placement_fn with per-parameter meshes); sdc_agent guards one "
                    "group per fully_shard call"
                )
            self._groups.extend((m, g) for g in groups)
        if not self._groups:
            raise ConfigError("model: the FSDP2 model has no parameters to guard")
        self.mesh = self._groups[0][1].mesh_info.mesh
        for _, g in self._groups:
            if g.mesh_info.mesh != self.mesh:
                raise ConfigError(
                    "model: fully_shard was given different meshes for different modules; "
                    "sdc_agent guards one data-parallel mesh"
                )
        self._refuse_other_dimensions(model)
        names = self.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(self.mesh.ndim))
        self.dim_names: tuple[str, ...] = tuple(names)
        self.hsdp = self.mesh.ndim == 2
        self.name = "hsdp" if self.hsdp else "fsdp"
        grid = self.mesh.mesh
        self.coordinates: dict[int, tuple[int, ...]] = {
            int(grid[tuple(idx)].item()): tuple(idx)
            for idx in torch.nonzero(torch.ones_like(grid)).tolist()
        }
        self.replica_classes: tuple[int, ...] = tuple(
            self.coordinates[r][-1] if self.hsdp else r for r in range(self.world_size)
        )
        """Ranks of one class hold replicas of the same shard (the shard coordinate in
        HSDP); in pure FSDP every rank is its own class."""
        self.shard_of = tuple(self.coordinates[r][-1] for r in range(self.world_size))
        self.collective = "reduce-scatter and all-reduce" if self.hsdp else "reduce-scatter"
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        backend = str(dist.get_backend())
        self.comm_device = self.device if "nccl" in backend else torch.device("cpu")
        self.flags = StepFlags(self.world_size, self.rank, self.device, after=True)
        self.flags_wanted = config.nonfinite_check
        self.injector = FaultInjector(config.faults, self.rank)
        self.faults = FaultSites(self.injector, model)
        self._coordinator: Coordinator | None = None
        self._hooks: list[_GroupHooks] = []
        self._handles: list[Any] = []
        self._forward_handle: Any = None
        self.unsharded: list[nn.Parameter] = []
        """FSDP2's unsharded parameters (its own, kept across steps), in model order."""
        self._names: dict[int, str] = {}
        self._syncs = True
        self._in_replay = False
        self._scattered = 0  # reduce-scatters of this backward
        self._reduced_count = 0
        # FSDP2's unsharded parameters exist once a group has been all-gathered and are
        # kept from then on: gather once now (a collective, like the Guard's start-up).
        self._unshard_all()
        try:
            self.unsharded = list(model.parameters())
            self._names = {id(p): n for n, p in model.named_parameters()}
        finally:
            self._reshard_all()

    def _refuse_other_dimensions(self, model: nn.Module) -> None:
        ours = set(self.mesh.mesh_dim_names or ())
        for name, p in model.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None or mesh.ndim <= self.mesh.ndim:
                continue
            other = [n for n in (mesh.mesh_dim_names or ()) if n not in ours] or [
                f"dimension {i}" for i in range(self.mesh.ndim, mesh.ndim)
            ]
            raise ConfigError(
                f"model: parameter {name!r} is also sharded over mesh dimension "
                f"{', '.join(map(repr, other))} besides FSDP's (tensor parallelism): "
                "sdc_agent cannot guard tensor- or pipeline-parallel dimensions yet"
            )
        size = self.mesh.size()
        if size != dist.get_world_size():
            # The mesh FSDP's was sliced from names the dimensions the other ranks are on
            # (torchtitan's ("pp", "dp_replicate", "dp_shard", "tp")).
            root = getattr(self.mesh, "_get_root_mesh", lambda: self.mesh)()
            other = [n for n in (root.mesh_dim_names or ()) if n not in ours]
            which = (
                f"mesh dimension {', '.join(map(repr, other))}"
                if other
                else "another parallelism dimension"
            )
            raise ConfigError(
                f"model: the FSDP mesh {tuple(self.mesh.mesh_dim_names or ())} spans {size} "
                f"of {dist.get_world_size()} ranks; the other ranks belong to {which} "
                "(pipeline stages or a tensor-parallel group), which sdc_agent cannot guard: "
                "ranks that are not replicas of each other would be compared"
            )

    # -- what the Guard asks -----------------------------------------------------------

    def mesh_coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinates in the data-parallel mesh, by dimension name."""
        return dict(zip(self.dim_names, self.coordinates[rank], strict=True))

    def attach(self, coordinator: Coordinator) -> None:
        self.injector.attach(self.model)
        self._coordinator = coordinator
        default = next((p for p in self.unsharded if p.requires_grad), None)
        self._default_grad_target = default
        for p in self.unsharded:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._local_gradient))
        for i, (_module, group) in enumerate(self._groups):
            hooks = _GroupHooks(self, i, group)
            self._hooks.append(hooks)
            group._reduce_scatter_comm = hooks
            group._all_reduce_hook = hooks.all_reduce_hook
        self._forward_handle = self.model.register_forward_pre_hook(self._forward_pre)

    def detach(self) -> None:
        self.injector.detach()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for hooks in self._hooks:
            hooks.group._reduce_scatter_comm = hooks.inner
            hooks.group._all_reduce_hook = hooks.user_hook
        self._hooks.clear()
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        self._coordinator = None  # no cycle Guard -> layout -> Guard (DDPLayout.detach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        self._syncs = False
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]
            self._syncs = True

    def syncs_gradients(self) -> bool:
        return self._syncs and all(getattr(g, "reduce_grads", True) for _, g in self._groups)

    def inject(self, site: str, bucket: GradientBucket, tensor: torch.Tensor) -> None:
        # grad_local faults enter where autograd completes a gradient (_local_gradient),
        # so that the audit's own fingerprints see them as DDP's do.
        if site == "grad_local":
            return
        self.faults.gradients(
            site,
            index=bucket.index(),
            buffer=tensor,
            parameters=bucket.parameters(),
            gradients=bucket.gradients(),
            tensor=tensor,
        )

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """FSDP2's unsharded parameters registered on the model, FSDP's forward hooks
        quiet: a recomputation makes no collective and touches no real gradient. A
        collective (the all-gathers): every rank enters at the same point."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self._unshard_all()
        states = [m._get_fsdp_state() for m in self.fsdp_modules]  # type: ignore[operator]
        saved = [s._training_state for s in states]
        try:
            now = list(self.model.parameters())
            if len(now) != len(self.unsharded) or any(
                a is not b for a, b in zip(now, self.unsharded, strict=True)
            ):
                raise SDCError(
                    "FSDP2 replaced its unsharded parameters since the Guard started "
                    "(sdc_agent fingerprints them there); create the Guard after any "
                    "change to the model's parameters"
                )
            for s in states:
                # The state activation checkpointing recomputes in: FSDP's pre-forward
                # neither gathers (every group is gathered) nor registers backward hooks.
                s._training_state = TrainingState.PRE_BACKWARD
            self._in_replay = True
            yield
        finally:
            self._in_replay = False
            for s, t in zip(states, saved, strict=True):
                s._training_state = t
            self._reshard_all()

    # -- FSDP's calls --------------------------------------------------------------------

    def _unshard_all(self) -> None:
        for m, _ in self._unique_modules():
            m.unshard()  # type: ignore[operator]

    def _reshard_all(self) -> None:
        for m, _ in self._unique_modules():
            m.reshard()  # type: ignore[operator]

    def _unique_modules(self) -> list[tuple[nn.Module, Any]]:
        seen: dict[int, tuple[nn.Module, Any]] = {}
        for m, g in self._groups:
            seen.setdefault(id(m), (m, g))
        return list(seen.values())

    def _forward_pre(self, _module: nn.Module, _args: Any) -> None:
        if self._in_replay or not torch.is_grad_enabled():
            return
        self._scattered = 0
        self._reduced_count = 0
        assert self._coordinator is not None
        self._coordinator.forward_begins()

    def _local_gradient(self, param: torch.Tensor) -> None:
        if self._in_replay or param.grad is None:
            return  # the replay's own hooks take its gradients
        grad = param.grad
        if self.injector:
            for spec in self.injector.pending("grad_local"):
                target = (
                    self._default_grad_target
                    if spec.target is None
                    else next(
                        (p for p in self.unsharded if self._names.get(id(p)) == spec.target), None
                    )
                )
                if target is param and self.injector.fire(spec):
                    corrupt_(grad, spec)
        assert self._coordinator is not None
        self._coordinator.local_gradient(param, grad)

    def _reduce_scatter(self, hooks: _GroupHooks, flat: torch.Tensor) -> None:
        index = self._scattered
        self._scattered += 1
        # The input holds one chunk per rank, each laid out as a shard: the views are each
        # parameter's span of the first chunk (its first elements).
        bucket = _Bucket(
            index, index == len(self._hooks) - 1, flat, hooks.params, hooks.views(flat)
        )
        assert self._coordinator is not None
        self._coordinator.gradients_ready(bucket)
        if self.config.nonfinite_check:
            self.flags.check(flat)

    def _reduced(self, hooks: _GroupHooks, reduced: torch.Tensor) -> None:
        index = self._reduced_count
        self._reduced_count += 1
        last = index == len(self._hooks) - 1
        if self.faults:
            flat = reduced.view(-1)
            bucket = _Bucket(index, last, flat, hooks.params, hooks.views(flat))
            self.inject("grad_reduced", bucket, flat)
        if self.config.nonfinite_check:
            self.flags.check(reduced, after=True)
        if last and self.flags_wanted:
            self.flags.send(self.group)  # rides right behind the step's last collective
