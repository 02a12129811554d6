"""The smallest injected fault the replay audit catches under bf16 autocast (issue 21).

Prints JSON. Six gloo ranks on three emulated nodes on CPU train the drill's model (the
three-layer MLP, or the three-block GPT-2 with ``--model gpt2``) under bf16 autocast, with
run-to-run noise emulated in torch as in ``tests/distributed/test_bf16.py`` (no GPU: the
noise is emulated, not measured):

- ``none``: no noise (a bf16 job whose replays are bit for bit);
- ``forward``: ±1 bf16 ulp in 1 % of the middle layer's outputs (split-K GEMMs);
- ``backward``: ±1 to 4 bf16 ulp in 10 % of the middle layer's weight gradient (atomics).

For each noise, one run without a fault and one per fault size: a persistent fault in the
middle layer's output on rank 2 from step 11, with an audit every 5 steps and 20 steps in
all. ``ulp``: 1, 2, 4, 8 bf16 ulp in every element; ``relative``: 1e-4 to 3e-3 in every
element (a bf16 ulp is 2**-8 to 2**-7 relative, and the fault injector nudges an element the
error leaves unchanged by one ulp, so every size here is one or two ulp);
``ulp_one_element``: 1 to 512 bf16 ulp in one element (index 0; 8 ulp is about 6 %
relative, 128 ulp doubles the value, 512 multiplies it by 16). ``caught``: the right rank
was named, localized, within two audit intervals of the fault's start (by step 20), that
step not applied, and nobody named before the fault began. ``smallest_caught``: the smallest
size from which every larger size tried was caught too (``null``: not even the largest).

    .venv/bin/python bench/fault_sweep.py [--model mlp|gpt2] [--noise none,forward,backward]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Any

from sdc_agent.drill import GPT2_MIDDLE, Drill, DrillRank, run_drill
from sdc_agent.faults import FaultSpec

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
SUSPECT = 2
EVERY = 5
START = 11
STEPS = START - 1 + 2 * EVERY
CONFIG = {"replay_every": EVERY, "weights_every": EVERY, "fingerprint_backend": "eager"}
NOISE: dict[str, dict[str, Any]] = {
    "none": {},
    "forward": {"forward_noise": 0.01},
    "backward": {"grad_noise": True, "grad_noise_fraction": 0.1, "grad_noise_ulps": 4},
}
SIZES: dict[str, list[float]] = {
    "ulp": [1, 2, 4, 8],
    "relative": [1e-4, 3e-4, 1e-3, 3e-3],
    "ulp_one_element": [1, 8, 32, 128, 512],
}


def _fault(kind: str, size: float, target: str) -> tuple[FaultSpec, ...]:
    kw: dict[str, Any] = (
        {"kind": "relative", "relative_error": float(size)}
        if kind == "relative"
        else {"kind": "ulp", "ulps": int(size)}
    )
    return (
        FaultSpec(
            rank=SUSPECT,
            step=START,
            site="forward",
            target=target,
            index=0 if kind == "ulp_one_element" else None,
            persistent=True,
            **kw,
        ),
    )


def _judge(ranks: list[DrillRank]) -> dict[str, Any]:
    r = ranks[0]
    named = [v for v in r.verdicts if v["suspect_ranks"]]
    first = named[0] if named else None
    early = any(v["step"] < START for v in named)
    caught = (
        first is not None
        and not early
        and first["suspect_ranks"] == [SUSPECT]
        and first["localized"]
        and first["step"] <= STEPS
        and r.applied[first["step"] - 1] is False
    )
    return {
        "caught": caught,
        "step": None if first is None else first["step"],
        "corroborated": None if first is None else first.get("corroborated"),
        "suspects": None if first is None else first["suspect_ranks"],
        "localized": None if first is None else first["localized"],
        "evidence_kinds": None
        if first is None
        else len(first["evidence"].get("evidence_kinds", [])),
        "named_before_the_fault": early,
        "applied": sum(r.applied),
        "replay_mismatches": r.replay_mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt2"])
    parser.add_argument("--noise", default="none,forward,backward")
    args = parser.parse_args()
    noises = [n for n in args.noise.split(",") if n]
    target = "3" if args.model == "mlp" else GPT2_MIDDLE
    extra: dict[str, Any] = {"model": args.model, "width": 64 if args.model == "mlp" else 32}
    scenarios: dict[tuple[str, str, float | None], Drill] = {}
    for noise in noises:
        common = {**extra, **NOISE[noise], "autocast": True, "config": CONFIG}
        scenarios[(noise, "clean", None)] = Drill(steps=STEPS, noise_seed=1, **common)
        for kind, sizes in SIZES.items():
            for size in sizes:
                scenarios[(noise, kind, size)] = Drill(
                    steps=STEPS, noise_seed=2, faults=_fault(kind, size, target), **common
                )
    started = time.perf_counter()
    results = run_drill(NODES, list(scenarios.values()))
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {}
    for (noise, kind, tried_size), ranks in zip(scenarios, results, strict=True):
        per = out.setdefault(noise, {})
        if kind == "clean":
            r = ranks[0]
            per["clean"] = {
                "named": [v["suspect_ranks"] for v in r.verdicts if v["suspect_ranks"]],
                "applied": sum(r.applied),
                "steps": len(r.applied),
                "cannot_verify": any("cannot verify" in v["message"] for v in r.verdicts),
            }
            continue
        per.setdefault(kind, {"tried": {}})["tried"][str(tried_size)] = _judge(ranks)
    for per in out.values():
        for kind in SIZES:
            tried = per[kind]["tried"]
            smallest: float | None = None
            for size in reversed(SIZES[kind]):
                if not tried[str(size)]["caught"]:
                    break
                smallest = size
            per[kind]["smallest_caught"] = smallest
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "model": args.model,
                "ranks": len(NODES),
                "nodes": len(set(NODES)),
                "replay_every": EVERY,
                "fault_from_step": START,
                "steps": STEPS,
                "emulated_noise": True,
                "seconds": round(seconds, 1),
                "results": out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
