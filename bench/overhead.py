"""Per-step cost of the Guard against plain DDP, measured side by side.

Prints JSON. By default two gloo ranks on CPU (one thread each) train two models, once
per variant: the ~10 M-parameter MLP and a small GPT-2 (``transformers``, random weights
from a ``GPT2Config``, nothing downloaded), both with fused Adam. The variants of a model
take turns one step at a time, so machine noise hits them alike, and each variant's
periodic checks are amortized over its own steps. ``overhead`` = mean guarded step time /
mean plain step time - 1 (``median_overhead`` the same with medians).

What bounds the goals on a CPU: DDP with a communication hook must scale every bucket by
1/world size in the hook (without one, DDP fuses it into its copy into the bucket). That
is one pass over gradient memory; ``bound`` reports its time (``mul_`` over a tensor the
size of the gradients, measured in the same process) next to the plain step's.

What sets the floor, side by side in the same run (:data:`FLOOR`): ``plain_hook`` is plain
DDP with the least a correct Python comm hook does (``mul_`` by 1/world size, all-reduce),
``plain_hook_check`` the same with check 1's kernel doing the scaling; ``floor`` gives each
over plain DDP (``any_comm_hook``, ``hook_and_check_pass``) and the Guard's ``hook_only`` and
``nonfinite_only`` over them (what is the Guard's own beyond that arithmetic), and ``bound``
the two kernels timed alone over a tensor the size of the gradients, with their share of
the plain step (``mul_share_of_plain_step``, ``scale_and_check_share_of_plain_step``).
For check 3 (DDP on CPU), ``bound`` also times one read of the parameters and Adam's two
moments right after a fused Adam update, where check 3 reads them, against check 3's
fingerprints of the same tensors there (:func:`after_update_ms`).

``defaults_parts``: the defaults' overhead as the sum of their three checks', each measured
alone in the same run, next to each part's floor (:func:`defaults_parts`): what the
machine and the audit's design set, against the goal for the defaults.

``defaults_snapshots``: the defaults with the verified snapshot on (``snapshot_copies=2``:
each time ``last_clean_step`` advances, once per audit interval at the defaults, each rank
copies its slices of the state to host memory); ``snapshot_extra`` is its step time against
``defaults``' in the same run (the goal: under 0.5 % on CPU), and ``snapshot_memory`` the host
memory each rank keeps for it (``Snapshot.bytes_per_rank`` after the first step, Adam's
moments included) against one replica's state (DDP; with ``--layout fsdp`` or ``hsdp`` only
the step times: ``bench/snapshot.py --layout fsdp`` gives the memory there).

``audits`` (in each variant whose timed steps held a replay audit): each audit's cost in
plain steps, its step against the variant's own steps without one, the process's first
apart (:func:`audit_costs`). ``replay_every_50_only``'s mean over 50 steps holds one audit,
the first of its process, which pays what later ones do not; ``steady_overhead`` (the later
audits' median over ``replay_every``) needs more steps (``--steps 200``: four audits), and
``bench/audit_cost.py`` gives many audits per run.

``audit_memory``: the replay audit's extra peak memory against the model's gradient bytes:
resident memory sampled every 0.2 ms during an audited step and during the step before it
(CPU), or ``torch.cuda.max_memory_allocated`` (CUDA).

    .venv/bin/python bench/overhead.py [--steps 200] [--warmup 5] [--models mlp,gpt2]

For a given commit (its agent and this bench; the floor variants need no agent), in a
detached worktree, on a quiet machine, under the CPU lock::

    git -C /work/main worktree add --detach /tmp/ov-$SHA $SHA
    cd /tmp/ov-$SHA && PYTHONPATH=$PWD/sidecar:$PWD/common flock /tmp/cpu.lock \
        /work/main/.venv/bin/python bench/overhead.py --steps 60 > /tmp/overhead-$SHA.json

(An older commit's bench lacks the floor variants: run this commit's ``bench/overhead.py``
with ``PYTHONPATH`` at the older tree's ``sidecar`` and ``common`` to time its agent.)

``--layout fsdp`` or ``--layout hsdp`` measures the same models sharded with FSDP2
(``fully_shard`` on each Linear of the MLP, then the root) on four gloo ranks on CPU: ``fsdp`` over
one mesh dimension of 4 (4 emulated nodes of one rank, so the update check's ring covers
every rank), ``hsdp`` over ``(replicate 2, shard 2)`` (2 emulated nodes of 2 ranks), every
variant against plain FSDP2 in one run, as for DDP; the GPT-2 is sharded per transformer
block, then the root (its tied embedding and LM head in the root's group), as torchtitan
shards. It departs from the DDP run in: four ranks, not two; Adam without ``fused`` (as
FSDP2 jobs on CPU use it); no ``audit_memory`` (the replay there reuses FSDP2's own
unsharded parameters); and ``bound`` is one pass over the whole model's gradients (what
check 1 before the reduce-scatter scans), against a step that also reduce-scatters and
all-gathers.

``--device cuda`` runs one NCCL rank (world size 1) in this process on ``cuda:0`` (NCCL
refuses two ranks on one GPU, so this measures the checks' own GPU cost, not the
all-reduce; the replay audit needs other nodes and does not run). Every timed step then
ends with ``torch.cuda.synchronize()``, for every variant alike. ``--bf16`` runs the
transformer under bf16 autocast; make its step long enough to time (at least 50 ms)::

    python3 bench/overhead.py --device cuda --models gpt2 --bf16 --gpt2-layers 12 \\
        --gpt2-width 1024 --batch 16 --seq 1024
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent import Guard, GuardConfig
from sdc_agent.fingerprint import Fingerprinter
from sdc_agent.launch import free_port, spawn_local

OFF = {"nonfinite_check": False, "weights_every": 0, "replay_every": 0}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "hook_only": OFF,
    "nonfinite_only": {**OFF, "nonfinite_check": True},
    "weights_every_10_only": {**OFF, "weights_every": 10},
    "weights_every_1_only": {**OFF, "weights_every": 1},
    "replay_every_50_only": {**OFF, "replay_every": 50},
    "defaults": {},
    "defaults_snapshots": {"snapshot_copies": 2},
    "every_step": {"weights_every": 1, "replay_every": 1},
    # The floor: plain DDP, no Guard, with a minimal Python comm hook (see FLOOR).
    "plain_hook": None,
    "plain_hook_check": None,
}
FLOOR = {"plain_hook": False, "plain_hook_check": True}
"""Plain DDP with a minimal Python comm hook: scale the bucket by 1/world size (DDP's
arithmetic, which a hook must do itself), all-reduce it. ``plain_hook``: with ``mul_``,
the cost of having any comm hook; ``plain_hook_check``: with check 1's kernel (scale and
flag a non-finite element in one pass), the cost of that pass, with nothing of the Guard
around it."""
DEFAULT_VARIANTS = (
    "plain",
    "plain_hook",
    "plain_hook_check",
    "hook_only",
    "nonfinite_only",
    "weights_every_1_only",
    "replay_every_50_only",
    "defaults",
    "defaults_snapshots",
)
IN = 1024
"""Input and output width of the MLP."""


def make_model(hidden: int = 2048) -> nn.Module:
    # 1024-hidden-hidden-1024-1024; the default hidden=2048 gives 9.45 M parameters.
    return nn.Sequential(
        nn.Linear(IN, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, IN),
        nn.ReLU(),
        nn.Linear(IN, IN),
    )


def make_gpt2(layers: int, width: int, vocab: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_head=max(1, width // 64), n_embd=width, vocab_size=vocab, n_positions=seq
    )
    return GPT2LMHeadModel(config)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def gpt2_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _no_sync() -> None:
    return None


def measure_variants(
    names: Sequence[str],
    *,
    rank: int,
    steps: int,
    warmup: int,
    batch: int,
    hidden: int = 2048,
    bucket_view: bool = False,
    device: torch.device | None = None,
    model_kind: str = "mlp",
    gpt2: dict[str, int] | None = None,
    bf16: bool = False,
    layout: str = "ddp",
    audited: dict[str, list[int]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each variant in ``names`` (keys of :data:`VARIANTS`).

    Needs an initialized default process group; every rank of it must call this. On CUDA
    each timed step ends with a device synchronisation. ``audited``, if given, is filled
    with the indices of each variant's timed steps that ran a replay audit (for
    :func:`audit_costs`).
    """
    device = device if device is not None else torch.device("cpu")
    sync: Callable[[], object] = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    runners = _runners(
        names, device, batch, hidden, bucket_view, model_kind, gpt2, bf16, rank, layout
    )
    for run, _ in runners.values():  # warm-up: allocations, Adam state, kernels
        for _ in range(warmup):
            run()
    sync()
    # One step of each variant in turn: noise on this shared machine hits all alike, and
    # each variant's periodic checks fall on its own steps, amortized over all of them.
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(steps):
        for name, (run, guard) in runners.items():
            audits = guard.replay_stats.audits if guard is not None else 0
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
            if audited is not None and guard is not None and guard.replay_stats.audits > audits:
                audited.setdefault(name, []).append(step)
    return times


def _runners(
    names: Sequence[str],
    device: torch.device,
    batch: int,
    hidden: int,
    bucket_view: bool,
    model_kind: str,
    gpt2: dict[str, int] | None,
    bf16: bool,
    rank: int,
    layout: str = "ddp",
) -> dict[str, tuple[Callable[[], object], Guard | None]]:
    mesh = _mesh(layout, device)
    device_ids = [device.index] if device.type == "cuda" else None
    g = torch.Generator().manual_seed(rank)
    if model_kind == "gpt2":
        dims = gpt2 or {}
        seq, vocab = dims.get("seq", 64), dims.get("vocab", 8192)
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        data: Any = {"input_ids": ids, "labels": ids}
        fn: Callable[..., torch.Tensor] = gpt2_loss
    else:
        data = (
            torch.randn(batch, IN, generator=g).to(device),
            torch.randn(batch, IN, generator=g).to(device),
        )
        fn = loss_fn
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if bf16
        else contextlib.nullcontext
    )

    def loss_of(model: nn.Module, b: Any) -> torch.Tensor:
        with autocast():
            return fn(model, b)

    runners: dict[str, tuple[Callable[[], object], Guard | None]] = {}
    for name in names:
        config = VARIANTS[name]
        torch.manual_seed(0)
        if model_kind == "gpt2":
            dims = gpt2 or {}
            net = make_gpt2(
                dims.get("layers", 4),
                dims.get("width", 384),
                dims.get("vocab", 8192),
                dims.get("seq", 64),
            )
        else:
            net = make_model(hidden)
        ddp: nn.Module
        if mesh is None:
            ddp = DistributedDataParallel(
                net.to(device), device_ids=device_ids, gradient_as_bucket_view=bucket_view
            )
            opt = torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
        else:
            ddp = _fully_shard(net.to(device), mesh)
            opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        if name in FLOOR and mesh is None:
            hook = _minimal_hook(FLOOR[name], device)
            ddp.register_comm_hook(state=None, hook=hook)  # type: ignore[operator]
        if config is None:

            def plain(ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt) -> None:
                opt.zero_grad(set_to_none=True)
                loss_of(ddp, data).backward()
                opt.step()

            runners[name] = (plain, None)
        else:
            guard = Guard(ddp, opt, loss_of, GuardConfig(**config), reporter=None)

            def guarded(guard: Guard = guard) -> object:
                return guard.step(data)

            runners[name] = (guarded, guard)
    return runners


def _minimal_hook(
    check: bool, device: torch.device
) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """The least a correct Python comm hook does (see :data:`FLOOR`); ``check``: scale
    with check 1's kernel, which also raises a (here unread) flag."""
    world = dist.get_world_size()
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 1.0 / world, device=device)

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if check:
            torch._amp_foreach_non_finite_check_and_unscale_([buffer], found, inv)
        else:
            buffer.mul_(1.0 / world)
        fut = dist.all_reduce(buffer, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    hook.__annotations__.update(
        bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]}
    )
    return hook


def _mesh(layout: str, device: torch.device) -> Any:
    """The FSDP2 mesh of ``layout`` over every rank (``None`` for DDP)."""
    if layout == "ddp":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if layout == "hsdp":
        return init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def _fully_shard(net: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` per block, then the root: each Linear of the MLP; each transformer
    block of the GPT-2 (as torchtitan does; the embedding and the LM head, whose weights
    are tied, stay in the root's group)."""
    from torch.distributed.fsdp import fully_shard

    blocks = getattr(getattr(net, "transformer", None), "h", None)
    units = (
        list(blocks)
        if blocks is not None
        else [m for m in net.modules() if isinstance(m, nn.Linear)]
    )
    for module in units:
        fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_during(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory while ``fn`` runs: sampled resident memory, or CUDA's own counter."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(device))
    peak = [_rss()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], _rss())


def measure_audit_memory(
    *, rank: int, batch: int, device: torch.device, model_kind: str, gpt2: dict[str, int] | None
) -> dict[str, Any]:
    """Extra peak memory of an audited step over a step without an audit."""
    runners = _runners(
        ["replay_every_50_only"], device, batch, 2048, False, model_kind, gpt2, False, rank
    )
    run, guard = runners["replay_every_50_only"]
    assert guard is not None
    guard._audit.every = 2  # every other step: audited and unaudited steps alternate
    for _ in range(4):  # steps 1-4; from here odd steps are plain and even ones audited
        run()
    unaudited, audited = [], []
    for _ in range(3):
        unaudited.append(_peak_during(run, device))
        audited.append(_peak_during(run, device))
    plain_peak = statistics.median(unaudited)
    grad_bytes = sum(p.numel() * p.element_size() for p in guard.model.parameters())
    extra = max(0, int(statistics.median(audited) - plain_peak))
    return {
        "method": "CUDA max_memory_allocated"
        if device.type == "cuda"
        else "resident memory sampled every 0.2 ms",
        "gradient_bytes": grad_bytes,
        "extra_peak_bytes": extra,
        "ratio": round(extra / grad_bytes, 4),
        "audits": guard.replay_stats.audits,
    }


def audit_costs(
    times: dict[str, list[float]], audited: dict[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """Per variant whose timed steps held replay audits: what each audit cost, in plain
    steps (its step's time less the median of the variant's own steps without one, over
    the plain median), the first apart from the later ones. The first audit of a process
    pays once what later ones do not (the replayer's first recompute, first allocations);
    a variant earlier in :data:`DEFAULT_VARIANTS` has its first audit in the same step as
    a later one, so only the earliest pays the process's one-time costs. ``of_overhead``:
    the share of the variant's mean overhead that its audited steps make (the rest is its
    steps without an audit); ``steady_overhead``: the later audits' median over
    ``replay_every`` (what an audit adds per step once the first is paid; ``None`` with one
    audit: run more steps)."""
    plain = statistics.median(times["plain"])
    plain_mean = statistics.fmean(times["plain"])
    out: dict[str, dict[str, Any]] = {}
    for name, steps in audited.items():
        samples = times[name]
        at = set(steps)
        rest = [t for i, t in enumerate(samples) if i not in at]
        if not rest:
            continue
        base = statistics.median(rest)
        costs = [round((samples[i] - base) / plain, 3) for i in steps]
        every = (VARIANTS[name] or {}).get("replay_every", GuardConfig().replay_every)
        later = statistics.median(costs[1:]) if len(costs) > 1 else None
        out[name] = {
            "audits": len(costs),
            "first_audit_steps": costs[0],
            "later_audits_steps_median": round(later, 3) if later is not None else None,
            "each_audit_steps": costs,
            "replay_every": every,
            "of_overhead": round(
                sum(samples[i] - base for i in steps) / len(samples) / plain_mean, 4
            ),
            "steady_overhead": round(later / every, 4) if later is not None and every else None,
        }
    return out


def summarize(
    times: dict[str, list[float]], audited: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """Mean ms per step of ``plain`` and, per other variant, ms per step and overhead
    (with ``audited``, from :func:`measure_variants`: the cost of each replay audit,
    :func:`audit_costs`, in the variant's ``audits``)."""
    plain = statistics.fmean(times["plain"])
    plain_median = statistics.median(times["plain"])
    out: dict[str, Any] = {
        "plain_step_ms": round(plain * 1e3, 3),
        "plain_median_step_ms": round(plain_median * 1e3, 3),
        "variants": {},
    }
    for name, samples in times.items():
        if name == "plain":
            continue
        mean = statistics.fmean(samples)
        out["variants"][name] = {
            "config": VARIANTS[name],
            "step_ms": round(mean * 1e3, 3),
            "overhead": round(mean / plain - 1, 4),
            "median_overhead": round(statistics.median(samples) / plain_median - 1, 4),
        }
    for name, costs in audit_costs(times, audited or {}).items():
        out["variants"][name]["audits"] = costs
    floor = _floor(times)
    if floor:
        out["floor"] = floor
    if "defaults" in times and "defaults_snapshots" in times:
        on, off = times["defaults_snapshots"], times["defaults"]
        out["snapshot_extra"] = {
            "mean": round(statistics.fmean(on) / statistics.fmean(off) - 1, 4),
            "median": round(statistics.median(on) / statistics.median(off) - 1, 4),
        }
    return out


def _floor(times: dict[str, list[float]]) -> dict[str, Any]:
    """What CPU sets (see :data:`FLOOR`): each floor variant's overhead over plain DDP, and
    the Guard's variants over the floor variant that does the same arithmetic (what is
    the Guard's own: its Python, its flags)."""
    out: dict[str, Any] = {}
    pairs = {
        "plain_hook": ("hook_only", "any_comm_hook", "hook_only_over_plain_hook"),
        "plain_hook_check": (
            "nonfinite_only",
            "hook_and_check_pass",
            "nonfinite_only_over_plain_hook_check",
        ),
    }
    for floor, (guarded, own, over) in pairs.items():
        if floor not in times:
            continue
        out[own] = _ratios(times[floor], times["plain"])
        if guarded in times:
            out[over] = _ratios(times[guarded], times[floor])
    return out


def defaults_parts(summary: dict[str, Any], bound: dict[str, float]) -> dict[str, Any] | None:
    """The defaults' overhead (means over plain DDP) as the sum of their checks', each from
    its variant alone in this run, next to the floor each part has on this machine:

    - ``hook_and_check``: ``nonfinite_only``; its floor the same arithmetic without the Guard
      (``plain_hook_check``: a Python comm hook and check 1's one pass);
    - ``audit``: ``replay_every_50_only`` over ``hook_only``; its floor 1/``replay_every``:
      the audit recomputes one micro-batch's forward and backward (with one micro-batch a
      step, about a step's compute) once per interval, on any hardware. That difference of
      two means also holds the noise of every step without an audit; ``audited_steps`` is
      the audits' own share of the mean (``audits.of_overhead``, :func:`audit_costs`);
    - ``weights``: ``weights_every_1_only`` over ``hook_only``, divided by ``weights_every``;
      its floor reading the weights and Adam's two moments once (3 x ``sum_ms``, one pass
      over the parameters' size, in cache) per interval; ``floor_after_update`` the same read
      where check 3 makes it, right after the update, from memory
      (``bound.read_after_update_ms``, :func:`after_update_ms`; DDP on CPU only).

    ``None`` where a variant is missing."""
    v = {name: got["overhead"] for name, got in summary["variants"].items()}
    needed = ("nonfinite_only", "hook_only", "replay_every_50_only", "weights_every_1_only")
    if "defaults" not in v or any(n not in v for n in needed):
        return None
    floor = summary.get("floor", {}).get("hook_and_check_pass", {}).get("mean")
    if floor is None:
        return None
    config = GuardConfig()
    audited_every = VARIANTS["replay_every_50_only"]["replay_every"]  # type: ignore[index]
    hook = v["hook_only"]
    parts = {
        "hook_and_check": (v["nonfinite_only"], floor),
        "audit": (
            (v["replay_every_50_only"] - hook) * audited_every / config.replay_every,
            1 / config.replay_every,
        ),
        "weights": (
            (v["weights_every_1_only"] - hook) / config.weights_every,
            3 * bound["sum_ms"] / summary["plain_step_ms"] / config.weights_every,
        ),
    }
    out: dict[str, Any] = {
        name: {"measured": round(measured, 4), "floor": round(least, 4)}
        for name, (measured, least) in parts.items()
    }
    if "read_after_update_ms" in bound:
        out["weights"]["floor_after_update"] = round(
            bound["read_after_update_ms"] / summary["plain_step_ms"] / config.weights_every, 4
        )
    audits = summary["variants"]["replay_every_50_only"].get("audits")
    if audits is not None:
        share = audits["of_overhead"] * audited_every / config.replay_every
        out["audit"]["audited_steps"] = round(share, 4)
    out["sum_of_parts"] = round(sum(m for m, _ in parts.values()), 4)
    out["sum_of_floors"] = round(sum(f for _, f in parts.values()), 4)
    out["defaults_measured"] = v["defaults"]
    return out


def _ratios(samples: list[float], base: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(samples) / statistics.fmean(base) - 1, 4),
        "median": round(statistics.median(samples) / statistics.median(base) - 1, 4),
    }


def measure_snapshot_memory(
    *, rank: int, batch: int, hidden: int, model_kind: str, gpt2: dict[str, int] | None
) -> dict[str, Any]:
    """Host bytes this rank keeps for the verified snapshot (``snapshot_copies=2``), once
    Adam's moments exist, against one replica's state."""
    torch.manual_seed(0)
    net = make_gpt2(**_gpt2_args(gpt2)) if model_kind == "gpt2" else make_model(hidden)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
    guard = Guard(
        ddp,
        opt,
        loss_fn if model_kind == "mlp" else gpt2_loss,
        GuardConfig(snapshot_copies=2),
        reporter=None,
    )
    g = torch.Generator().manual_seed(rank)
    if model_kind == "gpt2":
        dims = _gpt2_args(gpt2)
        ids = torch.randint(0, dims["vocab"], (batch, dims["seq"]), generator=g)
        data: Any = {"input_ids": ids, "labels": ids}
    else:
        data = (torch.randn(batch, IN, generator=g), torch.randn(batch, IN, generator=g))
    guard.step(data)
    snapshot = guard.snapshot
    assert snapshot is not None
    out = {
        "copies": snapshot.copies,
        "bytes_per_rank": snapshot.bytes_per_rank(),
        "state_bytes": snapshot.state_bytes(),
        "share_of_state": round(snapshot.bytes_per_rank() / snapshot.state_bytes(), 3),
    }
    guard.close()
    return out


def one_pass_ms(numel: int, device: torch.device) -> dict[str, float]:
    """Time of one pass over ``numel`` float32 elements (what the hook's scaling costs)."""
    x = torch.randn(numel, device=device)
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 0.5, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync()
        samples = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    return {
        "mul_ms": round(timed(lambda: x.mul_(1.0)), 3),
        "scale_and_check_ms": round(
            timed(lambda: torch._amp_foreach_non_finite_check_and_unscale_([x], found, inv)), 3
        ),
        "sum_ms": round(timed(lambda: x.sum()), 3),
    }


def after_update_ms(net: nn.Module) -> dict[str, float]:
    """Check 3's read where check 3 makes it: every parameter and Adam's two moments right
    after a fused Adam update (whose footprint, four times the parameters', leaves them in
    memory, not cache). ``read_after_update_ms``: one ``torch.sum`` over each (the floor of
    any check that reads them); ``fingerprint_after_update_ms``: ``Fingerprinter.many``
    over the same tensors, what check 3 runs. Updates and measurements alternate."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    tensors = [
        t
        for p in net.parameters()
        for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
    ]
    fingerprinter = Fingerprinter("auto")
    fingerprinter.many(tensors)  # builds the kernel
    contenders: dict[str, Callable[[], object]] = {
        "read_after_update_ms": lambda: [t.detach().sum() for t in tensors],
        "fingerprint_after_update_ms": lambda: fingerprinter.many(tensors),
    }
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(10):
        for name, fn in contenders.items():
            opt.step()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(got) * 1e3, 3) for name, got in samples.items()}


def worker(
    rank: int,
    world: int,
    steps: int,
    warmup: int,
    batch: int,
    bucket_view: bool,
    names: Sequence[str] = DEFAULT_VARIANTS,
    hidden: int = 2048,
    model_kind: str = "mlp",
    gpt2: dict[str, int] | None = None,
    layout: str = "ddp",
) -> dict[str, Any]:
    audited: dict[str, list[int]] = {}
    times = measure_variants(
        names,
        rank=rank,
        steps=steps,
        warmup=warmup,
        batch=batch,
        hidden=hidden,
        bucket_view=bucket_view,
        model_kind=model_kind,
        gpt2=gpt2,
        layout=layout,
        audited=audited,
    )
    net = make_gpt2(**_gpt2_args(gpt2)) if model_kind == "gpt2" else make_model(hidden)
    numel = sum(p.numel() for p in net.parameters())
    if layout != "ddp":
        bound = one_pass_ms(numel, torch.device("cpu"))
        return {"times": times, "audited": audited, "bound": bound}
    memory = measure_audit_memory(
        rank=rank, batch=batch, device=torch.device("cpu"), model_kind=model_kind, gpt2=gpt2
    )
    bound = {**one_pass_ms(numel, torch.device("cpu")), **after_update_ms(net)}
    got = {"times": times, "audited": audited, "bound": bound, "memory": memory}
    if "defaults_snapshots" in names:
        got["snapshot_memory"] = measure_snapshot_memory(
            rank=rank, batch=batch, hidden=hidden, model_kind=model_kind, gpt2=gpt2
        )
    return got


def _gpt2_args(gpt2: dict[str, int] | None) -> dict[str, int]:
    dims = gpt2 or {}
    return {
        "layers": dims.get("layers", 4),
        "width": dims.get("width", 384),
        "vocab": dims.get("vocab", 8192),
        "seq": dims.get("seq", 64),
    }


def _single_rank_cuda(args: argparse.Namespace, names: list[str], kind: str) -> dict[str, Any]:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    device = torch.device("cuda", 0)
    gpt2 = _gpt2_dims(args)
    try:
        times = measure_variants(
            names,
            rank=0,
            steps=args.steps,
            warmup=args.warmup,
            batch=args.batch,
            hidden=args.hidden,
            bucket_view=args.bucket_view,
            device=device,
            model_kind=kind,
            gpt2=gpt2,
            bf16=args.bf16,
        )
        net = make_gpt2(**_gpt2_args(gpt2)) if kind == "gpt2" else make_model(args.hidden)
        numel = sum(p.numel() for p in net.parameters())
        return {"times": times, "bound": one_pass_ms(numel, device)}
    finally:
        dist.destroy_process_group()


def _gpt2_dims(args: argparse.Namespace) -> dict[str, int]:
    return {
        "layers": args.gpt2_layers,
        "width": args.gpt2_width,
        "vocab": args.vocab,
        "seq": args.seq,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per variant")
    parser.add_argument("--batch", type=int, default=32, help="MLP batch (GPT-2: --gpt2-batch)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--models", default="mlp,gpt2", help="mlp, gpt2 or both")
    parser.add_argument("--gpt2-layers", type=int, default=4)
    parser.add_argument("--gpt2-width", type=int, default=384)
    parser.add_argument("--gpt2-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    parser.add_argument(
        "--layout",
        choices=("ddp", "fsdp", "hsdp"),
        default="ddp",
        help="ddp (2 ranks), or FSDP2 over 4 ranks: fsdp (1-D) or hsdp (replicate 2 x shard 2)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: two gloo ranks; cuda: one NCCL rank on cuda:0",
    )
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)}; plain is always run",
    )
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for every variant, plain included",
    )
    args = parser.parse_args()
    names = ["plain", *(n for n in args.variants.split(",") if n and n != "plain")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.device == "cuda":
        names = [n for n in names if n != "defaults_snapshots"]  # gloo only, so far
    kinds = [k for k in args.models.split(",") if k]
    if not kinds or any(k not in ("mlp", "gpt2") for k in kinds):
        parser.error("--models: mlp, gpt2 or mlp,gpt2")
    if args.layout != "ddp" and (args.device != "cpu" or args.bf16 or args.bucket_view):
        parser.error("--layout fsdp/hsdp: CPU only, without --bf16 or --bucket-view")
    nodes = {
        "ddp": ["bench-node-0", "bench-node-1"],
        "fsdp": [f"bench-node-{i}" for i in range(4)],
        "hsdp": ["bench-node-0", "bench-node-0", "bench-node-1", "bench-node-1"],
    }[args.layout]
    models: dict[str, Any] = {}
    for kind in kinds:
        batch = args.gpt2_batch if kind == "gpt2" else args.batch
        if args.device == "cuda":
            ranks, backend = 1, "nccl"
            got = _single_rank_cuda(
                argparse.Namespace(**{**vars(args), "batch": batch}), names, kind
            )
        else:
            ranks, backend = len(nodes), "gloo"
            results = spawn_local(
                worker,
                nodes,
                (
                    args.steps,
                    args.warmup,
                    batch,
                    args.bucket_view,
                    names,
                    args.hidden,
                    kind,
                    _gpt2_dims(args),
                    args.layout,
                ),
            )
            got = results[0]  # ranks run in lockstep; rank 0 is representative
        summary = summarize(got["times"], got.get("audited"))
        net = (
            make_gpt2(**_gpt2_args(_gpt2_dims(args))) if kind == "gpt2" else make_model(args.hidden)
        )
        bound = got["bound"]
        for kernel in ("mul", "scale_and_check"):
            bound[f"{kernel}_share_of_plain_step"] = round(
                bound[f"{kernel}_ms"] / summary["plain_step_ms"], 4
            )
        parts = defaults_parts(summary, bound)
        models[kind] = {
            "model": "GPT-2 (transformers, random weights)" if kind == "gpt2" else "MLP",
            "parameters": sum(p.numel() for p in net.parameters()),
            "batch": batch,
            **({"gpt2": _gpt2_args(_gpt2_dims(args))} if kind == "gpt2" else {}),
            **summary,
            "bound": bound,
            **({"defaults_parts": parts} if parts is not None else {}),
            **({"audit_memory": got["memory"]} if "memory" in got else {}),
            **({"snapshot_memory": got["snapshot_memory"]} if "snapshot_memory" in got else {}),
        }
    out: dict[str, Any] = {
        "benchmark": "overhead",
        "torch": torch.__version__,
        "device": args.device,
        "backend": backend,
        "ranks": ranks,
        "layout": args.layout,
        **({"nodes": len(set(nodes))} if args.device == "cpu" else {}),
        "optimizer": "Adam(fused=True)" if args.layout == "ddp" else "Adam",
        "bf16_autocast": args.bf16,
        "gradient_as_bucket_view": args.bucket_view,
        "steps_per_variant": args.steps,
        "models": models,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
