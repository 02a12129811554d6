"""Check 2: the ring replay audit.

On an audit step every rank recomputes one micro-batch of a partner rank on another node
(the ring shifts by the number of ranks per node), with the partner's RNG and autocast
state, and compares the loss bit for bit and the local (pre-all-reduce) gradients by
fingerprint. A rank whose hardware computes wrong shows up twice: in its own work, which
the next node replays, and in its replay of its partner's work. The rank common to two
mismatches is the suspect and the fault is persistent (it reproduced in both of its
computations). A single mismatch names two ranks; a third rank on a third node replays the
same micro-batch and breaks the tie; the fault is transient (its other computation was
right). Patterns no single faulty rank explains, and tie-breaks that agree with neither
side, point at a model that is not deterministic and accuse nobody.

This module holds the pure decisions (:func:`plan_ring`, :func:`explain_mismatches`,
:func:`choose_tiebreakers`, :func:`resolve`) and the mechanics of moving a micro-batch
between ranks and recomputing it (:class:`Payload`, :func:`exchange`, :func:`replay`).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .fingerprint import Fingerprinter, _as_flat_bits, combine_fingerprints

__all__ = [
    "Payload",
    "ReplayFinding",
    "choose_tiebreakers",
    "exchange",
    "explain_mismatches",
    "plan_ring",
    "replay",
    "resolve",
    "storm_threshold",
]

# -- the ring ------------------------------------------------------------------------------


def plan_ring(nodes: Sequence[str]) -> dict[int, int]:
    """``replayer_of[p]``: the rank that replays rank ``p``'s work, always on another node.

    Ranks are ordered by node (in order of appearance) and rank; the ring shifts by the
    largest number of ranks on one node, so with the same number on every node each rank's
    work goes to the same local rank of the next node. Ranks for which the shift lands on
    their own node (uneven nodes, a single node) are left out.
    """
    order_of_node = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    order = sorted(range(len(nodes)), key=lambda r: (order_of_node[nodes[r]], r))
    if not order:
        return {}
    shift = max(Counter(nodes).values())
    ring = {}
    for i, p in enumerate(order):
        r = order[(i + shift) % len(order)]
        if nodes[r] != nodes[p]:
            ring[p] = r
    return ring


# -- the decisions -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Explanation:
    """What the first round of comparisons says, before any tie-break."""

    persistent: tuple[int, ...]
    """Ranks in two or more mismatches with different other ranks: their hardware was wrong
    twice."""
    ambiguous: tuple[int, ...]
    """Ranks in two mismatches with the same other rank (a ring of two nodes): one of each
    such pair is wrong, and no third node tells which."""
    unexplained: tuple[int, ...]
    """Owners ``p`` of mismatches that no persistent rank explains: a tie-break decides
    between ``p`` and its replayer."""
    storm: bool
    """More mismatches than one or two faulty ranks produce: not hardware."""


def storm_threshold(world: int) -> int:
    """Most mismatching pairs one audit may have and still accuse hardware.

    One broken GPU gives 2 mismatches, two give 4, a whole broken node of L GPUs 2L,
    which large jobs (up to a quarter of the world) still localize. Every pair of the ring
    mismatching is a storm whatever the size.
    """
    return max(4, world // 4)


def explain_mismatches(
    mismatched: Sequence[int], replayer_of: Mapping[int, int], *, max_mismatches: int
) -> Explanation:
    """Explain mismatches of the work of ranks ``mismatched`` (replayed by ``replayer_of``).

    More than ``max_mismatches``, or every pair of a ring of more than two, is a storm.
    """
    pairs = {p: (p, replayer_of[p]) for p in mismatched}
    everything = len(pairs) == len(replayer_of) and len(replayer_of) > 2
    if len(pairs) > max_mismatches or everything:
        return Explanation((), (), (), True)
    partners: dict[int, set[int]] = {}
    count: Counter[int] = Counter()
    for a, b in pairs.values():
        count[a] += 1
        count[b] += 1
        partners.setdefault(a, set()).add(b)
        partners.setdefault(b, set()).add(a)
    persistent = tuple(sorted(r for r, c in count.items() if c >= 2 and len(partners[r]) >= 2))
    ambiguous = tuple(sorted(r for r, c in count.items() if c >= 2 and len(partners[r]) < 2))
    covered = set(persistent) | set(ambiguous)
    unexplained = tuple(sorted(p for p, pair in pairs.items() if not set(pair) & covered))
    return Explanation(persistent, ambiguous, unexplained, False)


def choose_tiebreakers(
    unexplained: Sequence[int],
    replayer_of: Mapping[int, int],
    nodes: Sequence[str],
    involved: set[int],
) -> dict[int, int]:
    """``tiebreaker_of[p]``: for each unexplained mismatch, a rank on a third node.

    Never a rank involved in any mismatch, never one rank for two tie-breaks; the lowest
    rank that qualifies. Mismatches without a candidate (fewer than three nodes) are left
    out, and stay unresolved.
    """
    taken: set[int] = set()
    out = {}
    for p in unexplained:
        avoid = {nodes[p], nodes[replayer_of[p]]}
        for t in range(len(nodes)):
            if nodes[t] not in avoid and t not in involved and t not in taken:
                out[p] = t
                taken.add(t)
                break
    return out


@dataclass(frozen=True, slots=True)
class ReplayFinding:
    classification: str
    """``rank`` (hardware) or ``nondeterministic`` (accuses nobody)."""
    suspects: tuple[int, ...]
    localized: bool
    transient: bool | None
    message: str
    unresolved: tuple[int, ...] = field(default=())


def resolve(
    explanation: Explanation,
    replayer_of: Mapping[int, int],
    tiebreak: Mapping[int, str],
) -> ReplayFinding:
    """Final finding. ``tiebreak[p]``: ``"original"`` (the third rank agreed with ``p``'s
    own result, so the replayer was wrong), ``"replay"`` (it agreed with the replayer, so
    ``p`` was wrong) or ``"neither"``. Unexplained mismatches missing from ``tiebreak``
    had no third node."""
    if explanation.storm:
        return ReplayFinding(
            "nondeterministic",
            (),
            False,
            None,
            "too many replays differ for one faulty GPU: the model is not deterministic "
            "(run the calibration mode); no hardware is accused",
        )
    if any(v == "neither" for v in tiebreak.values()):
        return ReplayFinding(
            "nondeterministic",
            (),
            False,
            None,
            "a third replay agreed with neither side: the model is not deterministic; "
            "no hardware is accused",
        )
    suspects: set[int] = set(explanation.persistent)
    transient_suspects: set[int] = set()
    unresolved: set[int] = set(explanation.ambiguous)
    for p in explanation.unexplained:
        outcome = tiebreak.get(p)
        if outcome == "replay":
            transient_suspects.add(p)
        elif outcome == "original":
            transient_suspects.add(replayer_of[p])
        else:
            unresolved.update((p, replayer_of[p]))
    all_suspects = tuple(sorted(suspects | transient_suspects | unresolved))
    localized = not unresolved
    transient: bool | None
    if not localized:
        transient = None
        message = (
            f"replays differ between ranks {', '.join(map(str, all_suspects))} and no third "
            "node can tell which is wrong (the audit needs at least three nodes to localize)"
        )
    elif transient_suspects and not suspects:
        transient = True
        message = (
            f"rank(s) {', '.join(map(str, all_suspects))} computed a wrong result once; a "
            "third node confirmed it and the rank's other computation was right (transient)"
        )
    else:
        transient = False if not transient_suspects else None
        message = (
            f"rank(s) {', '.join(map(str, all_suspects))} computed wrong results both in "
            "their own work and in their replay of another rank's work (persistent)"
        )
    return ReplayFinding(
        "rank", all_suspects, localized, transient, message, tuple(sorted(unresolved))
    )


# -- moving and recomputing a micro-batch ---------------------------------------------------


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _autocast_state() -> dict[str, tuple[bool, torch.dtype]]:
    state = {}
    for device in ("cpu", "cuda"):
        try:
            state[device] = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        except (RuntimeError, AttributeError):  # older torch without the device argument
            continue
    return state


@dataclass(slots=True)
class Payload:
    """One micro-batch with everything needed to recompute it bit for bit."""

    batch: Any
    divisor: int
    """The micro-batch's loss is divided by this (gradient accumulation) before backward."""
    rng_cpu: torch.Tensor
    rng_cuda: torch.Tensor | None
    autocast: dict[str, tuple[bool, torch.dtype]]

    @classmethod
    def capture(cls, batch: Any, divisor: int, *, copy: bool = False) -> Payload:
        """Record the RNG and autocast state now, right before the micro-batch's forward.

        With ``copy`` the batch's tensors are cloned, so a model or loss function that
        changes its inputs in place cannot change what gets replayed.
        """
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        if copy:
            batch = _map_tensors(batch, lambda t: t.detach().clone())
        return cls(batch, divisor, torch.get_rng_state(), cuda, _autocast_state())

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "batch": _map_tensors(self.batch, lambda t: t.detach().cpu()),
                "divisor": self.divisor,
                "rng_cpu": self.rng_cpu,
                "rng_cuda": self.rng_cuda,
                "autocast": self.autocast,
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Payload:
        # Only ever from another rank of the same job, which runs the same code.
        d = torch.load(io.BytesIO(data), weights_only=False)
        return cls(d["batch"], d["divisor"], d["rng_cpu"], d["rng_cuda"], d["autocast"])


def exchange(
    sends: Mapping[int, bytes],
    receives: Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[int, bytes]:
    """Point-to-point: send ``sends[dst]`` to each ``dst``, receive from each of ``receives``.

    Ranks are group ranks. Sizes travel first, then the bytes.
    """

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    size_out = {
        d: torch.tensor([len(b)], dtype=torch.int64, device=device) for d, b in sends.items()
    }
    size_in = {s: torch.zeros(1, dtype=torch.int64, device=device) for s in receives}
    _p2p(size_out, size_in, glob, group)
    data_out = {
        d: torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device) for d, b in sends.items()
    }
    data_in = {
        s: torch.empty(int(size_in[s].item()), dtype=torch.uint8, device=device) for s in receives
    }
    _p2p(data_out, data_in, glob, group)
    return {s: bytes(t.cpu().numpy().tobytes()) for s, t in data_in.items()}


def _p2p(
    out: Mapping[int, torch.Tensor],
    into: Mapping[int, torch.Tensor],
    glob: Callable[[int], int],
    group: dist.ProcessGroup | None,
) -> None:
    ops = [dist.P2POp(dist.isend, t, glob(d), group) for d, t in out.items()]
    ops += [dist.P2POp(dist.irecv, t, glob(s), group) for s, t in into.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def loss_bits(loss: torch.Tensor) -> torch.Tensor:
    """The loss's bit pattern as an int64 scalar tensor (compared bit for bit)."""
    return _as_flat_bits(loss)[:1].to(torch.int64)[0]


def combine_per_parameter(
    fingerprints: Sequence[torch.Tensor | None], device: torch.device
) -> torch.Tensor:
    """One fingerprint of per-parameter fingerprints, in parameter order; ``None`` (no
    gradient) counts as the fingerprint of zeros."""
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    per = [zero if f is None else f.to(device) for f in fingerprints]
    return combine_fingerprints(torch.stack(per)) if per else zero


def gradient_fingerprint(
    grads: Sequence[torch.Tensor | None], fingerprinter: Fingerprinter, device: torch.device
) -> torch.Tensor:
    """One fingerprint of per-parameter gradients, in parameter order."""
    return combine_per_parameter([None if g is None else fingerprinter(g) for g in grads], device)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    loss: torch.Tensor
    grads: list[torch.Tensor | None]


def replay(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    payload: Payload,
    device: torch.device,
) -> ReplayResult:
    """Recompute ``payload``'s loss and local gradients on ``module`` without side effects.

    The gradients come from :func:`torch.autograd.grad`, so ``.grad``, DDP's reducer and
    the optimizer never see them; RNG state and buffers (BatchNorm statistics) are put
    back afterwards.
    """
    batch = _map_tensors(payload.batch, lambda t: t.to(device))
    own_cpu = torch.get_rng_state()
    own_cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    buffers = [b.detach().clone() for b in module.buffers()]
    try:
        torch.set_rng_state(payload.rng_cpu)
        if payload.rng_cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(payload.rng_cuda)
        with ExitStack() as stack:
            for dev, (enabled, dtype) in payload.autocast.items():
                if enabled:
                    stack.enter_context(torch.autocast(dev, dtype=dtype))
            loss = loss_fn(module, batch)
        grads = torch.autograd.grad(
            loss / payload.divisor if payload.divisor != 1 else loss,
            list(params),
            allow_unused=True,
        )
    finally:
        torch.set_rng_state(own_cpu)
        if own_cuda is not None:
            torch.cuda.set_rng_state(own_cuda)
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers, strict=True):
                b.copy_(saved)
    return ReplayResult(loss.detach(), list(grads))
