"""Judging replay evidence per kind: the learned noise of each kind, and which kinds can
still separate a faulty rank.

A comparison of two computations of one micro-batch carries several **kinds** of evidence
(:class:`~sdc_agent.evidence.Comparison`): the loss, the gradients of each layer, and the
forward output of each module. Each
kind is judged on its own against the noise learned for it (:class:`KindNoise`): noise in
one layer's gradients (atomics in its backward) or in the loss (a forward that is not
reproducible) never raises another kind's threshold, so a fault that one kind shows is
seen however noisy the others are. A rank is accused on whichever kind separates it.

A kind whose own run-to-run noise exceeds what rounding in the computation's dtype can
produce (:data:`~sdc_agent.evidence.NOISE_CAPS`) cannot separate a fault from noise: it
goes **blind**, saying why (the noise measured against the cap, per dtype), and the other
kinds keep watching. The audit is blind only when every kind is.

Every rank updates the model from the same gathered table, so every rank holds the same
thresholds. This module is pure (no collectives, no tensors): layouts other than DDP
(FSDP2, HSDP) reuse it through :class:`NoiseModel` and :func:`split_by_kind`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .evidence import HEADROOM, LOSS, Comparison, Tolerance, is_output_kind, kind_differs

__all__ = ["BLIND_MARGIN", "KindNoise", "NoiseModel", "split_by_kind"]

_TINY = 1e-300

BLIND_MARGIN = 2.0
"""A kind whose measured noise reaches ``cap / BLIND_MARGIN`` cannot separate: its
differences at the cap are coin flips between noise and fault. Measured in the drills
(docs/agent.md): ±1 bf16 ulp in 1 % of a layer's outputs moves the loss by up to 1e-4
and downstream gradient statistics by up to about 2e-3 (working, against bf16's 7.8e-3);
±4 ulp in 10 % of a layer's gradient moves that layer's statistics by 4e-3 to 1e-2
(blind)."""


@dataclass(slots=True)
class KindNoise:
    """The learned noise of one kind of evidence."""

    name: str
    job: float = 0.0
    """Tolerance for the whole job (run-to-run noise everywhere)."""
    per_rank: dict[int, float] = field(default_factory=dict)
    """Tolerance per rank (a process that computes differently, such as an autotuned
    kernel)."""
    measured: float = 0.0
    """The largest difference taken for noise in this kind so far."""
    blind: str | None = None
    """Why this kind cannot separate a faulty rank (``None``: it can)."""

    def tolerance(self, ranks: Iterable[int]) -> float:
        return max([self.job, *(self.per_rank.get(r, 0.0) for r in ranks)])

    @property
    def largest(self) -> float:
        return max([self.job, *self.per_rank.values()])


@dataclass(slots=True)
class NoiseModel:
    """Tolerances learned from the job's own audits, per kind (see the module docstring)."""

    cap: float
    """The dtype cap in force (see :data:`~sdc_agent.evidence.NOISE_CAPS`); the audit sets
    it per audit from the dtype the computation ran in."""
    kind_names: Sequence[str] = (LOSS, "gradients")
    dtype: str = "float32"
    """The dtype the cap is for, in messages."""
    kinds: list[KindNoise] = field(default_factory=list)
    audits: int = 0
    """Audits recorded so far; the first one sets the baseline."""
    observed: int = 0
    """Comparisons that had any bitwise difference."""
    compared: int = 0
    _backward: list[KindNoise] = field(default_factory=list, init=False, repr=False)
    """The loss and the gradient kinds (those that see the backward)."""
    _gradients: list[KindNoise] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.kinds:
            self.kinds = [KindNoise(n) for n in self.kind_names]
        self._backward = [k for k in self.kinds if not is_output_kind(k.name)]
        self._gradients = self._backward[1:]

    # -- what is in force ------------------------------------------------------------------

    def tolerances(self, ranks: Iterable[int]) -> list[float]:
        """The tolerance in force for each kind in a comparison between ``ranks``."""
        ranks = list(ranks)
        return [k.tolerance(ranks) for k in self.kinds]

    def tolerance(self, ranks: Iterable[int]) -> Tolerance:
        """The loss's tolerance and the largest gradient kind's, between ``ranks`` (blind
        kinds left out)."""
        ranks = list(ranks)
        grads = [k.tolerance(ranks) for k in self._gradients if k.blind is None]
        return Tolerance(loss=self.kinds[0].tolerance(ranks), gradients=max([0.0, *grads]))

    def differs(self, k: int, c: Comparison, ranks: Iterable[int]) -> bool:
        """Kind ``k`` of ``c`` is evidence between ``ranks`` (never for a blind kind)."""
        kind = self.kinds[k]
        return kind.blind is None and kind_differs(c.kinds[k], kind.tolerance(ranks))

    def within_cap(self, k: int, c: Comparison) -> bool:
        return c.kinds[k].rel <= self.cap

    def loudest(self, c: Comparison) -> float:
        """``c``'s largest difference in the kinds that still work."""
        return max([0.0, *(c.kinds[k].rel for k in self.working)])

    @property
    def working(self) -> list[int]:
        """The kinds that can still separate a faulty rank."""
        return [i for i, k in enumerate(self.kinds) if k.blind is None]

    @property
    def blind(self) -> bool:
        """Neither the loss nor any gradient kind can separate a faulty rank any more: the
        audit vouches for nothing (the output kinds, which see the forward only, may still
        accuse). Read at every step (whether the audit vouches): stops at the first working
        kind, the loss as a rule, rather than listing every layer's."""
        return all(k.blind is not None for k in self._backward)

    @property
    def largest(self) -> float:
        """The largest gradient tolerance in force in any gradient kind that still works
        (0: bit-reproducible so far)."""
        return max([0.0, *(k.largest for k in self._gradients if k.blind is None)])

    @property
    def largest_loss(self) -> float:
        return self.kinds[0].largest

    @property
    def bit_reproducible(self) -> bool | None:
        """True while every comparison so far was bitwise equal; ``None`` before any."""
        if self.compared == 0:
            return None
        return self.observed == 0

    def thresholds(self) -> dict[str, float | None]:
        """Per kind, the largest tolerance in force (``None``: blind)."""
        return {k.name: None if k.blind else k.largest for k in self.kinds}

    def in_force(self, most: int) -> list[tuple[str, float | None, float, bool]]:
        """Per kind ``(name, threshold, noise measured, blind)``, for heartbeats: at most
        ``most`` kinds, the loss first, then the blind kinds, then the working kinds with
        the largest thresholds (in kind order within each)."""
        rows = [
            (k.name, None if k.blind else k.largest, _finite(k.measured), k.blind is not None)
            for k in self.kinds
        ]
        loss, rest = rows[:1], rows[1:]
        blind = [r for r in rest if r[3]]
        working = [r for r in rest if not r[3]]
        keep = {
            id(r)
            for r in sorted(working, key=lambda r: -(r[1] or 0.0))[: max(0, most - 1 - len(blind))]
        }
        return (loss + blind + [r for r in working if id(r) in keep])[:most]

    def count(self, comparisons: Iterable[Comparison]) -> None:
        for c in comparisons:
            self.compared += 1
            self.observed += not c.bitwise_equal

    # -- learning --------------------------------------------------------------------------

    def _headroom(self, magnitude: float) -> float:
        # A bitwise difference that moved no statistic still needs a tolerance above 0,
        # or it would be evidence every time.
        return min(self.cap, max(HEADROOM * magnitude, _TINY))

    def learn_rank(self, k: int, rank: int, c: Comparison) -> bool:
        """Take kind ``k`` of ``c`` for noise of ``rank``'s process; false above the cap."""
        d = c.kinds[k]
        if d.equal:
            return True
        if d.rel > self.cap:
            return False
        kind = self.kinds[k]
        kind.per_rank[rank] = max(kind.per_rank.get(rank, 0.0), self._headroom(d.rel))
        self._measured(k, d.rel)
        return True

    def learn_job(self, k: int, comparisons: Iterable[Comparison]) -> bool:
        """Take kind ``k`` of ``comparisons`` for the whole job's noise; false (nothing
        learned) if any is above the cap."""
        diffs = [c.kinds[k] for c in comparisons if not c.kinds[k].equal]
        if any(d.rel > self.cap for d in diffs):
            return False
        kind = self.kinds[k]
        for d in diffs:
            kind.job = max(kind.job, self._headroom(d.rel))
            self._measured(k, d.rel)
        return True

    def _measured(self, k: int, rel: float) -> None:
        kind = self.kinds[k]
        kind.measured = max(kind.measured, rel)
        if kind.blind is None and BLIND_MARGIN * kind.measured > self.cap:
            self.go_blind(
                k,
                kind.measured,
                f"its run-to-run noise reaches 1/{BLIND_MARGIN:g} of the cap, so a fault "
                "above the cap need not stand clear of it",
            )

    def excuse(self, k: int, rank: int) -> None:
        """From now on, kind ``k``'s differences up to the cap are noise for ``rank``: a
        rounding-level difference the recheck could not separate from a kernel choice,
        reported once and never again (which a repeat rule would turn into a
        quarantine)."""
        self.kinds[k].per_rank[rank] = self.cap

    def go_blind(self, k: int, measured: float, why: str) -> str:
        """Kind ``k`` cannot separate a faulty rank: its noise (``measured``) is above the
        cap, or within :data:`~sdc_agent.evidence.HEADROOM` of it. Returns the sentence
        that says so."""
        kind = self.kinds[k]
        kind.measured = max(kind.measured, measured)
        shown = "non-finite" if not math.isfinite(measured) else f"{measured:.3g}"
        kind.blind = (
            f"{kind.name} cannot tell a fault from noise: {why} (noise measured {shown} "
            f"relative, against the cap of {self.cap:g} for {self.dtype}, what rounding "
            "can produce)"
        )
        return kind.blind

    # -- words -----------------------------------------------------------------------------

    def describe(self) -> str:
        quiet = all(k.largest == 0 and k.blind is None for k in self.kinds)
        if self.bit_reproducible is None and quiet:
            return "not measured yet"
        if quiet:
            return "bit-reproducible so far: any difference is evidence"
        exact = [k.name for k in self.kinds if k.largest == 0 and k.blind is None]
        parts = []
        noisy = [k for k in self.kinds if k.largest > 0 and k.blind is None]
        for k in noisy:
            parts.append(_describe(k))
        if exact:
            parts.append(_compress(exact) + ": compared bit for bit")
        blind = [k for k in self.kinds if k.blind is not None]
        if blind:
            parts.append(
                "blind: "
                + _compress([k.name for k in blind])
                + f" (above {self.cap:g} in {self.dtype})"
            )
        return "; ".join(parts)


def _compress(names: Sequence[str]) -> str:
    if len(names) <= 4:
        return ", ".join(names)
    return ", ".join(names[:3]) + f" and {len(names) - 3} more"


def _describe(k: KindNoise) -> str:
    ranks = {r: t for r, t in sorted(k.per_rank.items()) if t > k.job}
    listed = ", ".join(f"rank {r} up to {t:.3g}" for r, t in ranks.items())
    if k.job == 0:
        return f"{k.name}: bit for bit, except in comparisons involving {listed}"
    text = f"{k.name}: relative differences up to {k.job:.3g} are noise"
    return text + (f" (in comparisons involving {listed})" if ranks else "")


def split_by_kind(
    model: NoiseModel,
    comparisons: Mapping[int, Comparison],
    replayer_of: Mapping[int, int],
) -> dict[int, list[int]]:
    """Per working kind, the owners ``p`` whose comparison with their replay is evidence
    in that kind (kinds with none are left out)."""
    out: dict[int, list[int]] = {}
    for k in model.working:
        hit = [p for p, c in comparisons.items() if model.differs(k, c, (p, replayer_of[p]))]
        if hit:
            out[k] = hit
    return out


def _finite(noise: float) -> float:
    """A measured noise as a heartbeat may carry it (the protocol takes finite numbers
    only): a non-finite one (a kind gone blind on an infinite difference) is the largest
    float, which says the same to a reader."""
    return noise if math.isfinite(noise) else sys.float_info.max
