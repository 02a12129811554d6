"""A stand-in training script for tests/unit/test_confirm.py, run as ``__main__`` like a
real one (its classes pickle as ``__main__.Net``).

    python tests/unit/training_script.py OUT pickle|factory [cuda]

It plays one audited micro-batch of the replay audit: the suspect (rank 3, local rank 1 of
node-b) computes it on its broken GPU (the agent's fault injection, the same spec the
tests give the confirmation), the healthy replayer (rank 5 on node-c) recomputes it, and
writes the evidence bundle under OUT/ckpt. ``factory`` gives the model an attribute that
does not pickle, so the bundle must name a factory. It touches OUT/main-ran: a
confirmation that imports this script must not run ``main()``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdc_agent.bundle import BundleSettings, BundleWriter, Tolerance, recompute, reference_of
from sdc_agent.faults import FaultInjector, parse_faults
from sdc_agent.protocol import Suspect
from sdc_agent.replay import Payload

FAULT = "rank=3,step=23,site=forward,kind=relative,persistent=true,index=all"
"""GPU 1 of node-b returns 4.0001 for 4.0000 from step 23 on (the demo's broken GPU)."""
STEP = 30
SUSPECT = Suspect(rank=3, node="node-b", local_rank=1, pod="train-worker-0", gpu_uuid=None)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Opaque(Net):
    """Holds a lambda: does not pickle, so only a factory rebuilds it."""

    def __init__(self) -> None:
        super().__init__()
        self.post = lambda t: t


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def build() -> tuple[nn.Module, Any]:
    """The bundle factory: the model with other (wrong) weights, which the bundle replaces."""
    torch.manual_seed(999)
    return Opaque(), loss_fn


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    device = torch.device("cuda", 0) if "cuda" in sys.argv[3:] else torch.device("cpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "main-ran").touch()
    torch.manual_seed(0)
    model = (Opaque() if mode == "factory" else Net()).to(device)
    g = torch.Generator().manual_seed(STEP)
    batch = (torch.randn(16, 8, generator=g).to(device), torch.randn(16, 4, generator=g).to(device))
    payload = Payload.capture(batch, copy=True)

    broken = FaultInjector(parse_faults(FAULT), rank=SUSPECT.rank)
    broken.step = STEP
    broken.attach(model)
    wrong, names = recompute(model, loss_fn, payload, device)
    broken.detach()
    suspect_result = reference_of(wrong, names)

    right, names = recompute(model, loss_fn, payload, device)
    reference = reference_of(right, names)
    assert reference["loss_bits"] != suspect_result["loss_bits"], "the fault must bite"

    settings = BundleSettings(bundle_factory="__main__:build" if mode == "factory" else None)
    writer = BundleWriter()
    path = writer.capture(
        out / "ckpt",
        module=model,
        payload=payload,
        reference=reference,
        suspect=SUSPECT,
        step=STEP,
        run_id="run-7",
        tolerance=Tolerance(),
        loss_fn=loss_fn,
        settings=settings,
        work_of=SUSPECT.rank,
        recorded_by={"rank": 5, "node": "node-c"},
        suspect_result={
            "loss_bits": suspect_result["loss_bits"],
            "gradient_fingerprint": suspect_result["gradient_fingerprint"],
        },
    )
    assert writer.close(timeout=120)
    (result,) = writer.results
    assert result.written, result.error
    print(json.dumps({"bundle": str(path), "complete": result.complete}))


if __name__ == "__main__":
    main()
