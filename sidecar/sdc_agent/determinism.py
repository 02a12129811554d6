"""Deterministic kernels, which the replay audit needs to compare bits."""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["CUBLAS_WORKSPACE_CONFIG", "enable_determinism"]

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS needs a fixed workspace for deterministic results; it reads the variable once,
when CUDA initialises it, so set it before any CUDA work."""


def enable_determinism() -> dict[str, object]:
    """Make PyTorch pick deterministic kernels; returns what it set.

    Call it at start-up, before CUDA is used: it sets ``CUBLAS_WORKSPACE_CONFIG`` (unless
    already set), ``torch.use_deterministic_algorithms(True)`` (operations without a
    deterministic implementation then raise instead of silently varying),
    ``cudnn.deterministic = True`` and ``cudnn.benchmark = False``. Deterministic kernels
    can be slower; run the Guard with ``replay_mode="calibrate"`` to check that replays
    agree before relying on the audit.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn(
            "sdc_agent.enable_determinism: CUDA is already initialised, so "
            "CUBLAS_WORKSPACE_CONFIG may not take effect; call it before any CUDA work",
            RuntimeWarning,
            stacklevel=2,
        )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {
        "CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "use_deterministic_algorithms": True,
        "cudnn.deterministic": True,
        "cudnn.benchmark": False,
    }
