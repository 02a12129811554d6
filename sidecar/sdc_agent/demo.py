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

DEFAULT_FAULT = "rank=3,step=13,site=grad_reduced,kind=relative"


def _node_names(count: int) -> list[str]:
    return [f"hyperpod-i-0d5f{n:013x}" for n in range(1, count + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdc_agent.demo", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3, help="emulated nodes (default 3)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="default 2")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--weights-every", type=int, default=10, help="check 3 interval")
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
    config = {"weights_every": args.weights_every, "fingerprint_backend": "eager"}

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
    for v in r0.verdicts:
        print(
            f"  step {v['step']:>3}  check={v['check']:<9} {v['classification']:<10} "
            f"suspect rank(s) {v['suspect_ranks']} on {v['suspect_nodes']}"
        )
        print(f"           {v['message']}")
        print(
            f"           suspect window: after step {v['last_clean_step']}, up to step {v['step']}"
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
        print("the agent found nothing (checks 1 and 3 cannot see every fault; see README)")
    print(f"wall time {elapsed:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
