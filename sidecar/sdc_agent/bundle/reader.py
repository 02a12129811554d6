"""Reading a bundle: :func:`read_bundle` validates the manifest and every file's size and
digest; :class:`Bundle` loads its parts."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BundleError
from ..protocol import Suspect
from ..replay import Payload
from .format import (
    MANIFEST,
    LossFn,
    Tolerance,
    _map_tensors,
    _no_duplicates,
    _parse_dtype,
    _required,
    _validate,
)
from .rebuild import rebuild_model

__all__ = ["Bundle", "read_bundle"]


def _check_file(path: Path, name: str, entry: Mapping[str, Any]) -> None:
    target = path / name
    if not target.is_file():
        raise BundleError(f"files.{name}", f"listed in the manifest but missing from {path}")
    size = target.stat().st_size
    if size != entry["bytes"]:
        raise BundleError(
            f"files.{name}.bytes",
            f"the manifest says {entry['bytes']} bytes, the file has {size} (truncated or changed)",
        )
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise BundleError(
            f"files.{name}.sha256", "does not match the file's contents (damaged or changed)"
        )


def read_bundle(path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
    """Open the bundle at ``path``: the manifest validated and, with ``verify``, every
    file's size and SHA-256 checked. Raises :class:`BundleError` naming what is wrong."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise BundleError("bundle", f"{root} is not a directory (no bundle there)")
    if not manifest_path.is_file():
        raise BundleError(MANIFEST, f"missing from {root}")
    try:
        manifest = json.loads(manifest_path.read_text(), object_pairs_hook=_no_duplicates)
    except BundleError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(MANIFEST, f"not valid JSON ({exc})") from None
    _validate(manifest)
    if verify:
        for name, entry in manifest["files"].items():
            _check_file(root, name, entry)
    return Bundle(root, manifest)


@dataclass(frozen=True, slots=True)
class Bundle:
    """An opened, validated bundle (:func:`read_bundle`)."""

    path: Path
    manifest: dict[str, Any]
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def run_id(self) -> str:
        return str(self.manifest["run_id"])

    @property
    def suspect(self) -> Suspect:
        s = self.manifest["suspect"]
        return Suspect(
            rank=s["rank"],
            node=s["node"],
            local_rank=s["local_rank"],
            pod=s.get("pod"),
            gpu_uuid=s.get("gpu_uuid"),
        )

    @property
    def tolerance(self) -> Tolerance:
        t = self.manifest["tolerance"]
        return Tolerance(
            bit_reproducible=t["bit_reproducible"],
            gradient_tolerance=float(t["gradient_tolerance"]),
        )

    @property
    def reference(self) -> dict[str, Any]:
        return dict(self.manifest["reference"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def missing(self) -> list[str]:
        """Why the bundle cannot recompute its micro-batch (empty when it can)."""
        model = self.manifest["model"]
        out = [f"{e.get('file')} left out: {e.get('why')}" for e in self.manifest["left_out"]]
        for part in _required(model["how"]):
            if part not in self.manifest["files"] and not any(part in o for o in out):
                out.append(f"{part} is not in the bundle")
        if model["how"] == "unavailable":
            out.append(f"the model cannot be rebuilt from the bundle: {model.get('reason')}")
        return out

    def load(self, name: str) -> Any:
        """One of the bundle's files (``rng.pt`` ...), loaded on the CPU, cached."""
        if name not in self.manifest["files"]:
            raise BundleError(f"files.{name}", "not in this bundle")
        if name not in self._cache:
            try:
                # The job's own objects, read back by the job's own code (module docstring).
                self._cache[name] = torch.load(
                    self.path / name, map_location="cpu", weights_only=False
                )
            except Exception as exc:
                raise BundleError(name, f"cannot be loaded ({type(exc).__name__}: {exc})") from exc
        return self._cache[name]

    def payload(self) -> Payload:
        """The micro-batch with its RNG and autocast state, as the audit replays it: a fresh
        copy each time, so a model or loss function that changes its inputs in place cannot
        change the next recomputation."""
        rng = self.load("rng.pt")
        micro = self.manifest["micro_batch"]
        autocast = {
            dev: (bool(s["enabled"]), _parse_dtype(s["dtype"], f"micro_batch.autocast.{dev}"))
            for dev, s in micro["autocast"].items()
        }
        batch = _map_tensors(self.load("batch.pt"), lambda t: t.clone())
        cuda = None if rng["cuda"] is None else rng["cuda"].clone()
        loss_grad = rng.get("loss_grad")
        return Payload(
            batch,
            rng["cpu"].clone(),
            cuda,
            autocast,
            None if loss_grad is None else loss_grad.clone(),
        )

    def rebuild(
        self, device: torch.device, *, factory: str | None = None
    ) -> tuple[nn.Module, LossFn]:
        """The module with the weights the micro-batch ran with, on ``device``, and the loss
        function. ``factory`` (``module:function``) overrides how the bundle says to build
        it."""
        return rebuild_model(self, device, factory=factory)
