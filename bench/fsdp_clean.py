"""Long clean runs under FSDP2 and HSDP: nobody named, training bitwise equal to unguarded.

Prints JSON. For each layout, one spawn of 6 gloo ranks on 3 emulated nodes (HSDP:
replicate 3 x shard 2; FSDP: one mesh dimension of 6) trains the drill model
(:mod:`sdc_agent.drill`) for ``--steps`` steps guarded, with check 3 (HSDP) or the update
check (FSDP) every step and the replay audit every ``--replay-every`` steps, then the same
run unguarded. It reports the verdicts, the last clean step, the audits compared, and
whether every rank's final weights and every loss equal the unguarded run's bit for bit.
This is the long counterpart of tests/distributed/test_fsdp.py's 12-step clean runs, kept
out of the test suite for its time (about a minute per layout on 2 cores).

    .venv/bin/python bench/fsdp_clean.py [--steps 200] [--replay-every 5] [--layouts hsdp,fsdp]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from sdc_agent.drill import Drill, run_drill

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--replay-every", type=int, default=5)
    parser.add_argument("--layouts", default="hsdp,fsdp")
    args = parser.parse_args()
    config = {
        "weights_every": 1,
        "replay_every": args.replay_every,
        "fingerprint_backend": "eager",
    }
    out: dict[str, Any] = {
        "benchmark": "fsdp_clean",
        "ranks": len(NODES),
        "nodes": len(set(NODES)),
        "steps": args.steps,
        "config": config,
        "layouts": {},
    }
    for layout in [x for x in args.layouts.split(",") if x]:
        started = time.perf_counter()
        guarded, plain = run_drill(
            NODES,
            [
                Drill(layout=layout, steps=args.steps, config=config),
                Drill(layout=layout, steps=args.steps, guarded=False),
            ],
        )
        r = guarded[0]
        out["layouts"][layout] = {
            "verdicts": sum(len(x.verdicts) for x in guarded),
            "all_applied": all(all(x.applied) for x in guarded),
            "last_clean_step": r.last_clean_step[-1],
            "replay_comparisons": r.replay_comparisons,
            "replay_mismatches": r.replay_mismatches,
            "final_weights_equal_unguarded": [x.final_fingerprint for x in guarded]
            == [x.final_fingerprint for x in plain],
            "losses_equal_unguarded": all(
                g.losses == p.losses for g, p in zip(guarded, plain, strict=True)
            ),
            "seconds": round(time.perf_counter() - started, 1),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
