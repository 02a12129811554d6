"""The verified snapshot's time at detection: from the verdict to the checkpoint's
``verified`` marker (and its ``checkpoint`` report), at ~10 M and ~100 M parameters.

Prints JSON. Four gloo ranks on CPU, one per emulated node (the audit needs three nodes to
name a suspect), one thread each, train the MLP of bench/overhead.py (hidden 2048: 9.45 M
parameters; hidden 9000: 100.5 M) with Adam under DDP and ``snapshot_copies=2``, the audit
and the weight check every 2 steps. A persistent gradient fault on rank 1 from step 3 is
caught by the audit of step 4, when ``last_clean_step`` is 2; the healthy ranks write the
snapshot of step 2 as a DCP checkpoint under a temporary directory (rank 1's slices by their
second holder) and one of them marks it verified.

``write_seconds`` is ``guard.snapshot_write.seconds`` on the rank that marked it: from the
start of the write at detection (right after the verdict went to the reporter, in the step
that caught it) to the marker written and the ``checkpoint`` report queued (the reporter
sends it from its thread; none runs here). Also: the whole detecting step against the
audited step before it, one snapshot copy (``take``) of the clean state, the host memory
each rank keeps (``bytes_per_rank``) against one replica's state, and the bytes on disk.

``--layout fsdp``: the same MLP under pure FSDP2 (``fully_shard`` on each Linear, then the
root, over one mesh dimension of all ranks), where each rank's shards also cross the network
to the next node at every take (so ``take_seconds`` includes that exchange); the fault is a
persistent relative error in the first layer's forward on rank 1 (a ``grad_local`` fault
does not fire during FSDP's replay: it would be judged transient).

    .venv/bin/python bench/snapshot.py [--sizes 2048,9000] [--ranks 4] [--layout ddp|fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.overhead import IN, _fully_shard, _mesh, make_model  # noqa: E402
from sdc_agent.launch import spawn_local  # noqa: E402

CLEAN, FAULT, CAUGHT = 2, 3, 4


def worker(
    rank: int, world: int, hidden: int, batch: int, root: str, layout: str
) -> dict[str, Any]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import FaultSpec, Guard, GuardConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = make_model(hidden)
    if layout == "fsdp":
        model = net = _fully_shard(net, _mesh("fsdp", torch.device("cpu")))
        fault = FaultSpec(
            rank=1,
            step=FAULT,
            site="forward",
            kind="relative",
            persistent=True,
            target="0",
            index=None,
        )
    else:
        fault = FaultSpec(rank=1, step=FAULT, site="grad_local", kind="relative", persistent=True)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    if layout == "ddp":
        model = DistributedDataParallel(net)

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    config = GuardConfig(
        replay_every=CLEAN,
        weights_every=CLEAN,
        fingerprint_backend="eager",
        snapshot_copies=2,
        snapshot_dir=root,
        snapshot_write_seconds=60.0,
        faults=(fault,),
    )
    guard = Guard(model, optimizer, loss_fn, config=config, reporter=None)
    guard.snapshot_state("data", lambda: {"step": guard.step_count})
    step_seconds: dict[int, float] = {}
    take_seconds = None
    for step in range(1, CAUGHT + 1):
        g = torch.Generator().manual_seed(step * 101 + rank)
        x = torch.randn(batch, IN, generator=g)
        started = time.perf_counter()
        result = guard.step((x, x * 0.5))
        step_seconds[step] = time.perf_counter() - started
        if step == CLEAN:
            snapshot = guard.snapshot
            assert snapshot is not None and snapshot.step == CLEAN, "no snapshot of step 2"
            started = time.perf_counter()
            snapshot.take(CLEAN)  # the clean state again (IDLE after step 2): one copy's cost
            take_seconds = time.perf_counter() - started
        if result.verdicts:
            break
    snapshot = guard.snapshot
    assert snapshot is not None
    written = guard.snapshot_write
    out = {
        "rank": rank,
        "parameters": sum(p.numel() for p in net.parameters()),
        "verdict_step": guard.step_count,
        "last_clean_step": guard.last_clean_step,
        "step_seconds": step_seconds,
        "take_seconds": take_seconds,
        "state_bytes": snapshot.state_bytes(),
        "bytes_per_rank": snapshot.bytes_per_rank(),
        "copies": snapshot.copies,
        "write": None
        if written is None
        else {
            "step": written.step,
            "path": written.path,
            "complete": written.complete,
            "writers": list(written.writers),
            "wrote": list(written.wrote),
            "seconds": written.seconds,
            "reason": written.reason,
        },
    }
    guard.close()
    return out


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(hidden: int, ranks: int, batch: int, base: Path, layout: str) -> dict[str, Any]:
    root = base / f"hidden-{hidden}"
    root.mkdir(parents=True)
    nodes = [f"bench-node-{i}" for i in range(ranks)]
    env = {"OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    results = spawn_local(worker, nodes, (hidden, batch, str(root), layout), env=env, timeout=1200)
    wall = time.perf_counter() - started
    first = results[0]
    writes = {r["rank"]: r["write"] for r in results if r["write"]}
    path = next((w["path"] for w in writes.values() if w["complete"]), None)
    marker = Path(f"{path}.sdc.json") if path else None
    verified = bool(marker and marker.is_file() and json.loads(marker.read_text())["verified"])
    writers = [w["seconds"] for w in writes.values() if w["wrote"]]
    caught = first["step_seconds"].get(CAUGHT)
    out = {
        "hidden": hidden,
        "parameters": first["parameters"],
        "verdict_step": first["verdict_step"],
        "last_clean_step": first["last_clean_step"],
        "verified": verified,
        "write_seconds": {rank: round(w["seconds"], 3) for rank, w in writes.items()},
        "write_seconds_max": round(max(writers), 3) if writers else None,
        "slices_written_by_rank": {rank: w["wrote"] for rank, w in writes.items()},
        "audited_step_seconds": round(first["step_seconds"][CLEAN], 3),
        "detecting_step_seconds": None if caught is None else round(caught, 3),
        "take_seconds": round(max(r["take_seconds"] or 0.0 for r in results), 3),
        "state_bytes": first["state_bytes"],
        "bytes_per_rank": [r["bytes_per_rank"] for r in results],
        "share_of_state_per_rank": round(
            max(r["bytes_per_rank"] for r in results) / first["state_bytes"], 3
        ),
        "copies": first["copies"],
        "bytes_on_disk": _du(Path(path)) if path else 0,
        "wall_seconds": round(wall, 1),
    }
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,9000", help="MLP hidden widths (9.45 M, 100.5 M)")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks, one per node (>= 3)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument(
        "--layout", choices=("ddp", "fsdp"), default="ddp", help="DDP, or pure FSDP2 over all ranks"
    )
    args = parser.parse_args()
    if args.ranks < 3:
        parser.error("--ranks: at least 3 (the audit names a suspect only with three nodes)")
    base = Path(tempfile.mkdtemp(prefix="sdc-snapshot-bench-", dir=args.dir))
    try:
        sizes = [
            measure(int(h), args.ranks, args.batch, base, args.layout)
            for h in args.sizes.split(",")
            if h
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {
        "benchmark": "snapshot",
        "torch": torch.__version__,
        "device": "cpu",
        "backend": "gloo",
        "layout": args.layout,
        "ranks": args.ranks,
        "nodes": args.ranks,
        "threads_per_rank": 1,
        "cpus": os.cpu_count(),
        "optimizer": "Adam",
        "snapshot_copies": 2,
        "batch": args.batch,
        "directory": str(args.dir or tempfile.gettempdir()),
        "sizes": sizes,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
