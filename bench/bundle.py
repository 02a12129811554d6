"""Evidence bundles: their size, the time to write one, and what writing costs training.

Prints JSON. For two models, the demo's (``examples/train.py``: 64-256-8, about 19 k
parameters) and a ~100 M-parameter MLP (six 4096x4096 layers, float32):

- ``bundle_bytes``: the bundle's files as written (weights, module, batch, RNG, manifest);
- ``snapshot_ms``: what the training thread spends taking the snapshot (a copy of the
  weights and the batch; once, on the slow path after a verdict);
- ``write_ms``: the background thread's serialize, hash, fsync and rename;
- ``step_ms_plain`` / ``step_ms_during_write`` and ``slowdown``: training steps (forward,
  backward, Adam; one thread) that start while a bundle is written in the background,
  against the block of steps right before each write (so both see the same machine), the
  median over ``--trials`` writes (the goal: ``slowdown`` at most 0.05);
  ``extra_ms_per_write``: what one write costs training in all.

    flock /tmp/hyperpod-cpu.lock .venv/bin/python bench/bundle.py [--trials 5] [--dir DIR]

``--device cuda`` trains on ``cuda:0``; the snapshot is then an asynchronous copy into
pinned host memory, and every timed step ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdc_agent.bundle import BundleWriter, Tolerance, recompute, reference_of, take_snapshot
from sdc_agent.protocol import Suspect
from sdc_agent.replay import Payload

SUSPECT = Suspect(rank=3, node="node-b", local_rank=1, pod="worker-1", gpu_uuid=None)


def demo_model() -> tuple[nn.Module, tuple[int, int], int]:
    """examples/train.py's net, and its batch (32 x 64 inputs, 8 outputs)."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)), (32, 64), 8


def mlp_100m() -> tuple[nn.Module, tuple[int, int], int]:
    """Six 4096x4096 layers with biases: 100.7 M parameters, 403 MB in float32."""
    layers: list[nn.Module] = []
    for i in range(6):
        layers.append(nn.Linear(4096, 4096))
        if i < 5:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers), (8, 4096), 4096


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def measure(
    name: str,
    build: Any,
    *,
    trials: int,
    directory: Path,
    device: torch.device,
    min_steps: int,
) -> dict[str, Any]:
    torch.manual_seed(0)
    model, (rows, cols), outputs = build()
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batch = (
        torch.randn(rows, cols, generator=g).to(device),
        torch.randn(rows, outputs, generator=g).to(device),
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()
        sync()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up: allocations, Adam state
        step()
    payload = Payload.capture(batch, copy=True)
    result, names = recompute(model, loss_fn, payload, device)
    reference = reference_of(result, names)
    writer = BundleWriter()
    trial_slowdowns: list[float] = []
    trial_extra: list[float] = []
    plain: list[float] = []
    during: list[float] = []
    snapshots: list[float] = []
    writes: list[float] = []
    sizes: list[int] = []
    steps_during: list[int] = []
    for trial in range(trials):
        # Baseline: steps right before, as many as overlapped the last write (at least
        # min_steps), so both sides see the same machine.
        block = max(min_steps, steps_during[-1] if steps_during else min_steps)
        before = [step() for _ in range(block)]
        plain += before
        started = time.perf_counter()
        snap = take_snapshot(
            module=model,
            payload=payload,
            reference=reference,
            suspect=SUSPECT,
            step=trial + 1,
            run_id="bench",
            tolerance=Tolerance(),
            loss_fn=loss_fn,
        )
        snapshots.append(time.perf_counter() - started)
        path = writer.submit(snap, directory / name)
        assert path is not None
        # Only the steps that start while the bundle is being written count as "during".
        overlapping: list[float] = []
        while not overlapping or not writer.wait(timeout=0):
            overlapping.append(step())
        during += overlapping
        steps_during.append(len(overlapping))
        base = statistics.fmean(before)
        trial_slowdowns.append(statistics.fmean(overlapping) / base - 1)
        trial_extra.append(sum(overlapping) - len(overlapping) * base)
        result_ = writer.results[-1]
        assert result_.written and result_.complete, result_.error
        writes.append(result_.seconds)
        sizes.append(sum(f.stat().st_size for f in path.iterdir()))
    writer.close()
    last = writer.results[-1].path
    files = {f.name: f.stat().st_size for f in sorted(last.iterdir())}
    plain_ms = statistics.fmean(plain) * 1e3
    during_ms = statistics.fmean(during) * 1e3
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "bundle_bytes": sizes[-1],
        "files": files,
        "snapshot_ms": {
            "median": round(statistics.median(snapshots) * 1e3, 3),
            "runs": [round(s * 1e3, 3) for s in snapshots],
        },
        "write_ms": {
            "median": round(statistics.median(writes) * 1e3, 3),
            "runs": [round(w * 1e3, 1) for w in writes],
        },
        "step_ms_plain": round(plain_ms, 3),
        "step_ms_during_write": round(during_ms, 3),
        # Per write: the overlapping steps against the block right before it.
        "slowdown": round(statistics.median(trial_slowdowns), 4),
        "slowdown_runs": [round(x, 4) for x in trial_slowdowns],
        # What one bundle write costs training in all (the steps that overlap it).
        "extra_ms_per_write": round(statistics.median(trial_extra) * 1e3, 3),
        "steps_during_write": steps_during,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where bundles are written (default: a temp dir)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-steps", type=int, default=10, help="steps per block at least")
    parser.add_argument("--models", default="demo,100m")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one training thread, as one rank of a CPU job
    device = torch.device(args.device)
    builders = {"demo": demo_model, "100m": mlp_100m}
    out: dict[str, Any] = {
        "machine": {
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "device": str(device),
            "torch_threads": torch.get_num_threads(),
        },
        "models": {},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in args.models.split(","):
            out["models"][name] = measure(
                name,
                builders[name],
                trials=args.trials,
                directory=Path(tmp),
                device=device,
                min_steps=args.min_steps,
            )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
