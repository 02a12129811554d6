"""Bitwise tensor fingerprints, computed on the tensor's device.

A fingerprint is two 64-bit words (an ``int64`` tensor of shape ``[2]``):

``weighted``
    ``sum((2*i + 1) * bits[i]) mod 2**64`` where ``bits[i]`` is element ``i``'s bit pattern
    read as a signed integer of the element's width (int16 for bf16/fp16, int32 for fp32).
    Every weight is odd, hence invertible modulo ``2**64``: changing one element by any
    amount changes the sum. Swapping two elements ``i < j`` changes it by
    ``2 * (j - i) * (bits[i] - bits[j])``, which is not ``0 mod 2**64`` while the tensor has
    fewer than ``2**31`` elements (the two factors together carry at most 63 factors of two).
``plain``
    ``sum(bits[i]) mod 2**64``: order-free. Two tensors with equal ``plain`` and different
    ``weighted`` words hold the same values in a different order, which is worth knowing
    when reading evidence.

Both words are integer sums, so they do not depend on the order in which a kernel adds:
the same bits give the same fingerprint on every device, process and backend.

Backends: ``eager`` is plain PyTorch and runs anywhere; ``compile`` fuses the widening,
the weighting and both sums into one pass over memory with :func:`torch.compile` (0.65
to 0.85 of ``torch.sum``'s throughput over the same float32 bytes on CPU, about ten
times the eager speed; on an H200, about 2 TB/s for float32 and 1 TB/s for bfloat16 at
256 M elements, 0.5 and 0.34 of ``torch.sum``; see ``bench/fingerprint.py`` and
``bench/gpu_check.py``). The eager kernel works in chunks and is launch-bound on CUDA
(about 4 GB/s): there it is only the fallback. ``auto`` compiles where
``torch.compile`` works and falls back to eager, with a warning, where it does not.
Compiling costs seconds once per process and dtype (a C++ compiler on CPU, Triton on
CUDA); :meth:`Fingerprinter.warm_up` pays it up front.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from .errors import ConfigError, SDCError

__all__ = [
    "FINGERPRINT_BACKENDS",
    "INT_OF_WIDTH",
    "Fingerprinter",
    "combine_fingerprints",
    "fingerprint",
    "format_fingerprint",
]

log = logging.getLogger(__name__)

Backend = Literal["auto", "compile", "eager"]
FINGERPRINT_BACKENDS: tuple[str, ...] = ("auto", "compile", "eager")

INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The signed integer dtype of each element width, to read a tensor's bits."""

# The eager path works in chunks so the int64 temporaries stay in cache and the weight
# vector is built once per device.
_EAGER_CHUNK = 1 << 16
_CUDA_PROBE = (1 << 24) + 3  # odd, to cover the tail of a pairs kernel


def _as_flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a 1-D tensor of signed integers of the same width."""
    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    int_dtype = INT_OF_WIDTH[flat.element_size()]
    return flat if flat.dtype == int_dtype else flat.view(int_dtype)


def _fused_words(bits: torch.Tensor) -> torch.Tensor:
    # One expression so torch.compile fuses it into a single pass.
    v = bits.to(torch.int64)
    pos = torch.arange(v.numel(), device=v.device, dtype=torch.int64)
    return torch.stack([((pos * 2 + 1) * v).sum(), v.sum()])


def _fused_words_pairs(pairs: torch.Tensor) -> torch.Tensor:
    # The same words as _fused_words for 16-bit elements, read two at a time as int32:
    # CPU compilers vectorize int32 -> int64 widening far better than int16 -> int64.
    lo = (((pairs & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int64)  # element 2k, sign-extended
    hi = (pairs >> 16).to(torch.int64)  # element 2k + 1
    k = torch.arange(pairs.numel(), device=pairs.device, dtype=torch.int64)
    return torch.stack([((k * 4 + 1) * lo + (k * 4 + 3) * hi).sum(), (lo + hi).sum()])


_weights_cache: dict[torch.device, torch.Tensor] = {}
_weights_lock = threading.Lock()


def _chunk_weights(device: torch.device) -> torch.Tensor:
    with _weights_lock:
        w = _weights_cache.get(device)
        if w is None:
            w = torch.arange(_EAGER_CHUNK, device=device, dtype=torch.int64) * 2 + 1
            _weights_cache[device] = w
        return w


def _eager_words(bits: torch.Tensor) -> torch.Tensor:
    # sum((2*(base+c)+1) * v_c) = sum((2c+1) * v_c) + 2*base*sum(v_c), chunk by chunk.
    n = bits.numel()
    weights = _chunk_weights(bits.device)
    weighted = torch.zeros((), dtype=torch.int64, device=bits.device)
    plain = torch.zeros((), dtype=torch.int64, device=bits.device)
    for base in range(0, n, _EAGER_CHUNK):
        v = bits[base : base + _EAGER_CHUNK].to(torch.int64)
        s = v.sum()
        weighted += (weights[: v.numel()] * v).sum() + s * (2 * base)
        plain += s
    return torch.stack([weighted, plain])


class Fingerprinter:
    """Computes fingerprints with one backend; thread-safe, one per process is enough.

    With ``compile`` or ``auto`` the first fingerprint of each dtype and device
    compiles a kernel and checks it against the eager result on a probe tensor; if
    compiling fails or disagrees, it warns and stays eager for that dtype, so a broken
    toolchain costs speed, never correctness.
    """

    def __init__(self, backend: str = "auto") -> None:
        if backend not in FINGERPRINT_BACKENDS:
            raise ConfigError(
                f"fingerprint_backend: must be one of {', '.join(FINGERPRINT_BACKENDS)}, "
                f"got {backend!r}"
            )
        self.backend = backend
        self._compiled: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._compiled_pairs: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._verified: dict[tuple[torch.dtype, str], bool] = {}
        self._lock = threading.Lock()

    def warm_up(self, dtypes: set[torch.dtype], device: torch.device) -> None:
        """Compile (and check) the kernels for ``dtypes`` now rather than on first use."""
        for dtype in sorted(dtypes, key=str):
            self(torch.zeros(2, dtype=dtype, device=device))

    def _use_compiled(self, bits: torch.Tensor) -> bool:
        key = (bits.dtype, bits.device.type)
        with self._lock:
            ok = self._verified.get(key)
            if ok is not None:
                return ok
            ok = self._try_compile(bits)
            self._verified[key] = ok
            return ok

    def _try_compile(self, bits: torch.Tensor) -> bool:
        try:
            if self._compiled is None:
                self._compiled = torch.compile(_fused_words, dynamic=True)
                self._compiled_pairs = torch.compile(_fused_words_pairs, dynamic=True)
            # The first call fixes the size hint of the dynamic-shape kernel, and Inductor
            # picks its reduction split from it: a small first call on CUDA gave a kernel
            # stuck at about 16 GB/s for every size (H200), a large one runs near memory
            # speed. The CPU kernel does not care (measured), so it keeps a small probe.
            numel = _CUDA_PROBE if bits.device.type == "cuda" else 4099
            probe = torch.arange(numel, device=bits.device, dtype=torch.int64)
            probe = (probe * 2654435761 % 65521 - 32000).to(bits.dtype)
            got = self._run_compiled(probe)
            want = _eager_words(probe)
        except Exception as exc:  # any compiler or toolchain failure: stay correct
            problem = (
                f"torch.compile of the fingerprint kernel failed for {bits.dtype} on "
                f"{bits.device.type} ({type(exc).__name__}: {exc})"
            )
            return self._fall_back(problem, exc)
        if not torch.equal(got, want):
            problem = (
                f"the compiled fingerprint kernel disagrees with the eager one for "
                f"{bits.dtype} on {bits.device.type}"
            )
            return self._fall_back(problem, None)
        return True

    def _fall_back(self, problem: str, cause: Exception | None) -> bool:
        if self.backend == "compile":
            raise SDCError(f"fingerprint_backend 'compile': {problem}") from cause
        warnings.warn(
            f"sdc_agent: {problem}; using the eager kernel, which is slower but gives the "
            "same fingerprints (set fingerprint_backend='eager' to skip compiling)",
            RuntimeWarning,
            stacklevel=5,
        )
        return False

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fingerprint of ``tensor``: an int64 tensor ``[weighted, plain]`` on its device."""
        bits = _as_flat_bits(tensor)
        if bits.numel() == 0:
            return torch.zeros(2, dtype=torch.int64, device=bits.device)
        if self.backend != "eager" and self._use_compiled(bits):
            return self._run_compiled(bits)
        return _eager_words(bits)

    def _run_compiled(self, bits: torch.Tensor) -> torch.Tensor:
        assert self._compiled is not None and self._compiled_pairs is not None
        n = bits.numel()
        if bits.element_size() != 2 or n < 2 or bits.data_ptr() % 4:
            return self._compiled(bits)
        even = n - n % 2
        words = self._compiled_pairs(bits[:even].view(torch.int32))
        if n % 2:
            last = bits[n - 1].to(torch.int64)
            words = words + torch.stack([last * (2 * (n - 1) + 1), last])
        return words

    def many(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(combined, per_tensor)``: one fingerprint of the sequence, and one per tensor.

        ``per_tensor`` has shape ``[len(tensors), 2]``; ``combined`` weights tensor ``k``'s
        words by ``2k + 1`` so reordering or changing any tensor changes it.
        """
        if not tensors:
            empty = torch.zeros((0, 2), dtype=torch.int64)
            return combine_fingerprints(empty), empty
        device = tensors[0].device
        per_tensor = torch.stack([self(t).to(device) for t in tensors])
        return combine_fingerprints(per_tensor), per_tensor


def combine_fingerprints(per_tensor: torch.Tensor) -> torch.Tensor:
    """Fold a ``[k, 2]`` stack of fingerprints into one, order-sensitively."""
    k = per_tensor.shape[0]
    weights = torch.arange(k, device=per_tensor.device, dtype=torch.int64) * 2 + 1
    return torch.stack([(per_tensor[:, 0] * weights).sum(), per_tensor[:, 1].sum()])


_default = Fingerprinter("auto")


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Fingerprint ``tensor`` with the ``auto`` backend (see the module docstring).

    The first call per dtype compiles a kernel, which takes seconds; use
    ``Fingerprinter("eager")`` for a few small tensors.
    """
    return _default(tensor)


def format_fingerprint(words: torch.Tensor | Sequence[int]) -> str:
    """Hex form of a fingerprint for logs and evidence (copies two words to the host)."""
    values = words.tolist() if isinstance(words, torch.Tensor) else list(words)
    return ":".join(f"{int(w) & 0xFFFFFFFFFFFFFFFF:016x}" for w in values)
