"""The CPU fingerprint kernel: a few lines of portable C, built once per process.

Why C and not ``torch.compile``: Inductor's C++ code generation is tied to the CPU's vector
ISA and has failed or miscompiled the fingerprint's integer kernel on some CPUs (on an AMD
EPYC with AVX2 it did not compile; with ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine it
compiled and summed only half of the lanes). Plain PyTorch cannot widen 32-bit integers into
64-bit sums without writing a widened copy, which alone costs more than ``torch.sum`` over
the tensor. This kernel has no intrinsics and no ISA-specific code: the inner loop is two
additions per element on fixed-size lane arrays, which every C compiler vectorizes for the
machine it runs on (``-march=native``) or, failing that, for the baseline ISA.

Check 3 reads the weights and the optimizer's moments right after the update, from memory,
not cache (the update's footprint is larger than the last-level cache). The widening loop
issues more instructions per byte than a plain sum, and a core then keeps fewer cache
misses in flight than a sum does: the inner loop asks for every cache line 4 KiB ahead
(``__builtin_prefetch``, which GCC and Clang provide and which never faults; a no-op
elsewhere). Over 113 MB read cold on one core of a Xeon (AVX-512) that took the kernel
from 11.5 to 8.3 ms, ``torch.sum``'s 8.3 ms over the same bytes; tensors that sit in cache
take the same time as before (``bench/overhead.py``'s ``bound`` times both cases).

The sums, for a block of ``Q`` vectors of ``V`` lanes starting at element ``g``
(``i = g + V*q + l``): per lane ``A_l = sum_q v[q,l]`` and ``B_l = sum_q (Q - q) v[q,l]``
(``B += A`` after ``A += v``), so ``sum_q q v[q,l] = Q*A_l - B_l`` and

    sum (2i + 1) v_i = (2g + 1) * sum_l A_l + 2 * sum_l (V*(Q*A_l - B_l) + l*A_l)

all modulo 2**64 (unsigned arithmetic). The per-block accumulators of 8- and 16-bit
elements are 32-bit integers, exact within the block sizes below; 32-bit elements use 64-bit
accumulators; 64-bit elements wrap modulo 2**64, which the formula tolerates.

It needs a C compiler at run time (``$CC``, else ``cc``, ``gcc``, ``clang``), as Inductor and
Triton do. It is compiled into a fresh private directory and loaded with :mod:`ctypes`;
:class:`NativeKernel` checks its result against the definition before anyone uses it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .errors import SDCError

__all__ = ["COMPILER_ENV", "NativeKernel", "NativeKernelError", "native_kernel"]

COMPILER_ENV = "CC"
"""The C compiler to build the kernel with; when set, no other compiler is tried."""

_ABI = 1
_BUILD_TIMEOUT_S = 120.0

_SOURCE = r"""
#include <stdint.h>

#define V8 64
#define V16 32
#define V32 32
#define V64 8
#define Q8 1024   /* |B| <= Q(Q+1)/2 * 128   < 2^31 */
#define Q16 256   /* |B| <= Q(Q+1)/2 * 32768 < 2^31 */
#define Q32 1024  /* 64-bit accumulators: |B| < 2^51 */
#define Q64 1024  /* 64-bit accumulators wrapping modulo 2^64 */

typedef uint64_t u64;

static void fold(u64 *W, u64 *P, u64 g, u64 V, u64 Q, const int64_t *A, const int64_t *B) {
    u64 w = 0, s = 0;
    for (u64 l = 0; l < V; l++) {
        u64 a = (u64)A[l], b = (u64)B[l];
        s += a;
        w += V * (Q * a - b) + l * a;
    }
    *W += (2 * g + 1) * s + 2 * w;
    *P += s;
}

/* Ask for each cache line this far ahead (see the module docstring). The address is
   computed as an integer: near the end of a tensor it lies past the buffer, which a
   prefetch may name (it never faults) but pointer arithmetic may not. */
#define AHEAD 4096
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(P, BYTES)                                          \
    for (int o_ = 0; o_ < (int)(BYTES); o_ += 64)                   \
        __builtin_prefetch((const void *)((uintptr_t)(P) + AHEAD + (uintptr_t)o_))
#else
#define PREFETCH(P, BYTES)
#endif

#define TAIL(T)                                                     \
    for (; i < n; i++) {                                            \
        u64 v = (u64)(int64_t)x[i];                                 \
        W += (2 * (base + (u64)i) + 1) * v;                         \
        P += v;                                                     \
    }

#define NARROW(NAME, T, V, Q) WIDE(NAME, T, V, Q, int32_t)

#define WIDE(NAME, T, V, Q, ACC)                                    \
static void NAME(const T *x, int64_t n, u64 base, u64 *W_, u64 *P_) { \
    u64 W = 0, P = 0;                                               \
    int64_t i = 0;                                                  \
    while (i + V <= n) {                                            \
        int64_t q_end = (n - i) / V;                                \
        if (q_end > Q) q_end = Q;                                   \
        ACC A[V] = {0}, B[V] = {0};                                 \
        const T *p = x + i;                                         \
        for (int64_t q = 0; q < q_end; q++, p += V) {               \
            PREFETCH(p, V * sizeof(T));                             \
            for (int l = 0; l < V; l++) { A[l] += (ACC)p[l]; B[l] += A[l]; } \
        }                                                           \
        int64_t A64[V], B64[V];                                     \
        for (int l = 0; l < V; l++) { A64[l] = (int64_t)A[l]; B64[l] = (int64_t)B[l]; } \
        fold(&W, &P, base + (u64)i, V, (u64)q_end, A64, B64);       \
        i += q_end * V;                                             \
    }                                                               \
    TAIL(T)                                                         \
    *W_ += W; *P_ += P;                                             \
}

NARROW(fp8, int8_t, V8, Q8)
NARROW(fp16, int16_t, V16, Q16)
WIDE(fp32, int32_t, V32, Q32, int64_t)
WIDE(fp64, int64_t, V64, Q64, u64)

int64_t sdc_fp_abi(void) { return 1; }

/* items: count rows of (pointer, elements, width in bytes, index of the first element,
   output row); out: rows of (weighted, plain), added to. Returns 0, or -1 on a bad width. */
int64_t sdc_fp_many(int64_t count, const int64_t *items, int64_t *out) {
    for (int64_t k = 0; k < count; k++) {
        const int64_t *it = items + 5 * k;
        const void *x = (const void *)(intptr_t)it[0];
        int64_t n = it[1];
        u64 base = (u64)it[3];
        u64 *w = (u64 *)(out + 2 * it[4]), *p = w + 1;
        switch (it[2]) {
        case 1: fp8((const int8_t *)x, n, base, w, p); break;
        case 2: fp16((const int16_t *)x, n, base, w, p); break;
        case 4: fp32((const int32_t *)x, n, base, w, p); break;
        case 8: fp64((const int64_t *)x, n, base, w, p); break;
        default: return -1;
        }
    }
    return 0;
}
"""


class NativeKernelError(SDCError):
    """The C kernel could not be built or loaded here (no compiler, a compiler error)."""


def _compilers() -> list[str]:
    chosen = os.environ.get(COMPILER_ENV, "").strip()
    if chosen:
        return [chosen]
    return [c for c in ("cc", "gcc", "clang") if shutil.which(c)]


def _build(march: str | None) -> ctypes.CDLL:
    """Compile the source into a fresh private directory and load it."""
    compilers = _compilers()
    if not compilers:
        raise NativeKernelError(f"no C compiler found (set {COMPILER_ENV}, or install cc)")
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sdc-fingerprint-") as tmp:
        src = os.path.join(tmp, "fingerprint.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        for cc in compilers:
            # -march=native falls back to the compiler's default target (some compilers
            # or CPUs lack it); an explicit target does not, so it is never mislabelled.
            flag_sets = [[f"-march={march}"]] if march else [[]]
            if march == "native":
                flag_sets.append([])
            for extra in flag_sets:
                lib = os.path.join(tmp, f"fingerprint{len(problems)}.so")
                cmd = [cc, "-O3", "-std=c99", "-fPIC", "-shared", *extra, src, "-o", lib]
                try:
                    done = subprocess.run(
                        cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S
                    )
                except (OSError, subprocess.SubprocessError) as exc:
                    problems.append(f"{' '.join(cmd)}: {type(exc).__name__}: {exc}")
                    break  # this compiler does not run at all: try the next one
                if done.returncode == 0:
                    # dlopen maps the file; removing the directory afterwards is safe.
                    return ctypes.CDLL(lib)
                problems.append(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr[-500:]}")
    raise NativeKernelError("; ".join(problems))


class NativeKernel:
    """Fingerprints contiguous CPU tensors with the C kernel; many tensors in one call."""

    def __init__(self, march: str | None = "native") -> None:
        lib = _build(march)
        self.march = march
        abi = lib.sdc_fp_abi
        abi.restype = ctypes.c_int64
        abi.argtypes = []
        if abi() != _ABI:
            raise NativeKernelError(f"the built kernel reports ABI {abi()}, expected {_ABI}")
        fn = lib.sdc_fp_many
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self._lib = lib  # keeps the library loaded
        self._fn = fn

    def words(self, bits: Sequence[torch.Tensor], threads: int = 1) -> torch.Tensor:
        """``[len(bits), 2]`` int64 fingerprints of contiguous 1-D CPU integer tensors.

        With ``threads > 1`` and enough bytes, the work is cut into that many pieces of
        about equal size (a tensor may be cut; a piece starting at element ``o`` is summed
        with weights ``2*(o + i) + 1``) run on a thread pool: ctypes releases the GIL, and
        integer sums added in any order give the same words.
        """
        out = torch.zeros((len(bits), 2), dtype=torch.int64)
        items = [
            (b.data_ptr(), b.numel(), b.element_size(), 0, row)
            for row, b in enumerate(bits)
            if b.numel()
        ]
        if not items:
            return out
        total = sum(n * w for _, n, w, _, _ in items)
        shares = min(threads, total // _PARALLEL_MIN_BYTES)
        if shares <= 1:
            self._run(items, out)
            return out
        outs = [torch.zeros_like(out) for _ in range(shares)]
        pieces = _split(items, total, shares)
        list(_pool(shares).map(self._run, pieces, outs))
        # The tensors in ``bits`` stay referenced until every piece has run.
        return torch.stack(outs).sum(0)

    def _run(self, items: Sequence[tuple[int, int, int, int, int]], out: torch.Tensor) -> None:
        if not items:
            return
        table = torch.tensor(items, dtype=torch.int64)
        if self._fn(len(items), table.data_ptr(), out.data_ptr()) != 0:
            raise NativeKernelError("the kernel was given an element width it does not know")


# Below this many bytes per thread, starting threads costs more than it saves.
_PARALLEL_MIN_BYTES = 4 << 20
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_PID = 0
_pool_lock = threading.Lock()


def _pool(size: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE, _POOL_PID
    with _pool_lock:
        # A forked child (a DataLoader worker) inherits the pool but not its threads.
        if _POOL is None or size > _POOL_SIZE or os.getpid() != _POOL_PID:
            if _POOL is not None and os.getpid() == _POOL_PID:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=size, thread_name_prefix="sdc-fingerprint")
            _POOL_SIZE = size
            _POOL_PID = os.getpid()
        return _POOL


def _split(
    items: list[tuple[int, int, int, int, int]], total: int, shares: int
) -> list[list[tuple[int, int, int, int, int]]]:
    """Cut ``items`` into ``shares`` consecutive runs of about ``total / shares`` bytes."""
    quota = -(-total // shares)
    pieces: list[list[tuple[int, int, int, int, int]]] = [[]]
    room = quota
    for ptr, n, width, _, row in items:
        start = 0
        while start < n:
            if room <= 0 and len(pieces) < shares:
                pieces.append([])
                room = quota
            take = n - start if len(pieces) == shares else min(n - start, max(1, room // width))
            pieces[-1].append((ptr + start * width, take, width, start, row))
            start += take
            room -= take * width
    return pieces


_kernels: dict[tuple[str | None, str], NativeKernel | NativeKernelError] = {}
_kernels_lock = threading.Lock()


def native_kernel(march: str | None = "native") -> NativeKernel:
    """The process's kernel for ``march`` (``None``: the compiler's default target), built
    on first use; raises :class:`NativeKernelError` (every time) if it cannot be built."""
    key = (march, os.environ.get(COMPILER_ENV, ""))
    with _kernels_lock:
        got = _kernels.get(key)
        if got is None:
            try:
                got = NativeKernel(march)
            except NativeKernelError as exc:
                got = exc
            except OSError as exc:  # ctypes could not load what was built
                got = NativeKernelError(f"loading the built kernel failed: {exc}")
            _kernels[key] = got
        if isinstance(got, NativeKernelError):
            raise got
        return got
