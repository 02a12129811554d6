"""Check 2: the ring replay audit.

On an audit step every rank recomputes one micro-batch of a partner rank on another node
(the ring shifts by the number of ranks per node), with the partner's RNG and autocast
state and the same gradient reaching its loss, and compares the loss and the local
(pre-all-reduce) gradients (see :mod:`sdc_agent.evidence` for what counts as a
difference). A rank whose hardware computes wrong shows up twice: in its own work, which
the next node replays, and in its replay of its partner's work. Before anyone is accused,
a second round re-runs the work in question: its owner recomputes it (not reproducible
there: transient), its replayer replays it again, and a rank on a third node replays it
once. The rank that two other nodes agree against is the suspect. Patterns no single
faulty rank explains, and third replays that agree with neither side, point at a
computation that is not reproducible and accuse nobody.

This module holds the pure decisions (:func:`plan_ring`, :func:`explain_mismatches`,
:func:`choose_tiebreakers`, :func:`judge`, :func:`resolve`) and the mechanics of moving a
micro-batch between ranks and recomputing it (:class:`Payload`, :func:`exchange`,
:func:`replay`).
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import SDCError
from .fingerprint import _as_flat_bits

__all__ = [
    "NOISE_MULTIPLE",
    "SEPARATION_RATIO",
    "WEAK_AUDITS",
    "Payload",
    "Recheck",
    "ReplayFinding",
    "RngState",
    "choose_thirds",
    "choose_tiebreakers",
    "exchange",
    "explain_mismatches",
    "forbid_collectives",
    "free_in",
    "judge",
    "map_tensors",
    "named_on_repeat",
    "pack",
    "plan_ring",
    "replay",
    "replay_complete",
    "resolve",
    "storm_threshold",
    "strength",
    "suspects_by_kind",
    "unpack",
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


def choose_thirds(
    owners: Sequence[int],
    replayer_of: Mapping[int, int],
    nodes: Sequence[str],
    involved: set[int],
    flagged: Mapping[int, Sequence[int]] | None = None,
) -> dict[int, int]:
    """``third_of[q]``: for each owner whose work is rechecked, a rank on a third node.

    Never ``q`` or its replayer; preferably a rank that may be wrong nowhere here (no
    owner being rechecked, no replayer of one; lowest first), else one whose mismatches
    the ring already explains (the partner of a persistent rank: its own work was right,
    a faulty replayer made it differ); preferably one not already chosen for another
    recheck. Owners without a candidate (fewer than three nodes) are left out.

    Without ``flagged`` a rank that may be wrong anywhere is never chosen. With
    ``flagged`` (the owners whose work differed, per kind of evidence), such a rank is
    chosen when nothing better is left: the one that may be wrong in the fewest of the
    kinds in which ``q``'s work differed. Its replay of ``q``'s work then separates ``q``
    and its replayer in the kinds where it may not be wrong (:func:`free_in`), and in the
    others nobody (:attr:`Recheck.crowded`).
    """
    suspects = {r for q in owners for r in (q, replayer_of[q])}
    by_kind = suspects_by_kind(owners, replayer_of, flagged or {})
    taken: set[int] = set()
    out = {}
    for q in owners:
        avoid = {nodes[q], nodes[replayer_of[q]]}
        ok = [t for t in range(len(nodes)) if nodes[t] not in avoid]
        if flagged is None:
            ok = [t for t in ok if t not in suspects]
        else:
            ok = [t for t in ok if t not in (q, replayer_of[q])]
        kinds = [k for k, ps in (flagged or {}).items() if q in ps]

        def rank(t: int, kinds: list[int] = kinds) -> tuple[int, bool, bool, bool, int]:
            conflicts = sum(t in by_kind[k] for k in kinds)
            return (conflicts, t in suspects, t in involved, t in taken, t)

        ranked = sorted(ok, key=rank)
        if ranked:
            out[q] = ranked[0]
            taken.add(ranked[0])
    return out


def suspects_by_kind(
    owners: Sequence[int], replayer_of: Mapping[int, int], flagged: Mapping[int, Sequence[int]]
) -> dict[int, set[int]]:
    """Per kind, the ranks that may be wrong in it: each owner being rechecked whose work
    differed in that kind, and its replayer."""
    return {
        k: {r for q in owners if q in ps for r in (q, replayer_of[q])} for k, ps in flagged.items()
    }


def free_in(third: int, kind: int, suspects: Mapping[int, set[int]]) -> bool:
    """A third's replay separates in ``kind`` only where the third may not be wrong in it
    (in no pair that differed in that kind and is rechecked)."""
    return third not in suspects.get(kind, set())


@dataclass(frozen=True, slots=True)
class ReplayFinding:
    classification: str
    """``rank`` (hardware), ``nondeterministic`` (accuses nobody: noise),
    ``unseparated`` (accuses nobody: differences that the recheck had no free third node
    to tell apart, see :attr:`Recheck.crowded`; the audit neither learns them as noise nor
    vouches for the step) or ``weak`` (accuses nobody yet: third nodes sided against
    ``suspects`` but not clearly, see :func:`strength`; the audit learns nothing from
    them, does not vouch for the step, and names such a rank when the re-audits at the
    next steps separate it again, alone: :data:`WEAK_AUDITS` audits in a row)."""
    suspects: tuple[int, ...]
    localized: bool
    transient: bool | None
    message: str
    unresolved: tuple[int, ...] = field(default=())
    corroborated: bool | None = None


@dataclass(frozen=True, slots=True)
class Recheck:
    """The second round for one owner ``q`` whose work differed from its replay by ``R``.

    ``q`` recomputes its own micro-batch (``rerun``), ``R`` replays it again
    (``rereplay``) and a rank ``third`` on a third node replays it once. Each field says
    whether two of those computations agree (within the tolerance in force); ``None``
    where the computation could not be made (no third node).
    """

    owner: int
    replayer: int
    third: int | None
    third_agrees_original: bool | None
    third_agrees_replay: bool | None
    rerun_reproduces: bool
    """``q``'s rerun agrees with ``q``'s original."""
    rereplay_reproduces: bool
    """``R``'s second replay agrees with its first."""
    third_to_original: float | None = None
    """How far the third's replay is from ``q``'s original (relative, in this kind; 0
    where bit for bit equal; ``None``: no third)."""
    third_to_replay: float | None = None
    """How far the third's replay is from ``R``'s replay (as :attr:`third_to_original`)."""
    noise: float = 0.0
    """The tolerance in force in this kind for ``q`` and ``R``: the noise learned."""
    crowded: bool = False
    """No third node was free in this kind, though the ring has one: every rank on a node
    other than ``q``'s and ``R``'s was itself rechecked, or replayed rechecked work, in a
    pair that differed in this kind (see :func:`choose_thirds`). The differences reach
    every node, so this recheck separates ``q`` and ``R`` from nobody; :func:`resolve`
    names nobody on it (and does not let it hide what other rechecks separated)."""


def judge(recheck: Recheck) -> tuple[str, int | None, bool | None]:
    """``(outcome, suspect, transient)`` for one recheck.

    ``owner`` / ``replayer``: two other nodes agree with each other and not with that
    rank (``third`` and the other side); the rank's own second computation says whether
    the wrong result reproduces there (persistent) or not (transient). ``neither``: the
    third node agrees with neither side, or with both: not something one GPU explains.
    ``unresolved``: no third node.
    """
    if recheck.third is None:
        return "unresolved", None, None
    with_original = bool(recheck.third_agrees_original)
    with_replay = bool(recheck.third_agrees_replay)
    if with_replay and not with_original:
        return "owner", recheck.owner, not recheck.rerun_reproduces
    if with_original and not with_replay:
        return "replayer", recheck.replayer, not recheck.rereplay_reproduces
    return "neither", None, None


SEPARATION_RATIO = 4.0
"""A third's replay separates a rank at once only when its distance to that rank's
result is at least this many times its distance to the other side's (and above
:data:`NOISE_MULTIPLE` times the kind's noise). Measured under the GPT-2's emulated bf16
forward noise, seeds 2 to 8 (docs/agent.md): the thirds that sided against a healthy rank
were 1.5 to 8.4 times nearer the other side at 1.0 to 1.8 times the tolerance (never past
both 4 and 2); against a persistent 8 ulp or 1e-3 fault, 1.8 to 120 times at 1.3 to 4.8
times the tolerance, 68 of 79 past both."""

NOISE_MULTIPLE = 2.0
"""... and its distance to the accused side is above this many times the tolerance in
force for the pair (the noise learned in the kind): a separation no larger than twice
the noise is weak whatever the ratio."""


def strength(recheck: Recheck) -> str:
    """``strong`` or ``weak``: how clearly the third node's replay separates the rank
    :func:`judge` names (``none`` where it names nobody).

    Strong: the third is at least :data:`SEPARATION_RATIO` times farther from the accused
    side than from the other, and farther than :data:`NOISE_MULTIPLE` times the noise in
    force. Where the third agrees bit for bit with the other side (a bit-reproducible job)
    any difference is strong. Without the distances (older callers) the yes/no agreement
    alone decides, as strong.
    """
    outcome, _, _ = judge(recheck)
    if outcome not in ("owner", "replayer"):
        return "none"
    to_original, to_replay = recheck.third_to_original, recheck.third_to_replay
    if to_original is None or to_replay is None:
        return "strong"
    accused, other = (to_original, to_replay) if outcome == "owner" else (to_replay, to_original)
    if other == 0.0:
        return "strong"
    if accused >= SEPARATION_RATIO * other and accused > NOISE_MULTIPLE * recheck.noise:
        return "strong"
    return "weak"


WEAK_AUDITS = 2
"""Audits in a row (a scheduled one and the re-audit after it) that must each separate the
same rank weakly, and only it, before weak separations name it. Measured in clean GPT-2
runs under forward noise (7 seeds, 60 steps): about one audit in ten separated one healthy
rank weakly, a third of their re-audits did so again, each time another rank (none named);
by chance (one rank in five) two in a row on the same rank would come about once in 200
audits under that noise, which sits at the cap. Three (about once in 3,000) cost a 1e-3
fault's detection at one of seven seeds within two audit intervals (docs/agent.md)."""


def named_on_repeat(
    before: Sequence[Set[int]], now: Set[int], audits: int = WEAK_AUDITS
) -> int | None:
    """The rank weak separations name: the one rank that this audit (``now``, a re-audit)
    and the ``audits - 1`` right before it (``before``, oldest first) each separated
    weakly, alone. Fresh noise at each re-audit, the same persistent fault: a fault's rank
    stays, while noise that sided against a healthy rank moves (several ranks at one
    audit, another rank at the next); then nobody."""
    chain = [*before, now][-audits:]
    if len(chain) == audits and len(now) == 1 and all(c == now for c in chain):
        return next(iter(now))
    return None


def resolve(explanation: Explanation, rechecks: Sequence[Recheck]) -> ReplayFinding:
    """The audit's finding from the ring's explanation and the second round."""
    if explanation.storm:
        return ReplayFinding(
            "nondeterministic",
            (),
            False,
            None,
            "too many replays differ for one faulty GPU: the computation is not "
            "reproducible across processes beyond the noise learned so far; no hardware "
            "is accused",
        )
    # A crowded recheck separates nobody: it is left out, never weighed against one
    # whose free third did separate a rank.
    crowded = sorted((r.owner, r.replayer) for r in rechecks if r.crowded)
    outcomes = [(r, *judge(r)) for r in rechecks if not r.crowded]
    if any(o == "neither" for _, o, _, _ in outcomes):
        return ReplayFinding(
            "nondeterministic",
            (),
            False,
            None,
            "a third node's replay agreed with neither side (or with both): the "
            "computation is not reproducible; no hardware is accused",
        )
    # Weak separations (see strength()) name nobody here: the audit names such a rank
    # only when the re-audits after it separate it again (named_on_repeat).
    weak = sorted({s for r, o, s, _ in outcomes if s is not None and strength(r) == "weak"})
    outcomes = [x for x in outcomes if x[2] is None or strength(x[0]) == "strong"]
    separated = any(o in ("owner", "replayer") for _, o, _, _ in outcomes)
    if (
        weak
        and not separated
        and not explanation.ambiguous
        and not any(o == "unresolved" for _, o, _, _ in outcomes)
    ):
        listed = ", ".join(map(str, weak))
        return ReplayFinding(
            "weak",
            tuple(weak),
            False,
            None,
            f"a third node's replay sided against rank(s) {listed}, but not clearly: "
            f"less than {SEPARATION_RATIO:g} times nearer the other side, or within "
            f"{NOISE_MULTIPLE:g} times the noise; such a rank is named only if the "
            f"re-audits at the next steps separate it again ({WEAK_AUDITS} audits in a row)",
        )
    if crowded and not separated:
        # A rank is never named on evidence that does not separate it from healthy ranks:
        # with a third node in the ring but none free, some differing pairs are between
        # ranks that one faulty GPU does not explain (noise beyond the tolerance, or
        # more faults than the ring can tell apart), and these pairs look no different.
        listed = ", ".join(f"{a} and {b}" for a, b in crowded)
        return ReplayFinding(
            "unseparated",
            (),
            False,
            None,
            f"replays differ between ranks {listed}, and between ranks on every node: no "
            "rank on a third node was left outside the differences to tell which side is "
            "wrong, so nothing separates these ranks from healthy ones; no hardware is "
            "accused",
        )
    suspects: dict[int, bool | None] = {}
    unresolved: set[int] = set(explanation.ambiguous)
    for recheck, outcome, suspect, transient in outcomes:
        if outcome == "unresolved":
            unresolved.update((recheck.owner, recheck.replayer))
        else:
            assert suspect is not None
            suspects[suspect] = suspects.get(suspect, transient)
    names = tuple(sorted(set(suspects) | unresolved))
    listed = ", ".join(map(str, names))
    if unresolved:
        return ReplayFinding(
            "rank",
            names,
            False,
            None,
            f"replays differ between ranks {listed} and no third node can tell which is "
            "wrong (the audit needs at least three nodes to localize)",
            tuple(sorted(unresolved)),
            corroborated=False,
        )
    flags = set(suspects.values())
    transient = flags.pop() if len(flags) == 1 else None
    if transient:
        message = (
            f"rank(s) {listed} computed a wrong result once: two other nodes agree with "
            "each other, and the rank's own recomputation was right this time (transient)"
        )
    else:
        message = (
            f"rank(s) {listed} computed a wrong result and reproduced it when recomputing "
            "its own micro-batch, while two other nodes agree with each other (persistent)"
        )
    if crowded:
        listed = ", ".join(f"{a} and {b}" for a, b in crowded)
        message += (
            f"; the replays that differ between ranks {listed} had no free third node, "
            "separate nobody, and accuse nobody"
        )
    return ReplayFinding("rank", names, True, transient, message, (), corroborated=True)


# -- moving and recomputing a micro-batch ---------------------------------------------------


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (dicts, lists, tuples, nested)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, Mapping):  # transformers' BatchEncoding and other UserDicts
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


_map_tensors = map_tensors


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "reduce",
    "gather",
    "scatter",
)


@contextmanager
def forbid_collectives() -> Iterator[None]:
    """Collectives called through ``torch.distributed`` raise instead of hanging.

    A replay runs on some ranks only (tie-breaks, reruns), so a model whose forward makes
    a collective (an MoE all-to-all) would wait there forever for ranks that are not
    replaying. The ring round, which every rank runs, reaches it first on every rank,
    so every rank raises the same clear error.
    """
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise SDCError(
                f"the model's forward calls torch.distributed.{name}, a collective, and the "
                "replay audit recomputes micro-batches on some ranks only: set "
                "replay_every=0 (and replay_probability=0) for this model"
            )

        return call

    try:
        for name in saved:
            setattr(dist, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


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
    rng_cpu: torch.Tensor
    rng_cuda: torch.Tensor | None
    autocast: dict[str, tuple[bool, torch.dtype]]
    loss_grad: torch.Tensor | None = None
    """The gradient that reached the loss in the original backward: ``1 / n`` under
    gradient accumulation, times the loss scale with a GradScaler, whatever the loop did
    between the loss and ``backward()``. ``None``: 1."""

    @classmethod
    def capture(
        cls, batch: Any, *, copy: bool = False, device: torch.device | None = None
    ) -> Payload:
        """Record the RNG and autocast state now, right before the micro-batch's forward.

        With ``copy`` the batch's tensors are cloned, so a model or loss function that
        changes its inputs in place cannot change what gets replayed. ``device``: the
        model's (see :meth:`RngState.capture`).
        """
        state = RngState.capture(device)
        if copy:
            batch = _map_tensors(batch, lambda t: t.detach().clone())
        return cls(batch, state.cpu, state.cuda, state.autocast)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "batch": _map_tensors(self.batch, lambda t: t.detach().cpu()),
                "rng_cpu": self.rng_cpu,
                "rng_cuda": self.rng_cuda,
                "autocast": self.autocast,
                "loss_grad": None if self.loss_grad is None else self.loss_grad.detach().cpu(),
            },
            buf,
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> Payload:
        # Only ever from another rank of the same job, which runs the same code.
        d = torch.load(io.BytesIO(data), weights_only=False)
        return cls(d["batch"], d["rng_cpu"], d["rng_cuda"], d["autocast"], d["loss_grad"])


@dataclass(frozen=True, slots=True)
class RngState:
    """The generators and autocast state a forward pass starts from."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    autocast: dict[str, tuple[bool, torch.dtype]]

    @classmethod
    def capture(cls, device: torch.device | None = None) -> RngState:
        """The state now. ``device``: the model's; its CUDA generator is the one its
        dropout draws from (with ``device_ids=[r]`` and no ``set_device``, the current
        device is ``cuda:0`` on every rank, not the model's). ``None``: the current CUDA
        device; a CPU device: no CUDA state."""
        cuda_device = _cuda_device(device)
        cuda = None
        if cuda_device is not None and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state(cuda_device)
        return cls(torch.get_rng_state(), cuda, _autocast_state())

    def restore(self, device: torch.device | None = None) -> None:
        """Put the generators back (the CUDA one on ``device``, as in :meth:`capture`)."""
        _set_rng(self.cpu, self.cuda, device)


def _cuda_device(device: torch.device | None) -> torch.device | str | None:
    if device is None:
        return "cuda"  # torch's default: the current device
    return device if device.type == "cuda" else None


def _set_rng(cpu: torch.Tensor, cuda: torch.Tensor | None, device: torch.device | None) -> None:
    torch.set_rng_state(cpu)
    cuda_device = _cuda_device(device)
    if cuda is not None and cuda_device is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(cuda, cuda_device)


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


def pack(obj: Any) -> bytes:
    """``obj`` as bytes for :func:`exchange`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed."""
    # Only ever from another rank of the same job, which runs the same code.
    return torch.load(io.BytesIO(data), weights_only=False)


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


GradSink = Callable[[int, torch.Tensor], None]
"""Called with a parameter's index and its replayed gradient, once it is complete."""


class _SharedAcrossPasses(Exception):
    """A parameter's gradient was accumulated twice in one replay (reentrant
    checkpointing of a region that shares it with the rest of the model)."""


def replay(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    payload: Payload,
    device: torch.device,
    sink: GradSink,
    keep: set[int] | None = None,
    forward: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> torch.Tensor:
    """Recompute ``payload``'s loss and local gradients on ``module`` without side effects.

    ``backward`` runs (so reentrant activation checkpointing works, which
    :func:`torch.autograd.grad` refuses) with each parameter's ``.grad`` set aside: a
    post-accumulate-grad hook hands every replayed gradient to ``sink`` the moment it is
    complete and frees it, so no second gradient set ever exists. The real gradients are
    put back untouched; DDP's reducer does not take part (it expects no gradients outside
    a DDP forward, and ``module`` is the unwrapped model). RNG state and buffers
    (BatchNorm statistics) are put back afterwards. Parameters in ``keep`` (whose
    gradient more than one backward pass accumulates) are handed over at the end instead.
    ``forward``: a context entered around the forward and the loss only (the output
    kinds' hooks). Returns the detached loss.
    """
    keep = set() if keep is None else keep
    batch = _map_tensors(payload.batch, lambda t: t.to(device))
    own = RngState.capture(device)
    buffers = [b.detach().clone() for b in module.buffers()]
    saved = [p.grad for p in params]
    seen: set[int] = set()

    def hook_for(i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if i in keep:
                return
            if i in seen:
                raise _SharedAcrossPasses(i)
            seen.add(i)
            grad = param.grad
            param.grad = None
            if grad is not None:
                with torch.no_grad():
                    sink(i, grad)

        return hook

    handles = []
    try:
        for p in params:
            p.grad = None
        handles = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
        _set_rng(payload.rng_cpu, payload.rng_cuda, device)
        with forbid_collectives():
            with ExitStack() as stack:
                for dev, (enabled, dtype) in payload.autocast.items():
                    if enabled:
                        stack.enter_context(torch.autocast(dev, dtype=dtype))
                stack.enter_context(forward() if forward is not None else contextlib.nullcontext())
                loss = loss_fn(module, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise SDCError("loss_fn must return a scalar tensor")
            grad = None if payload.loss_grad is None else payload.loss_grad.to(loss.device)
            torch.autograd.backward(loss, grad_tensors=grad)
        with torch.no_grad():
            for i in sorted(keep):
                g = params[i].grad
                params[i].grad = None
                if g is not None:
                    sink(i, g)
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved, strict=True):
            p.grad = g
        own.restore(device)
        with torch.no_grad():
            for b, old in zip(module.buffers(), buffers, strict=True):
                b.copy_(old)
    return loss.detach()


def replay_complete(
    module: nn.Module,
    params: Sequence[nn.Parameter],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    payload: Payload,
    device: torch.device,
    sink_factory: Callable[[], GradSink],
    keep: set[int],
    forward: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> torch.Tensor:
    """:func:`replay`, once more with the parameters it found accumulated twice kept to
    the end (``keep`` grows; later replays of the run need no second try)."""
    while True:
        try:
            return replay(module, params, loss_fn, payload, device, sink_factory(), keep, forward)
        except _SharedAcrossPasses as shared:
            keep.add(int(shared.args[0]))
