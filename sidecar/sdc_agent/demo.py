"""Local demo: DDP on emulated nodes, one corrupted rank, and what the agent found.

Runs ``python -m sdc_agent.demo``: a clean run, then the same run with a fault on one
rank; exits 0 when the clean run raised nothing and the faulty run named the right rank.
"""

from __future__ import annotations

import argparse
import sys
import time

from .drill import Drill, run_drill
from .errors import ConfigError
from .faults import FaultSpec, parse_faults

# A persistent 0.0025 % error in one hidden layer's output on rank 3 (4.0001 for 4.0000):
# finite and averaged into every replica, so only the replay audit can see it.
DEFAULT_FAULT = "rank=3,step=13,site=forward,kind=relative,persistent=true,target=3,index=all"


def _node_names(count: int) -> list[str]:
    return [f"hyperpod-i-0d5f{n:013x}" for n in range(1, count + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdc_agent.demo", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3, help="emulated nodes (default 3)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="default 2")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--weights-every", type=int, default=5, help="check 3 interval")
    parser.add_argument("--replay-every", type=int, default=5, help="check 2 interval")
    parser.add_argument(
        "--fault",
        default=DEFAULT_FAULT,
        help=f"fault spec, as HYPERPOD_SDC_FAULTS (default {DEFAULT_FAULT!r})",
    )
    args = parser.parse_args(argv)
    try:
        faults: tuple[FaultSpec, ...] = parse_faults(args.fault)
    except ConfigError as exc:
        parser.error(str(exc))
    nodes = [n for n in _node_names(args.nodes) for _ in range(args.ranks_per_node)]
    if any(f.rank >= len(nodes) for f in faults):
        parser.error(f"--fault: the world has ranks 0..{len(nodes) - 1}")
    config = {
        "weights_every": args.weights_every,
        "replay_every": args.replay_every,
        # The demo's model is tiny: compiling fingerprint kernels would cost more than it saves.
        "fingerprint_backend": "eager",
    }

    print("hyperpod-sdc local demo")
    print(f"  real: the sdc_agent Guard inside {len(nodes)} torch.distributed (gloo) processes")
    print(f"  emulated: {args.nodes} nodes on this machine (NODE_NAME per process), CPU only")
    for i, node in enumerate(dict.fromkeys(nodes)):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        print(f"    node {i}: {node}  ranks {ranks}")
    print(f"  injected: {args.fault}")
    print()
    start = time.perf_counter()
    clean, faulty = run_drill(
        nodes,
        [
            Drill(steps=args.steps, config=config),
            Drill(steps=args.steps, faults=faults, config=config),
        ],
    )
    elapsed = time.perf_counter() - start

    ok = True
    print(
        f"clean run: {args.steps} steps, {len(clean[0].verdicts)} verdict(s), "
        f"last clean step {clean[0].last_clean_step[-1]}"
    )
    ok &= not clean[0].verdicts
    r0 = faulty[0]
    print(
        f"faulty run: {args.steps} steps, {len(r0.verdicts)} verdict(s), "
        f"steps not applied: {[s + 1 for s, a in enumerate(r0.applied) if not a] or 'none'}"
    )
    if r0.verdicts:
        v = r0.verdicts[0]
        kind = {True: "transient", False: "persistent"}.get(v["transient"], "")
        print(
            f"  first verdict, step {v['step']}: {v['check']} check, {v['classification']} {kind}"
        )
        print(f"    suspect rank(s) {v['suspect_ranks']} on node(s) {v['suspect_nodes']}")
        print(f"    {v['message']}")
        print(f"    suspect window: after step {v['last_clean_step']}, up to step {v['step']}")
        later = sorted({x["step"] for x in r0.verdicts[1:]})
        if later:
            print(
                f"  later verdicts at steps {later}: the fault persists; those steps were held back"
            )
    if r0.verdicts:
        first = r0.verdicts[0]
        wanted = {f.rank for f in faults}
        named = set(first["suspect_ranks"])
        ok &= bool(named) and named <= wanted
        print()
        print(
            f"injected on rank(s) {sorted(wanted)}; the agent suspects {sorted(named)}: "
            + ("correct" if ok else "WRONG")
        )
    else:
        ok = False
        print("the agent found nothing (a fault that changes no result cannot be seen)")
    print(f"wall time {elapsed:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
