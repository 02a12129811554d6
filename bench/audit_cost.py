"""What one replay audit costs, in plain steps, and where its time goes.

Prints JSON. Two gloo ranks on two emulated nodes train ``bench/overhead.py``'s models (MLP
or GPT-2, fused Adam, no torch.compile, no bf16) with two Guards in each process, whose
steps alternate: ``off`` (every check off: the Guard's hook only) and ``audited`` (the replay
audit every ``--every`` steps, nothing else). ``bench/overhead.py`` holds one audit per 50
steps, the first of its process, so one sample (its ``audits``), with whatever the first
audit pays once; here every audit is a sample and the first is reported apart.

Per audit, against the median of the ``audited`` Guard's own unaudited steps, in units of the
``off`` Guard's median step (``*_steps``): ``wall`` the wall-clock time; ``cpu`` the rank's
own CPU time (``time.process_time``; it leaves out waiting for the other rank and, on a
shared machine, most of the time lost to other processes); ``faults`` the minor page faults
(memory the step touched for the first time since the system gave it; load does not move
them). ``--profile``: cProfile on rank 0 over the audited steps, the functions with the
most own time (ms per audit), the first audit apart from the later ones.

    .venv/bin/python bench/audit_cost.py [--model mlp|gpt2] [--every 4] [--audits 12]

For another tree's agent, put it first on ``PYTHONPATH``::

    PYTHONPATH=<tree>/sidecar:<tree>/common .venv/bin/python bench/audit_cost.py
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sdc_agent
from bench.overhead import OFF, VARIANTS, _runners
from sdc_agent.launch import spawn_local

OFF_NAME = "audit_cost_off"
AUDITED = "audit_cost_audited"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _top(profiles: list[cProfile.Profile], limit: int) -> list[dict[str, Any]]:
    """The functions with the most own time over ``profiles``, per audit."""
    if not profiles:
        return []
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    rows = []
    for (path, line, func), (_prim, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("/site-packages/")[-1].split("/sidecar/")[-1]
        rows.append(
            {
                "function": f"{where}:{line}({func})",
                "calls": round(calls / len(profiles), 1),
                "own_ms": round(tottime / len(profiles) * 1e3, 2),
                "cum_ms": round(cumtime / len(profiles) * 1e3, 2),
            }
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:limit]


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    del world
    VARIANTS[OFF_NAME] = OFF
    VARIANTS[AUDITED] = {**OFF, "replay_every": args.every}
    gpt2 = {"layers": 4, "width": 384, "vocab": 8192, "seq": 64}
    batch = args.gpt2_batch if args.model == "gpt2" else args.batch
    runners = _runners(
        [OFF_NAME, AUDITED],
        torch.device("cpu"),
        batch,
        2048,
        False,
        args.model,
        gpt2,
        False,
        rank,
    )
    run_off, _ = runners[OFF_NAME]
    run_audited, guard = runners[AUDITED]
    assert guard is not None
    profile = args.profile and rank == 0
    rows: dict[str, list[tuple[float, float, int]]] = {"off": [], "plain": [], "audit": []}
    profiles: list[cProfile.Profile] = []
    total = args.every * args.audits + args.warmup
    for step in range(1, total + 1):
        for name, run in (("off", run_off), ("audited", run_audited)):
            before = guard.replay_stats.audits
            prof = cProfile.Profile() if profile and name == "audited" else None
            faults, cpu, wall = _faults(), time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            run()
            if prof is not None:
                prof.disable()
            sample = (
                time.perf_counter() - wall,
                time.process_time() - cpu,
                _faults() - faults,
            )
            if step <= args.warmup:
                continue
            if name == "off":
                rows["off"].append(sample)
            elif guard.replay_stats.audits > before:
                rows["audit"].append(sample)
                if prof is not None:
                    profiles.append(prof)
            else:
                rows["plain"].append(sample)
    guard.close(timeout=5.0)
    return {"rows": rows, "profiles": [_top(profiles[:1], args.top), _top(profiles[1:], args.top)]}


def _summary(rows: dict[str, list[tuple[float, float, int]]]) -> dict[str, Any]:
    def med(name: str, k: int) -> float:
        return statistics.median(r[k] for r in rows[name])

    step_wall, step_cpu = med("off", 0), med("off", 1)
    base_wall, base_cpu, base_faults = med("plain", 0), med("plain", 1), med("plain", 2)

    def cost(r: tuple[float, float, int]) -> dict[str, float]:
        return {
            "wall_steps": round((r[0] - base_wall) / step_wall, 3),
            "cpu_steps": round((r[1] - base_cpu) / step_cpu, 3),
            "faults": int(r[2] - base_faults),
        }

    audits = [cost(r) for r in rows["audit"]]
    later = audits[1:]
    return {
        "off_step_ms": {"wall": round(step_wall * 1e3, 2), "cpu": round(step_cpu * 1e3, 2)},
        "unaudited_step_ms": {"wall": round(base_wall * 1e3, 2), "cpu": round(base_cpu * 1e3, 2)},
        "audits": len(audits),
        "first_audit": audits[0] if audits else None,
        "later_audits_median": {
            k: round(statistics.median(a[k] for a in later), 3)
            for k in ("wall_steps", "cpu_steps", "faults")
        }
        if later
        else None,
        "each_audit": audits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt2"), default="mlp")
    parser.add_argument("--every", type=int, default=4, help="replay_every of the audited Guard")
    parser.add_argument("--audits", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (before any audit)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--gpt2-batch", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="cProfile the audited steps")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.every:
        parser.error("--warmup: must be below --every, so the first audit is measured")
    results = spawn_local(worker, ["bench-node-0", "bench-node-1"], (args,))
    out: dict[str, Any] = {
        "benchmark": "audit_cost",
        "sdc_agent": sdc_agent.__file__,
        "torch": torch.__version__,
        "model": args.model,
        "optimizer": "Adam(fused=True)",
        "compile": False,
        "ranks": 2,
        "replay_every": args.every,
        "profiled": args.profile,
        "per_rank": [_summary(r["rows"]) for r in results],
    }
    if args.profile:
        out["profile_rank0"] = {
            "first_audit": results[0]["profiles"][0],
            "later_audits": results[0]["profiles"][1],
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
