"""hyperpod-sdc agent: catch silent data corruption inside PyTorch DDP training.

``import sdc_agent.protocol`` must work without torch (the operator image has none), so
the torch-dependent names below load lazily, on first use.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

__all__ = [
    "BundleError",
    "CheckpointNotFoundError",
    "ConfigError",
    "FaultSpec",
    "Fingerprinter",
    "Guard",
    "GuardConfig",
    "OperatorUnreachableError",
    "ProtocolError",
    "ReplayStats",
    "SDCError",
    "StepResult",
    "Verdict",
    "enable_determinism",
    "fingerprint",
    "format_fingerprint",
]

_LAZY = {
    "BundleError": "errors",
    "CheckpointNotFoundError": "errors",
    "ConfigError": "errors",
    "OperatorUnreachableError": "errors",
    "ProtocolError": "errors",
    "SDCError": "errors",
    "FaultSpec": "faults",
    "Fingerprinter": "fingerprint",
    "fingerprint": "fingerprint",
    "format_fingerprint": "fingerprint",
    "Guard": "guard",
    "ReplayStats": "audit",
    "enable_determinism": "determinism",
    "GuardConfig": "config",
    "StepResult": "verdict",
    "Verdict": "verdict",
}

if "torch.distributed" in sys.modules:
    # torch.distributed.nn.functional binds the default process group into its functions'
    # default arguments when first imported, and DDP's constructor imports it (through
    # torch._dynamo). Imported after init_process_group, it holds that group for good:
    # destroy_process_group() no longer ends it, and gloo's threads are still running when
    # the interpreter exits, where torch 2.13 sometimes aborts the process ("terminate
    # called without an active exception"). Imported now, before the group exists, it
    # binds None. (Only where torch is loaded already: sdc_agent.protocol needs no torch.)
    importlib.import_module("torch.distributed.nn.functional")

if TYPE_CHECKING:
    from .audit import ReplayStats
    from .config import GuardConfig
    from .determinism import enable_determinism
    from .errors import (
        BundleError,
        CheckpointNotFoundError,
        ConfigError,
        OperatorUnreachableError,
        ProtocolError,
        SDCError,
    )
    from .faults import FaultSpec
    from .fingerprint import Fingerprinter, fingerprint, format_fingerprint
    from .guard import Guard
    from .verdict import StepResult, Verdict


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sdc_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
