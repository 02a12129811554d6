"""Evidence bundles: what recomputes one audited micro-batch, kept next to the job's
checkpoints for the confirmation run (:mod:`sdc_agent.confirm`) and the person reviewing.

When the replay audit localizes a suspect, the healthy rank that replayed the suspect's
micro-batch holds everything needed to compute it again: the micro-batch, its RNG and
autocast state, the gradient that reached its loss, the weights it ran with and the result
a healthy GPU computed (the *reference*). A bundle keeps that, so the same micro-batch can
be recomputed later on every GPU of the suspect node and compared with the reference bits.

A bundle is a directory ``<dir>/sdc-evidence/<run>-<step>-r<rank>/`` (``rank`` is the
suspect's global rank) holding:

``bundle.json``
    the manifest: versioned JSON (:data:`BUNDLE_FORMAT`, :data:`BUNDLE_VERSION`) naming
    the step, run, suspect, the reference result, the tolerance in force, how to rebuild
    the model, the numerics settings, and every file with its size and SHA-256;
``rng.pt``
    the CPU (and CUDA) RNG state right before the micro-batch's forward;
``batch.pt``
    the micro-batch (any nesting of tensors in dicts, lists, tuples), on the CPU;
``weights.pt``
    every parameter and buffer it ran with (non-persistent buffers too), by name;
``module.pt``
    the module without its weights (pickled with its tensors on the ``meta`` device), when
    the model is rebuilt by unpickling (the default; see below).

How the model is rebuilt. The confirmation pod runs the job's image, so the training code
is there. By default the bundle records the training script (``sys.argv[0]``, absolute,
the module name where it ran with ``python -m``) and ``sys.path``, pickles the module's
structure, and records the loss function by reference (``module:qualname``). The
confirmation imports the script as a module of another name (so its
``if __name__ == "__main__"`` block does not run), aliases it as ``__main__`` while
unpickling, and loads the weights into the result. Limits: the script's top-level code
runs on import; hooks registered on the module are not kept (the fault injector's
included: the confirmation attaches its own); classes made at run time (parametrizations,
``torch.compile`` wrappers) do not pickle; the loss function must be a module-level
function. Where that does not fit, give a factory: ``bundle_factory="pkg.mod:build"`` (env
``HYPERPOD_SDC_BUNDLE_FACTORY``), a function of no arguments returning ``(module,
loss_fn)``; the weights are then loaded into the module it builds, by name.

Bounded: at most ``bundle_max_bytes`` (default 2 GiB, env
``HYPERPOD_SDC_BUNDLE_MAX_BYTES``) of ``.pt`` files; the manifest (kilobytes) comes on top.
What does not fit is left out, RNG first kept, then the micro-batch, then the weights, and
the manifest says what was left out and why (``complete: false``): a confirmation then
cannot recompute and says so. Writing never fails training: the training thread only
takes the snapshot it must (on CUDA an asynchronous copy into pinned host memory; on the
CPU a copy), a background thread (:class:`BundleWriter`) serializes it into a temporary
directory and renames it into place, so a bundle is there whole or not at all.

Reading (:func:`read_bundle`) validates the manifest and every file's size and digest and
names what is wrong (:class:`~sdc_agent.errors.BundleError`). A bundle is unpickled with
``weights_only=False``: it executes what the job's own code could, so a confirmation must
run with the job's image and privileges, never the operator's.

One module per concept: :mod:`.format` (names, version, manifest validation),
:mod:`.settings`, :mod:`.reference` (the reference result, the shared recomputation),
:mod:`.snapshot` (training thread), :mod:`.writer` (background thread), :mod:`.reader` and
:mod:`.rebuild` (the model, for the confirmation). This package re-exports their public
names.
"""

from __future__ import annotations

from .format import (
    BUNDLE_DIR_ENV,
    BUNDLE_FACTORY_ENV,
    BUNDLE_FORMAT,
    BUNDLE_MAX_BYTES_ENV,
    BUNDLE_VERSION,
    DEFAULT_MAX_BYTES,
    EVIDENCE_DIR,
    GRADIENTS_OF,
    MANIFEST,
    REFERENCE_VERSION,
    Tolerance,
    bundle_path,
)
from .reader import Bundle, read_bundle
from .reference import Recomputed, recompute, reference_of
from .settings import BundleSettings
from .snapshot import EvidenceSnapshot, take_snapshot
from .writer import BundleWriter, WriteResult, write_bundle

__all__ = [
    "BUNDLE_DIR_ENV",
    "BUNDLE_FACTORY_ENV",
    "BUNDLE_FORMAT",
    "BUNDLE_MAX_BYTES_ENV",
    "BUNDLE_VERSION",
    "DEFAULT_MAX_BYTES",
    "EVIDENCE_DIR",
    "GRADIENTS_OF",
    "MANIFEST",
    "REFERENCE_VERSION",
    "Bundle",
    "BundleSettings",
    "Recomputed",
    "BundleWriter",
    "EvidenceSnapshot",
    "Tolerance",
    "WriteResult",
    "bundle_path",
    "read_bundle",
    "recompute",
    "reference_of",
    "take_snapshot",
    "write_bundle",
]
