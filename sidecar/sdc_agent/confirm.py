"""``python -m sdc_agent.confirm BUNDLE``: does the suspect node still compute wrong?

Run on the suspect node (a pod pinned to it, with the job's image and volumes), it
recomputes the evidence bundle's micro-batch (:mod:`sdc_agent.bundle`) on every GPU of
the node, ``--repeat`` times each, and compares every result with the reference a healthy
GPU computed: the loss bit for bit, the gradients by fingerprint (or, where the bundle
says the job is not bit-reproducible, by per-parameter gradient norms within the
tolerance in force). Then a short stress check: deterministic GEMMs in the job's dtypes,
with fixed seeds, compared across the node's GPUs and across repeats on each. Then
``dcgmi diag -r 3`` where ``dcgmi`` exists.

Per GPU (its index, local rank, UUID where CUDA reports one):

``reproduces``
    a wrong result came back (the micro-batch did not give the reference, or the GEMMs
    disagree with the other GPUs or with themselves): the fault is confirmed on this GPU;
``does-not-reproduce``
    the reference came back every time;
``could-not-run``
    the recomputation failed here (the reason is given).

The outcome: ``confirmed`` (some GPU reproduces; exit code 3), ``not-confirmed`` (every
GPU ran, the suspect's among them, and returned the reference; exit code 0), ``unknown``
(the bundle is missing, damaged or incomplete, nothing could run, the suspect's GPU could
not run, or every GPU differs alike, which points at the software rather than one GPU;
exit code 4). The full result (JSON) goes to stdout and ``--json``; a summary of at most
4096 bytes (what Kubernetes keeps of a termination message) to ``--termination-log``.
``dcgmi`` is evidence for the reviewer: its verdict is reported, it does not decide.

Without CUDA the CPU counts as one device and stands for the suspect's GPU, so tests and
the demo run anywhere. The demo's broken GPU is the agent's fault injection, given to this
process as it is given to the training processes (``HYPERPOD_SDC_FAULTS``): the device
with local index ``i`` runs as global rank ``suspect.rank - suspect.local_rank + i`` (the
rank that used that GPU under torchrun's contiguous numbering; on the CPU, the suspect's
rank), at the bundle's step, so a fault aimed at the suspect's rank hits the recomputation
on the suspect's GPU exactly as it hit the job. ``forward`` faults apply through the
module's hooks, ``grad_local`` faults with a ``target`` to that parameter's gradient;
others (the all-reduce, the optimizer, a DDP bucket) do not occur here and are listed as
ignored. Emulated faults in force are listed in the result.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdc_common.names import CONFIRM_EXIT_CODES

from .bundle import (
    BUNDLE_FACTORY_ENV,
    GRADIENTS_OF,
    MANIFEST,
    REFERENCE_VERSION,
    Bundle,
    read_bundle,
    reference_of,
)
from .bundle import recompute as recompute_bundle
from .config import FAULTS_ENV
from .determinism import CUBLAS_WORKSPACE_CONFIG
from .errors import BundleError, ConfigError
from .faults import FaultInjector, FaultSpec, corrupt_, parse_faults
from .fingerprint import Fingerprinter, format_fingerprint
from .protocol import Suspect

__all__ = [
    "CONFIRMATION_FORMAT",
    "EXIT_CODES",
    "GPU_RESULTS",
    "OUTCOMES",
    "TERMINATION_LOG_LIMIT",
    "Slot",
    "compact_summary",
    "compare",
    "confirm",
    "decide",
    "gemm_stress",
    "judge_stress",
    "main",
    "node_devices",
    "run_dcgmi",
]

log = logging.getLogger("sdc_agent.confirm")

CONFIRMATION_FORMAT = "hyperpod-sdc.dev/confirmation"
CONFIRMATION_VERSION = 1
OUTCOMES: tuple[str, ...] = ("confirmed", "not-confirmed", "unknown")
GPU_RESULTS: tuple[str, ...] = ("reproduces", "does-not-reproduce", "could-not-run")
EXIT_CODES: dict[str, int] = CONFIRM_EXIT_CODES
"""Distinct per outcome; 1 and 2 stay Python's (a crash) and argparse's (bad usage)
(defined in ``sdc_common.names``, which the operator reads them from)."""
TERMINATION_LOG_LIMIT = 4096
"""Bytes of a container's termination message that Kubernetes keeps."""
DCGMI_LEVEL = 3
_TINY = 1e-30


# -- comparing results ---------------------------------------------------------------------


def compare(
    reference: Mapping[str, Any],
    candidate: Mapping[str, Any],
    *,
    bit_reproducible: bool,
    gradient_tolerance: float,
    suspect_result: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """How ``candidate`` (a :func:`~sdc_agent.bundle.reference_of` dict) compares with the
    reference. ``outcome``: ``reference`` (it came back), ``suspect`` (the suspect's own
    wrong result came back, bit for bit) or ``other`` (a different wrong result)."""
    loss_equal = reference["loss_bits"] == candidate["loss_bits"]
    bitwise = reference["gradient_fingerprint"] == candidate["gradient_fingerprint"]
    ref_per = reference.get("per_parameter") or {}
    cand_per = candidate.get("per_parameter") or {}
    differing = [n for n in ref_per if ref_per[n] != cand_per.get(n)]
    out: dict[str, Any] = {
        "loss_equal": loss_equal,
        "gradients_bitwise_equal": bitwise,
        "differing_parameters": differing[:8],
        "differing_parameter_count": len(differing),
    }
    gradients_ok = bitwise
    ref_norms = reference.get("gradient_norms")
    if not bit_reproducible and gradient_tolerance > 0 and isinstance(ref_norms, dict):
        cand_norms = candidate.get("gradient_norms") or {}
        worst = 0.0
        for name, a in ref_norms.items():
            b = cand_norms.get(name)
            if a is None or b is None:
                worst = worst if a is b else math.inf
                continue
            worst = max(worst, abs(a - b) / max(abs(a), _TINY))
        out["max_relative_norm_difference"] = worst
        gradients_ok = worst <= gradient_tolerance
    out["gradients_equal"] = gradients_ok
    if loss_equal and gradients_ok:
        out["outcome"] = "reference"
    elif (
        suspect_result is not None
        and suspect_result.get("loss_bits") == candidate["loss_bits"]
        and suspect_result.get("gradient_fingerprint") == candidate["gradient_fingerprint"]
    ):
        out["outcome"] = "suspect"
    else:
        out["outcome"] = "other"
    return out


# -- the node's devices --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slot:
    """One device of this node as the confirmation uses it."""

    index: int
    device: torch.device
    local_rank: int
    rank: int
    """The global rank the job's process on this GPU had (for emulated faults)."""
    uuid: str | None


def _uuid(index: int) -> str | None:
    try:
        text = str(torch.cuda.get_device_properties(index).uuid)
    except (RuntimeError, AttributeError):
        return None
    return text if text.startswith("GPU-") else f"GPU-{text}"


def node_devices(suspect: Suspect) -> list[Slot]:
    """Every CUDA device, each as the rank that used it; without CUDA the CPU, as the
    suspect's GPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        base = suspect.rank - suspect.local_rank
        return [
            Slot(i, torch.device("cuda", i), i, base + i, _uuid(i))
            for i in range(torch.cuda.device_count())
        ]
    return [Slot(0, torch.device("cpu"), suspect.local_rank, suspect.rank, None)]


def suspect_slot(slots: Sequence[Slot], suspect: Suspect) -> int | None:
    """Which slot is the suspect's GPU: by UUID where known, else by local rank."""
    if suspect.gpu_uuid and any(s.uuid for s in slots):
        return next((s.index for s in slots if s.uuid == suspect.gpu_uuid), None)
    return next((s.index for s in slots if s.local_rank == suspect.local_rank), None)


def apply_numerics(numerics: Mapping[str, Any]) -> list[str]:
    """Put the job's numerics settings in force (before any CUDA work); returns what was
    set."""
    done = []
    if numerics.get("deterministic_algorithms"):
        os.environ.setdefault(
            "CUBLAS_WORKSPACE_CONFIG",
            str(numerics.get("cublas_workspace_config") or CUBLAS_WORKSPACE_CONFIG),
        )
        torch.use_deterministic_algorithms(True)
        done.append("deterministic_algorithms")
    threads = numerics.get("cpu_threads")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1:
        torch.set_num_threads(threads)
        done.append(f"cpu_threads={threads}")
    precision = numerics.get("float32_matmul_precision")
    if precision in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(precision)
        done.append(f"float32_matmul_precision={precision}")
    matmul = torch.backends.cuda.matmul
    for key, attr in (
        ("cuda_matmul_allow_tf32", "allow_tf32"),
        (
            "cuda_matmul_allow_fp16_reduced_precision_reduction",
            "allow_fp16_reduced_precision_reduction",
        ),
        (
            "cuda_matmul_allow_bf16_reduced_precision_reduction",
            "allow_bf16_reduced_precision_reduction",
        ),
    ):
        if isinstance(numerics.get(key), bool):
            setattr(matmul, attr, numerics[key])
            done.append(f"{attr}={numerics[key]}")
    for key, attr in (
        ("cudnn_allow_tf32", "allow_tf32"),
        ("cudnn_deterministic", "deterministic"),
        ("cudnn_benchmark", "benchmark"),
    ):
        if isinstance(numerics.get(key), bool):
            setattr(torch.backends.cudnn, attr, numerics[key])
            done.append(f"cudnn.{attr}={numerics[key]}")
    return done


# -- recomputing the micro-batch ------------------------------------------------------------


def _emulated(specs: Sequence[FaultSpec], slot: Slot) -> tuple[list[FaultSpec], list[str]]:
    """The faults aimed at ``slot``'s rank that can happen in a recomputation, and notes
    on those that cannot."""
    usable, notes = [], []
    for spec in specs:
        if spec.rank != slot.rank:
            continue
        if spec.site == "forward" or (spec.site == "grad_local" and spec.target is not None):
            usable.append(spec)
        else:
            notes.append(
                f"{spec.site} fault on rank {spec.rank} ignored: it needs "
                + ("a DDP bucket (give target=)" if spec.site == "grad_local" else "training")
            )
    return usable, notes


def replay_on(
    bundle: Bundle,
    slot: Slot,
    *,
    repeats: int,
    faults: Sequence[FaultSpec],
    factory: str | None,
    fingerprinter: Fingerprinter,
) -> dict[str, Any]:
    """The bundle's micro-batch recomputed ``repeats`` times on ``slot``."""
    out: dict[str, Any] = {"repeats": []}
    started = time.perf_counter()
    try:
        module, loss_fn = bundle.rebuild(slot.device, factory=factory)
        bundle.payload()  # fails here, not in the middle of the repeats, if it cannot load
    except Exception as exc:  # BundleError, or the user's code failing to import or build
        out.update(result="could-not-run", why=f"rebuilding the model failed: {exc}")
        return out
    out["load_seconds"] = round(time.perf_counter() - started, 6)
    specs, notes = _emulated(faults, slot)
    injector = FaultInjector(specs, slot.rank)
    injector.step = bundle.step
    try:
        injector.attach(module)
    except ConfigError as exc:
        out.update(result="could-not-run", why=f"{FAULTS_ENV}: {exc}")
        return out
    if specs or notes:
        out["emulated_faults"] = [str(s) for s in specs] + notes
    # replay() puts the CUDA RNG state back on the current device: make it this one.
    current = torch.cuda.device(slot.device) if slot.device.type == "cuda" else nullcontext()
    try:
        with current:
            for _ in range(repeats):
                # A fresh copy of the micro-batch each time (Bundle.payload).
                payload = bundle.payload()
                out["repeats"].append(
                    _recompute_once(bundle, module, loss_fn, payload, slot, injector, fingerprinter)
                )
    except Exception as exc:
        out.update(result="could-not-run", why=f"recomputing failed: {type(exc).__name__}: {exc}")
        return out
    finally:
        injector.detach()
    wrong = [r for r in out["repeats"] if r["outcome"] != "reference"]
    out["result"] = "reproduces" if wrong else "does-not-reproduce"
    if wrong:
        kinds = Counter(r["outcome"] for r in wrong)
        out["why"] = f"{len(wrong)} of {repeats} recomputations differ from the reference" + (
            f" ({kinds['suspect']} gave the suspect's own result)" if kinds["suspect"] else ""
        )
    else:
        out["why"] = f"the reference came back in all {repeats} recomputations"
    out["seconds"] = round(time.perf_counter() - started, 6)
    return out


def _recompute_once(
    bundle: Bundle,
    module: torch.nn.Module,
    loss_fn: Any,
    payload: Any,
    slot: Slot,
    injector: FaultInjector,
    fingerprinter: Fingerprinter,
) -> dict[str, Any]:
    """One recomputation on ``slot``, compared with the reference."""
    started = time.perf_counter()
    result, names = recompute_bundle(module, loss_fn, payload, slot.device)
    grads = list(result.grads)
    # The local-gradient faults the audit applies to replayed gradients, aimed by name.
    for spec in injector.pending("grad_local"):
        if spec.target in names and injector.fire(spec):
            i = names.index(spec.target)
            g = grads[i]
            if g is not None:
                g = g.clone()
                corrupt_(g, spec)
                grads[i] = g
    if slot.device.type == "cuda":
        torch.cuda.synchronize(slot.device)
    seconds = time.perf_counter() - started
    candidate = reference_of(type(result)(result.loss, grads), names, fingerprinter)
    tolerance = bundle.tolerance
    verdict = compare(
        bundle.reference,
        candidate,
        bit_reproducible=tolerance.bit_reproducible,
        gradient_tolerance=tolerance.gradient_tolerance,
        suspect_result=bundle.manifest.get("suspect_result"),
    )
    verdict["seconds"] = round(seconds, 6)
    verdict["loss_bits"] = candidate["loss_bits"]
    verdict["gradient_fingerprint"] = candidate["gradient_fingerprint"]
    return verdict


# -- the stress check ----------------------------------------------------------------------


def gemm_stress(
    slots: Sequence[Slot],
    dtypes: Sequence[torch.dtype],
    *,
    repeats: int,
    size: int,
    iterations: int,
    seed: int = 20240601,
    fingerprinter: Fingerprinter | None = None,
) -> dict[int, dict[str, Any]]:
    """Chained GEMMs from fixed seeds on each slot; per slot, per dtype, the result's
    fingerprint in each repeat, and a judgement against the other slots: ``pass``,
    ``fail`` (differs from the majority of GPUs, or from itself across repeats) or
    ``inconclusive`` (no majority)."""
    fp = fingerprinter or Fingerprinter("eager")
    per: dict[int, dict[str, Any]] = {s.index: {"dtypes": {}, "seconds": 0.0} for s in slots}
    for k, dtype in enumerate(dtypes):
        g = torch.Generator().manual_seed(seed + k)
        a = torch.randn(size, size, generator=g)
        b = torch.randn(size, size, generator=g) / math.sqrt(size)  # keeps values bounded
        for slot in slots:
            t0 = time.perf_counter()
            entry: dict[str, Any] = {}
            try:
                x, w = a.to(slot.device, dtype), b.to(slot.device, dtype)
                outputs = []
                for _ in range(repeats):
                    c = x
                    for _ in range(iterations):
                        c = c @ w
                    outputs.append(format_fingerprint(fp(c)))
                entry["fingerprints"] = outputs
            except Exception as exc:  # a dtype this device cannot multiply
                entry["error"] = f"{type(exc).__name__}: {exc}"
            if slot.device.type == "cuda":
                torch.cuda.synchronize(slot.device)
            per[slot.index]["seconds"] += time.perf_counter() - t0
            per[slot.index]["dtypes"][str(dtype)] = entry
    judge_stress(per)
    return per


def judge_stress(per: dict[int, dict[str, Any]]) -> None:
    """Set ``result`` per slot and dtype in :func:`gemm_stress`'s table, in place. Pure."""
    keys = sorted({k for p in per.values() for k in p["dtypes"]})
    for key in keys:
        firsts = {
            i: p["dtypes"][key]["fingerprints"][0]
            for i, p in per.items()
            if p["dtypes"].get(key, {}).get("fingerprints")
        }
        common, count = Counter(firsts.values()).most_common(1)[0] if firsts else ("", 0)
        majority = common if count * 2 > len(firsts) else None
        for p in per.values():
            entry = p["dtypes"].setdefault(key, {})
            prints: list[str] | None = entry.get("fingerprints")
            if not prints:
                entry["result"] = "skipped"
            elif len(set(prints)) > 1:
                entry["result"] = "fail"
                entry["why"] = "the same GEMMs gave different results across repeats"
            elif majority is None:
                entry["result"] = "inconclusive"
            elif prints[0] != majority:
                entry["result"] = "fail"
                entry["why"] = f"differs from {count} of {len(firsts)} devices"
            else:
                entry["result"] = "pass"
    for p in per.values():
        results = [e["result"] for e in p["dtypes"].values()]
        p["result"] = (
            "fail"
            if "fail" in results
            else "pass"
            if "pass" in results
            else "inconclusive"
            if "inconclusive" in results
            else "skipped"
        )
        p["seconds"] = round(p["seconds"], 6)


def stress_dtypes(bundle: Bundle) -> list[torch.dtype]:
    """The job's floating dtypes: its weights' and those autocast ran in."""
    names = set(bundle.manifest["model"].get("dtypes") or [])
    for state in bundle.manifest["micro_batch"]["autocast"].values():
        if state.get("enabled"):
            names.add(state["dtype"])
    dtypes = []
    for name in sorted(names or {"torch.float32"}):
        dtype = getattr(torch, str(name).removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            dtypes.append(dtype)
    return dtypes or [torch.float32]


# -- DCGM ----------------------------------------------------------------------------------


def run_dcgmi(*, timeout: float, level: int = DCGMI_LEVEL) -> dict[str, Any]:
    """``dcgmi diag -r <level>`` where ``dcgmi`` is on ``PATH``."""
    exe = shutil.which("dcgmi")
    if exe is None:
        return {"ran": False, "skipped": "dcgmi is not on PATH (no DCGM in this image)"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [exe, "diag", "-r", str(level)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return {
            "ran": True,
            "passed": None,
            "timed_out": True,
            "why": f"dcgmi diag -r {level} did not finish within {timeout:g} s",
            "seconds": round(time.perf_counter() - started, 3),
            "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
        }
    output = (done.stdout or "") + (done.stderr or "")
    failed = re.search(r"\bfail", output, re.IGNORECASE) is not None
    passed: bool | None
    if failed:
        passed = False
    elif done.returncode == 0 and re.search(r"\bpass", output, re.IGNORECASE):
        passed = True
    else:
        passed = None  # it ran but said nothing we can read (no host engine, an error)
    return {
        "ran": True,
        "passed": passed,
        "exit_code": done.returncode,
        "seconds": round(time.perf_counter() - started, 3),
        "output_tail": output[-2000:],
    }


# -- the outcome ---------------------------------------------------------------------------


def _describe(gpu: Mapping[str, Any]) -> str:
    uuid = f" ({gpu['uuid']})" if gpu.get("uuid") else ""
    return f"GPU {gpu['index']} (local rank {gpu['local_rank']}){uuid}"


def decide(
    gpus: Sequence[Mapping[str, Any]],
    suspect_index: int | None,
    *,
    environment_differs: str | None = None,
) -> tuple[str, str]:
    """``(outcome, reason)`` from the per-GPU results. Pure."""
    ran = [g for g in gpus if g["result"] != "could-not-run"]
    bad = [g for g in gpus if g["result"] == "reproduces"]
    if not ran:
        why = "; ".join(f"{_describe(g)}: {g.get('why')}" for g in gpus) or "no device"
        return "unknown", f"no device could run the check ({why})"
    if bad:
        names = ", ".join(_describe(g) for g in bad)
        stress_only = all((g.get("replay") or {}).get("result") != "reproduces" for g in bad)
        if environment_differs:
            return "unknown", (
                f"{names} gave results different from the reference, but {environment_differs}: "
                "the difference may be the environment, not the GPU"
            )
        results = {
            tuple((r["loss_bits"], r["gradient_fingerprint"]) for r in g["replay"]["repeats"])
            for g in bad
            if (g.get("replay") or {}).get("repeats")
        }
        if len(bad) == len(ran) >= 2 and len(results) == 1 and not stress_only:
            return "unknown", (
                f"every device of this node ({len(ran)}) computes the same result, different "
                "from the reference: the software or settings differ from the job's, not one GPU"
            )
        return "confirmed", f"{names}: {bad[0].get('why')}"
    if suspect_index is None:
        return "unknown", "the suspect's GPU is not among this node's devices (UUID not found)"
    suspect = gpus[suspect_index]
    if suspect["result"] == "could-not-run":
        return "unknown", f"the suspect's {_describe(suspect)} could not run: {suspect.get('why')}"
    return "not-confirmed", (
        f"every device that ran ({len(ran)} of {len(gpus)}, the suspect's {_describe(suspect)} "
        "among them) returned the reference result"
    )


def _environment_differs(bundle: Bundle, slots: Sequence[Slot]) -> str | None:
    recorded = bundle.manifest.get("environment") or {}
    if recorded.get("torch") and recorded["torch"] != torch.__version__:
        return f"torch here is {torch.__version__}, the job's was {recorded['torch']}"
    name = recorded.get("device_name")
    if name and slots and slots[0].device.type == "cuda":
        here = torch.cuda.get_device_name(slots[0].device)
        if here != name:
            return f"the GPUs here are {here}, the reference was computed on {name}"
    return None


# -- the whole run -------------------------------------------------------------------------


def _base_result(bundle_path: str) -> dict[str, Any]:
    return {
        "format": CONFIRMATION_FORMAT,
        "version": CONFIRMATION_VERSION,
        "bundle": bundle_path,
        "node": os.environ.get("NODE_NAME") or socket.gethostname(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }


def _finish(result: dict[str, Any], outcome: str, reason: str, started: float) -> dict[str, Any]:
    result["outcome"] = outcome
    result["reason"] = reason
    result["exit_code"] = EXIT_CODES[outcome]
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def confirm(
    bundle_path: str | os.PathLike[str],
    *,
    repeats: int = 3,
    factory: str | None = None,
    stress: bool = True,
    stress_size: int | None = None,
    stress_iterations: int | None = None,
    dcgmi: bool = True,
    dcgmi_timeout: float = 1800.0,
    wait: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The confirmation result (a JSON-able dict). Never raises for a bad bundle or a
    failing device: those are ``unknown`` and ``could-not-run`` with their reasons.
    ``wait``: seconds to wait for the bundle to appear (it is written in the background
    after the verdict names it; renamed into place whole, so its manifest appearing means
    it is complete)."""
    started = time.perf_counter()
    env = os.environ if env is None else env
    result = _base_result(str(bundle_path))
    manifest = Path(bundle_path) / MANIFEST
    deadline = time.monotonic() + wait
    while not manifest.exists() and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if wait and not manifest.exists():
        return _finish(result, "unknown", f"no bundle at {bundle_path} after {wait:g} s", started)
    try:
        bundle = read_bundle(bundle_path)
    except BundleError as exc:
        return _finish(result, "unknown", f"bundle: {exc}", started)
    result.update(
        step=bundle.step,
        run_id=bundle.run_id,
        suspect=bundle.manifest["suspect"],
        repeats=repeats,
    )
    missing = bundle.missing()
    reference = bundle.reference
    if (
        reference.get("version", 0) > REFERENCE_VERSION
        or reference.get("gradients_of", GRADIENTS_OF) != GRADIENTS_OF
    ):
        missing.append(
            f"the reference (version {reference.get('version')}, gradients of "
            f"{reference.get('gradients_of')!r}) was written by a newer agent"
        )
    try:
        specs = parse_faults(env.get(FAULTS_ENV, ""))
    except ConfigError as exc:
        return _finish(result, "unknown", f"{FAULTS_ENV}: {exc}", started)
    result["numerics"] = apply_numerics(bundle.manifest.get("numerics") or {})
    slots = node_devices(bundle.suspect)
    suspect_index = suspect_slot(slots, bundle.suspect)
    factory = factory or env.get(BUNDLE_FACTORY_ENV) or None
    fingerprinter = Fingerprinter("eager")
    gpus: list[dict[str, Any]] = []
    for slot in slots:
        gpu: dict[str, Any] = {
            "index": slot.index,
            "device": str(slot.device),
            "local_rank": slot.local_rank,
            "rank": slot.rank,
            "uuid": slot.uuid,
            "suspect": slot.index == suspect_index,
        }
        if missing:
            gpu["replay"] = {
                "result": "could-not-run",
                "why": "the bundle cannot recompute its micro-batch: " + "; ".join(missing),
            }
        else:
            gpu["replay"] = replay_on(
                bundle,
                slot,
                repeats=repeats,
                faults=specs,
                factory=factory,
                fingerprinter=fingerprinter,
            )
        gpus.append(gpu)
    if stress:
        cuda = slots[0].device.type == "cuda"
        size = stress_size or (4096 if cuda else 256)
        iterations = stress_iterations or (8 if cuda else 4)
        dtypes = stress_dtypes(bundle)
        per = gemm_stress(slots, dtypes, repeats=max(2, repeats), size=size, iterations=iterations)
        result["stress"] = {
            "dtypes": [str(d) for d in dtypes],
            "size": size,
            "iterations": iterations,
        }
        for gpu in gpus:
            gpu["stress"] = per[gpu["index"]]
    for gpu in gpus:
        replayed = gpu["replay"]
        stress_result = (gpu.get("stress") or {}).get("result")
        if replayed["result"] == "reproduces" or stress_result == "fail":
            gpu["result"] = "reproduces"
            gpu["why"] = (
                replayed.get("why")
                if replayed["result"] == "reproduces"
                else "the stress GEMMs disagree with the other GPUs or with themselves"
            )
        else:
            gpu["result"] = replayed["result"]
            gpu["why"] = replayed.get("why")
    result["gpus"] = gpus
    result["dcgmi"] = (
        run_dcgmi(timeout=dcgmi_timeout) if dcgmi else {"ran": False, "skipped": "--no-dcgmi"}
    )
    outcome, reason = decide(
        gpus, suspect_index, environment_differs=_environment_differs(bundle, slots)
    )
    if outcome == "unknown" and missing and not any(g["result"] == "reproduces" for g in gpus):
        reason = "the bundle cannot recompute its micro-batch: " + "; ".join(missing)
    return _finish(result, outcome, reason, started)


def _gpu_seconds(gpu: Mapping[str, Any]) -> float | None:
    """The time the recomputations and the stress check took on one GPU."""
    spent: list[float] = [
        float((gpu.get(part) or {})["seconds"])
        for part in ("replay", "stress")
        if isinstance((gpu.get(part) or {}).get("seconds"), int | float)
    ]
    return round(sum(spent), 3) if spent else None


def compact_summary(result: Mapping[str, Any], limit: int = TERMINATION_LOG_LIMIT) -> str:
    """The result in at most ``limit`` bytes of JSON, for the termination log: the outcome
    and reason, then per GPU its result, with as much detail as fits."""
    gpus = [
        {
            k: v
            for k, v in (
                ("index", g.get("index")),
                ("local_rank", g.get("local_rank")),
                ("uuid", g.get("uuid")),
                ("result", g.get("result")),
                ("seconds", _gpu_seconds(g)),
            )
            if k != "seconds" or v is not None
        }
        for g in result.get("gpus") or []
    ]
    dcgm = result.get("dcgmi") or {}
    summary: dict[str, Any] = {
        "format": CONFIRMATION_FORMAT,
        "version": CONFIRMATION_VERSION,
        "outcome": result.get("outcome"),
        "reason": str(result.get("reason", ""))[:1024],
        "step": result.get("step"),
        "run_id": result.get("run_id"),
        "node": result.get("node"),
        "seconds": result.get("seconds"),
        "dcgmi": dcgm.get("passed") if dcgm.get("ran") else "skipped",
        "gpus": gpus,
    }

    def size() -> int:
        return len(json.dumps(summary, separators=(",", ":")).encode())

    if size() > limit:  # drop the UUIDs of GPUs that returned the reference first
        for g in gpus:
            if g["result"] == "does-not-reproduce":
                g.pop("uuid", None)
    # Then whole entries, those that returned the reference first: a GPU that reproduces
    # (or could not run) is what the summary is for.
    order = sorted(range(len(gpus)), key=lambda i: (gpus[i]["result"] != "does-not-reproduce", -i))
    dropped: set[int] = set()
    while size() > limit and len(dropped) < len(gpus) - 1:
        dropped.add(order[len(dropped)])
        summary["gpus"] = [g for i, g in enumerate(gpus) if i not in dropped]
        summary["gpus_left_out"] = len(dropped)
    if size() > limit:
        summary["reason"] = summary["reason"][
            : max(0, len(summary["reason"]) - (size() - limit) - 16)
        ]
    return json.dumps(summary, separators=(",", ":"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sdc_agent.confirm",
        description="Recompute an evidence bundle's micro-batch on every GPU of this node and "
        "say whether the suspect's fault reproduces (exit 3 confirmed, 0 not confirmed, "
        "4 unknown).",
    )
    parser.add_argument(
        "bundle", help="the bundle directory (.../sdc-evidence/<run>-<step>-r<rank>)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="recomputations per GPU (default 3)")
    parser.add_argument("--json", type=Path, help="also write the full result here")
    parser.add_argument(
        "--termination-log",
        type=Path,
        help="write a summary of at most 4096 bytes here (e.g. /dev/termination-log)",
    )
    parser.add_argument(
        "--factory",
        help=f"module:function that builds (module, loss_fn), overriding the bundle's way "
        f"(env {BUNDLE_FACTORY_ENV})",
    )
    parser.add_argument("--no-stress", action="store_true", help="skip the GEMM stress check")
    parser.add_argument(
        "--stress-size", type=int, help="GEMM size (default 4096 on CUDA, 256 on CPU)"
    )
    parser.add_argument("--stress-iterations", type=int, help="chained GEMMs per repeat")
    parser.add_argument("--no-dcgmi", action="store_true", help="skip dcgmi diag")
    parser.add_argument(
        "--dcgmi-timeout", type=float, default=1800.0, help="seconds for dcgmi diag (default 1800)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="seconds to wait for the bundle to appear (it is written after the verdict)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = _parser().parse_args(argv)
    if args.repeat < 1:
        _parser().error("--repeat: must be at least 1")
    started = time.perf_counter()
    try:
        result = confirm(
            args.bundle,
            repeats=args.repeat,
            factory=args.factory,
            stress=not args.no_stress,
            stress_size=args.stress_size,
            stress_iterations=args.stress_iterations,
            dcgmi=not args.no_dcgmi,
            dcgmi_timeout=args.dcgmi_timeout,
            wait=args.wait,
        )
    except Exception as exc:  # a bug here must still leave a readable result behind
        traceback.print_exc()
        result = _finish(
            _base_result(args.bundle),
            "unknown",
            f"the confirmation failed: {type(exc).__name__}: {exc}",
            started,
        )
    text = json.dumps(result, indent=1, sort_keys=True, default=str)
    print(text, flush=True)
    if args.json is not None:
        args.json.write_text(text + "\n")
    if args.termination_log is not None:
        try:
            args.termination_log.write_text(compact_summary(result))
        except OSError as exc:
            print(f"cannot write {args.termination_log}: {exc}", file=sys.stderr)
    log.info("outcome %s: %s", result["outcome"], result["reason"])
    return EXIT_CODES[result["outcome"]]


if __name__ == "__main__":
    sys.exit(main())
