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

``--seeds 3,4,5`` repeats the sweep with those noise seeds (each seed's clean run and fault
runs draw from it; by default the clean run draws from seed 1 and the fault runs from seed 2),
``--sizes ulp=2,8 relative=0.001`` restricts the sizes tried; ``by_seed`` then holds each
seed's results and ``over_seeds`` counts, per size, the seeds where it was caught and those
where any audit named a healthy rank (``healthy_named``: every verdict of the run, not only
the first).
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
        "healthy_named": sorted({r for v in named for r in v["suspect_ranks"]} - {SUSPECT}),
        "applied": sum(r.applied),
        "replay_mismatches": r.replay_mismatches,
    }


def _sweep(
    noises: list[str],
    sizes: dict[str, list[float]],
    extra: dict[str, Any],
    target: str,
    seeds: tuple[int, int],
) -> dict[tuple[str, str, float | None], Drill]:
    clean_seed, fault_seed = seeds
    scenarios: dict[tuple[str, str, float | None], Drill] = {}
    for noise in noises:
        common = {**extra, **NOISE[noise], "autocast": True, "config": CONFIG}
        scenarios[(noise, "clean", None)] = Drill(steps=STEPS, noise_seed=clean_seed, **common)
        for kind, tried in sizes.items():
            for size in tried:
                scenarios[(noise, kind, size)] = Drill(
                    steps=STEPS, noise_seed=fault_seed, faults=_fault(kind, size, target), **common
                )
    return scenarios


def _results(
    scenarios: dict[tuple[str, str, float | None], Drill],
    results: list[list[DrillRank]],
    sizes: dict[str, list[float]],
) -> dict[str, Any]:
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
        for kind in sizes:
            tried = per[kind]["tried"]
            smallest: float | None = None
            for size in reversed(sizes[kind]):
                if not tried[str(size)]["caught"]:
                    break
                smallest = size
            per[kind]["smallest_caught"] = smallest
    return out


def _over_seeds(by_seed: dict[str, dict[str, Any]], sizes: dict[str, list[float]]) -> Any:
    summary: dict[str, Any] = {}
    for seed, out in by_seed.items():
        for noise, per in out.items():
            mine = summary.setdefault(noise, {"seeds": 0, "clean_named_healthy": []})
            mine["seeds"] += 1
            if per["clean"]["named"]:
                mine["clean_named_healthy"].append(int(seed))
            for kind in sizes:
                for size, r in per[kind]["tried"].items():
                    row = mine.setdefault(f"{kind}={size}", {"caught": [], "healthy_named": []})
                    if r["caught"]:
                        row["caught"].append(int(seed))
                    if r["healthy_named"]:
                        row["healthy_named"].append(int(seed))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt2"])
    parser.add_argument("--noise", default="none,forward,backward")
    parser.add_argument("--seeds", default="", help="noise seeds, comma-separated")
    parser.add_argument("--sizes", nargs="*", default=[], help="KIND=SIZE,SIZE ...")
    args = parser.parse_args()
    noises = [n for n in args.noise.split(",") if n]
    sizes = dict(SIZES)
    if args.sizes:
        sizes = {}
        for item in args.sizes:
            kind, _, listed = item.partition("=")
            if kind not in SIZES or not listed:
                parser.error(
                    f"--sizes: expected KIND=SIZE,... with KIND in {list(SIZES)}, got {item!r}"
                )
            sizes[kind] = [float(x) for x in listed.split(",")]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    target = "3" if args.model == "mlp" else GPT2_MIDDLE
    extra: dict[str, Any] = {"model": args.model, "width": 64 if args.model == "mlp" else 32}
    runs = [(s, s) for s in seeds] or [(1, 2)]
    plans = [_sweep(noises, sizes, extra, target, r) for r in runs]
    started = time.perf_counter()
    drills = [d for plan in plans for d in plan.values()]
    results = run_drill(NODES, drills)
    seconds = time.perf_counter() - started
    outs = []
    for plan in plans:
        outs.append(_results(plan, results[: len(plan)], sizes))
        results = results[len(plan) :]
    report: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "ranks": len(NODES),
        "nodes": len(set(NODES)),
        "replay_every": EVERY,
        "fault_from_step": START,
        "steps": STEPS,
        "emulated_noise": True,
        "seconds": round(seconds, 1),
    }
    if seeds:
        by_seed = {str(s): out for s, out in zip(seeds, outs, strict=True)}
        report["sizes"] = {k: v for k, v in sizes.items()}
        report["over_seeds"] = _over_seeds(by_seed, sizes)
        report["by_seed"] = by_seed
    else:
        report["results"] = outs[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
