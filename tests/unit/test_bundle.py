"""Evidence bundles: written off the training thread, bounded, atomic, read back with every
damage named, and recomputing the audited micro-batch bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sdc_agent.bundle import (
    BUNDLE_DIR_ENV,
    BUNDLE_FACTORY_ENV,
    BUNDLE_MAX_BYTES_ENV,
    MANIFEST,
    Bundle,
    BundleSettings,
    BundleWriter,
    EvidenceSnapshot,
    Tolerance,
    bundle_path,
    read_bundle,
    recompute,
    reference_of,
    take_snapshot,
    write_bundle,
)
from sdc_agent.config import KNOWN_ENV
from sdc_agent.errors import BundleError, ConfigError
from sdc_agent.protocol import Suspect
from sdc_agent.replay import Payload

CPU = torch.device("cpu")
SUSPECT = Suspect(rank=3, node="node-b", local_rank=1, pod="train-worker-0", gpu_uuid=None)
# Where the training code is, for bundles written inside pytest: the classes below are
# importable by module name, there is no training script to import.
CODE: dict[str, Any] = {"script": None, "main_module": None, "sys_path": []}
Pair = namedtuple("Pair", ["x", "mask"])


class Net(nn.Module):
    """Dropout (RNG), BatchNorm in training mode (buffers), a frozen submodule in eval mode,
    tied weights and a non-persistent buffer: everything a bundle must carry."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.BatchNorm1d(width)
        self.mid = nn.Linear(width, width)
        self.mid2 = nn.Linear(width, width)
        self.mid2.weight = self.mid.weight  # tied
        self.frozen = nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5)).eval()
        self.out = nn.Linear(width, 8)
        self.register_buffer("offset", torch.full((8,), 0.25), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.drop(self.inp(x)))
        h = self.frozen(self.mid2(torch.relu(self.mid(h))))
        return self.out(h) + self.offset


def loss_fn(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    pair, target = batch["inputs"][0], batch["target"]
    y = model(pair.x * pair.mask)
    return nn.functional.mse_loss(y, target) * batch["scale"]


def make_batch(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 8, generator=g)
    return {
        "inputs": [Pair(x, (torch.rand(6, 8, generator=g) > 0.1).float())],
        "target": torch.randn(6, 8, generator=g),
        "scale": 1.5,  # a non-tensor leaf
        "name": "shard-7",
    }


def healthy(
    model: nn.Module, batch: Any, loss_grad: float | None = None
) -> tuple[Payload, dict[str, Any]]:
    """What the healthy replayer has: the payload it received and its result."""
    payload = Payload.capture(batch, copy=True)
    if loss_grad is not None:  # the gradient that reached the loss (1/n, a loss scale)
        payload.loss_grad = torch.tensor(loss_grad)
    result, names = recompute(model, loss_fn, payload, CPU)
    return payload, reference_of(result, names)


def snapshot(
    model: nn.Module, payload: Payload, reference: dict[str, Any], **kw: Any
) -> EvidenceSnapshot:
    args: dict[str, Any] = {
        "module": model,
        "payload": payload,
        "reference": reference,
        "suspect": SUSPECT,
        "step": 30,
        "run_id": "run-a1",
        "tolerance": Tolerance(),
        "loss_fn": loss_fn,
        "code": CODE,
    }
    args.update(kw)
    return take_snapshot(**args)


def rebuild_and_check(bundle: Bundle) -> None:
    model, fn = bundle.rebuild(CPU)
    result, names = recompute(model, fn, bundle.payload(), CPU)
    got = reference_of(result, names)
    assert got["loss_bits"] == bundle.reference["loss_bits"]
    assert got["gradient_fingerprint"] == bundle.reference["gradient_fingerprint"]
    assert got["per_parameter"] == bundle.reference["per_parameter"]


def written(tmp_path: Path, snap: EvidenceSnapshot) -> Bundle:
    result = write_bundle(snap, bundle_path(tmp_path, snap.run_id, snap.step, snap.suspect_rank))
    assert result.written, result.error
    return read_bundle(result.path)


def test_a_bundle_recomputes_the_micro_batch_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = Net()
    payload, reference = healthy(model, make_batch(), loss_grad=0.25)
    writer = BundleWriter()
    path = writer.submit(snapshot(model, payload, reference), tmp_path / "ckpt")
    assert writer.close(timeout=60)
    assert path == tmp_path / "ckpt" / "sdc-evidence" / "run-a1-30-r3"
    (result,) = writer.results
    assert result.written and result.complete and result.error is None
    bundle = read_bundle(path)
    assert sorted(p.name for p in path.iterdir()) == [
        "batch.pt",
        MANIFEST,
        "module.pt",
        "rng.pt",
        "weights.pt",
    ]
    m = bundle.manifest
    assert (m["step"], m["run_id"], m["work_of"], m["complete"]) == (30, "run-a1", 3, True)
    assert m["suspect"] == {
        "rank": 3,
        "node": "node-b",
        "local_rank": 1,
        "pod": "train-worker-0",
        "gpu_uuid": None,
    }
    assert m["micro_batch"]["loss_grad"] == 0.25
    assert m["model"]["loss_fn"] == f"{__name__}:loss_fn"
    assert m["model"]["how"] == "pickle"
    assert "frozen" in m["model"]["eval_modules"]
    assert m["numerics"]["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()
    rebuild_and_check(bundle)
    model2: Any = bundle.rebuild(CPU)[0]
    assert model2.mid2.weight is model2.mid.weight, "tied weights must stay tied"
    assert not model2.frozen.training and model2.training
    assert torch.equal(model2.offset, model.get_buffer("offset"))


def test_dropout_and_batch_norm_make_the_rng_and_buffers_matter(tmp_path: Path) -> None:
    """The check above could pass by luck if nothing depended on RNG or buffers: a replay
    with other RNG, or with other running statistics, gives other bits."""
    torch.manual_seed(1)
    model = Net()
    payload, reference = healthy(model, make_batch())
    bundle = written(tmp_path, snapshot(model, payload, reference))
    rebuilt: Any
    rebuilt, fn = bundle.rebuild(CPU)
    other_rng = Payload(
        bundle.payload().batch, torch.manual_seed(99).get_state(), None, payload.autocast
    )
    result, names = recompute(rebuilt, fn, other_rng, CPU)
    assert reference_of(result, names)["loss_bits"] != reference["loss_bits"]
    with torch.no_grad():
        rebuilt.norm.running_mean.add_(1.0)
    rebuilt.eval()  # running statistics used: the loss must change
    result, names = recompute(rebuilt, fn, bundle.payload(), CPU)
    assert reference_of(result, names)["loss_bits"] != reference["loss_bits"]


def test_the_snapshot_is_taken_before_training_changes_anything(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = Net()
    batch = make_batch()
    payload, reference = healthy(model, batch)
    snap = snapshot(model, payload, reference)
    # Training goes on before the writer gets to it: an optimizer step, a batch reused.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
        model.norm.running_var.mul_(3.0)  # type: ignore[union-attr]
    payload.batch["target"].zero_()
    rebuild_and_check(written(tmp_path, snap))


def test_over_the_cap_what_fits_is_kept_and_the_bundle_says_what_is_not(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Net(width=256)  # about 300 KB of weights
    payload, reference = healthy(model, make_batch())
    unique = [*model.parameters(), *model.buffers()]  # the tied weight once
    weights_bytes = sum(t.numel() * t.element_size() for t in unique)
    snap = snapshot(model, payload, reference, settings=BundleSettings(bundle_max_bytes=40_000))
    assert "weights.pt" not in snap.parts and "module.pt" not in snap.parts, "not even copied"
    bundle = written(tmp_path, snap)
    assert bundle.complete is False
    assert sorted(bundle.manifest["files"]) == ["batch.pt", "rng.pt"]
    (left,) = bundle.manifest["left_out"]
    assert left["file"] == "weights.pt" and left["bytes"] == weights_bytes
    assert "bundle_max_bytes" in left["why"]
    assert bundle.manifest["max_bytes"] == 40_000
    assert any("weights.pt left out" in m for m in bundle.missing())
    with pytest.raises(BundleError, match="weights"):
        bundle.rebuild(CPU)
    total = sum(f["bytes"] for f in bundle.manifest["files"].values())
    assert total <= 40_000
    # 0 keeps only the manifest: the reference bits, no data leaves the job
    bundle = written(
        tmp_path / "zero",
        snapshot(model, payload, reference, settings=BundleSettings(bundle_max_bytes=0)),
    )
    assert (
        bundle.manifest["files"] == {} and bundle.reference["loss_bits"] == reference["loss_bits"]
    )
    assert sorted(p.name for p in bundle.path.iterdir()) == [MANIFEST]


def test_an_existing_bundle_is_never_overwritten_and_a_failed_write_leaves_nothing(
    tmp_path: Path,
) -> None:
    torch.manual_seed(4)
    model = Net()
    payload, reference = healthy(model, make_batch())
    first = written(tmp_path, snapshot(model, payload, reference))
    before = (first.path / MANIFEST).read_bytes()
    again = write_bundle(snapshot(model, payload, reference), first.path)
    assert not again.written and "already there" in (again.error or "")
    assert (first.path / MANIFEST).read_bytes() == before
    # A batch that cannot be saved: the write fails, and no directory, temporary or
    # final, is left behind.
    bad = Payload({"x": torch.ones(2), "f": threading.Lock()}, payload.rng_cpu, None, {})
    target = bundle_path(tmp_path / "bad", "run-a1", 30, 3)
    result = write_bundle(snapshot(model, bad, reference), target)
    assert not result.written and result.error
    assert list(target.parent.iterdir()) == []


def test_a_bundle_is_as_readable_as_the_umask_makes_a_directory(tmp_path: Path) -> None:
    # The confirmation pod may run as another user than training: no private 0700.
    torch.manual_seed(4)
    model = Net()
    payload, reference = healthy(model, make_batch())
    old = os.umask(0o022)
    try:
        result = written(tmp_path, snapshot(model, payload, reference))
    finally:
        os.umask(old)
    assert result.path.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in result.path.iterdir())


def test_capture_never_raises_into_training(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = Net()
    payload, reference = healthy(model, make_batch())
    writer = BundleWriter()
    with pytest.warns(RuntimeWarning, match="no evidence bundle"):
        path = writer.capture(
            tmp_path,
            module=model,
            payload=payload,
            reference=reference,
            suspect=SUSPECT,
            step=0,  # invalid
            run_id="run-a1",
            tolerance=Tolerance(),
        )
    assert path is None
    assert writer.capture(None, module=model) is None  # no directory known: nothing to do
    writer.close()


def test_a_module_that_does_not_pickle_still_gives_weights_for_a_factory(tmp_path: Path) -> None:
    torch.manual_seed(6)
    model = Net()
    model.activation = lambda t: t  # type: ignore[assignment]  # lambdas do not pickle
    payload, reference = healthy(model, make_batch())
    bundle = written(tmp_path, snapshot(model, payload, reference))
    assert bundle.manifest["model"]["how"] == "unavailable"
    assert "does not pickle" in bundle.manifest["model"]["reason"]
    assert bundle.complete is False and "weights.pt" in bundle.manifest["files"]
    with pytest.raises(BundleError, match="give a factory"):
        bundle.rebuild(CPU)
    model2, fn = bundle.rebuild(CPU, factory=f"{__name__}:build")
    result, names = recompute(model2, fn, bundle.payload(), CPU)
    assert reference_of(result, names)["loss_bits"] == reference["loss_bits"]


BUILT: list[tuple[Net, torch.Tensor]] = []
"""What build() made: the module, and its first weight as built."""


def build() -> tuple[nn.Module, Any]:
    """A bundle factory: the model with fresh (wrong) weights; the bundle's replace them."""
    torch.manual_seed(12345)
    net = Net()
    BUILT.append((net, net.inp.weight))
    return net, loss_fn


def test_a_factory_setting_is_recorded_and_used(tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = Net()
    payload, reference = healthy(model, make_batch())
    settings = BundleSettings(bundle_factory=f"{__name__}:build")
    bundle = written(tmp_path, snapshot(model, payload, reference, settings=settings))
    assert bundle.manifest["model"]["how"] == "factory"
    assert "module.pt" not in bundle.manifest["files"] and bundle.complete
    rebuild_and_check(bundle)
    # The weights are copied into the factory's own tensors: ties and references to them
    # stay valid.
    rebuilt: Any = bundle.rebuild(CPU)[0]
    built, weight = BUILT[-1]
    assert rebuilt is built and rebuilt.inp.weight is weight
    assert torch.equal(weight, model.inp.weight) and rebuilt.mid2.weight is rebuilt.mid.weight


def test_the_writer_never_blocks_and_drops_what_it_cannot_queue(tmp_path: Path) -> None:
    """A CUDA copy still under way holds the writer (emulated: the copier's wait blocks);
    submit returns at once, one bundle waits, a third is dropped."""
    torch.manual_seed(8)
    model = Net()
    payload, reference = healthy(model, make_batch())
    release = threading.Event()

    class SlowCopy:
        def wait(self) -> None:
            release.wait(30)

    snaps = [snapshot(model, payload, reference, step=s) for s in (10, 20, 30)]
    for snap in snaps:
        snap.copier = SlowCopy()  # type: ignore[assignment]
    writer = BundleWriter(max_pending=1)
    started = time.perf_counter()
    first = writer.submit(snaps[0], tmp_path)
    deadline = time.monotonic() + 10
    while writer._pending and time.monotonic() < deadline:  # the thread took it
        time.sleep(0.01)
    second = writer.submit(snaps[1], tmp_path)
    with pytest.warns(RuntimeWarning, match="dropped"):
        third = writer.submit(snaps[2], tmp_path)
    assert time.perf_counter() - started < 5, "submit must not wait for the write"
    assert first is not None and second is not None and third is None
    assert writer.wait(timeout=0.2) is False and writer.results == []
    release.set()
    assert writer.close(timeout=60)
    assert [r.path.name for r in writer.results] == ["run-a1-10-r3", "run-a1-20-r3"]
    assert all(r.written and r.complete for r in writer.results)


def damage(bundle: Bundle, how: str) -> None:
    path = bundle.path
    manifest = json.loads((path / MANIFEST).read_text())
    if how == "truncated":
        data = (path / "weights.pt").read_bytes()
        (path / "weights.pt").write_bytes(data[:-10])
    elif how == "altered":
        flipped = bytearray((path / "weights.pt").read_bytes())
        flipped[len(flipped) // 2] ^= 0x01
        (path / "weights.pt").write_bytes(bytes(flipped))
    elif how == "file missing":
        (path / "batch.pt").unlink()
    elif how == "bad json":
        (path / MANIFEST).write_text("{not json")
    elif how == "duplicate key":
        (path / MANIFEST).write_text('{"step": 1, "step": 2}')
    elif how == "no manifest":
        (path / MANIFEST).unlink()
    else:
        field, value = {
            "format": ("format", "something-else"),
            "version": ("version", 99),
            "step": ("step", 0),
            "loss bits": ("reference", {"version": 1, "gradient_fingerprint": "x"}),
            "suspect": ("suspect", {"rank": "3", "node": "n", "local_rank": 0}),
            "loss grad": ("micro_batch", {"loss_grad": "x", "autocast": {}}),
            "unknown file": ("files", {**manifest["files"], "evil.pt": {"bytes": 1, "sha256": ""}}),
        }[how]
        manifest[field] = value
        (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("how", "field", "words"),
    [
        ("truncated", "files.weights.pt.bytes", "truncated"),
        ("altered", "files.weights.pt.sha256", "damaged"),
        ("file missing", "files.batch.pt", "missing"),
        ("bad json", MANIFEST, "not valid JSON"),
        ("duplicate key", f"{MANIFEST}.step", "given twice"),
        ("no manifest", MANIFEST, "missing"),
        ("format", "format", "hyperpod-sdc.dev/evidence-bundle"),
        ("version", "version", "knows version 1"),
        ("step", "step", ">= 1"),
        ("loss bits", "reference.loss_bits", "missing"),
        ("suspect", "suspect.rank", "must be int"),
        ("loss grad", "micro_batch.loss_grad", "number > 0"),
        ("unknown file", "files.evil.pt", "not a bundle file"),
    ],
)
def test_a_damaged_bundle_is_refused_naming_what_is_wrong(
    tmp_path: Path, how: str, field: str, words: str
) -> None:
    torch.manual_seed(9)
    model = Net()
    payload, reference = healthy(model, make_batch())
    bundle = written(tmp_path, snapshot(model, payload, reference))
    damage(bundle, how)
    with pytest.raises(BundleError) as caught:
        read_bundle(bundle.path)
    assert caught.value.field == field
    assert words in str(caught.value)


def test_no_bundle_at_all(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        read_bundle(tmp_path / "nothing")


def test_a_copied_bundle_is_still_valid(tmp_path: Path) -> None:
    """Bundles move (a person copies one off the cluster): nothing in them is absolute."""
    torch.manual_seed(10)
    model = Net()
    payload, reference = healthy(model, make_batch())
    bundle = written(tmp_path / "a", snapshot(model, payload, reference))
    moved = tmp_path / "b" / bundle.path.name
    shutil.copytree(bundle.path, moved)
    rebuild_and_check(read_bundle(moved))


def test_settings_from_env_and_their_errors() -> None:
    env = {
        BUNDLE_DIR_ENV: "/fsx/ckpt",
        BUNDLE_FACTORY_ENV: "mypkg.model:build",
        BUNDLE_MAX_BYTES_ENV: "1000",
    }
    s = BundleSettings.from_env(env)
    assert (s.bundle_dir, s.bundle_factory, s.bundle_max_bytes) == (
        "/fsx/ckpt",
        "mypkg.model:build",
        1000,
    )
    assert BundleSettings.from_env(env, bundle_max_bytes=5).bundle_max_bytes == 5
    assert BundleSettings.from_env({}).bundle_max_bytes == 2 * 1024**3
    with pytest.raises(ConfigError, match=f"^{BUNDLE_MAX_BYTES_ENV}: expected a number"):
        BundleSettings.from_env({BUNDLE_MAX_BYTES_ENV: "2G"})
    with pytest.raises(ConfigError, match=f"^{BUNDLE_MAX_BYTES_ENV}: bundle_max_bytes"):
        BundleSettings.from_env({BUNDLE_MAX_BYTES_ENV: "-1"})
    with pytest.raises(ConfigError, match=f"^{BUNDLE_FACTORY_ENV}: bundle_factory"):
        BundleSettings.from_env({BUNDLE_FACTORY_ENV: "not a reference"})
    with pytest.raises(ConfigError, match="bundle_size: unknown setting"):
        BundleSettings.from_env({}, bundle_size=1)
    # The Guard's configuration knows these variables (no "unknown variable" warning).
    assert {BUNDLE_DIR_ENV, BUNDLE_FACTORY_ENV, BUNDLE_MAX_BYTES_ENV} <= KNOWN_ENV


def test_reference_is_an_open_versioned_dict() -> None:
    torch.manual_seed(11)
    model = Net()
    payload = Payload.capture(make_batch(), copy=True)
    result, names = recompute(model, loss_fn, payload, CPU)
    ref = reference_of(result, names, stats={"kind": "audit-v2"})
    assert ref["version"] == 1 and ref["gradients_of"] == "backward(loss, loss_grad)"
    assert ref["stats"] == {"kind": "audit-v2"}
    assert set(ref["per_parameter"]) == set(names) == set(ref["gradient_norms"])
    assert "mid2.weight" not in names, "a tied weight is one parameter"
    with pytest.raises(ValueError, match="names"):
        reference_of(result, names[:-1])
