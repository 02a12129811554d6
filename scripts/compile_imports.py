"""Imports what the demo and the tests import, for each extra given, so that Python writes
their bytecode once (run by scripts/bootstrap.sh with PYTHONDONTWRITEBYTECODE unset).

    .venv/bin/python scripts/compile_imports.py agent,operator,test,dev

Compiling every file the extras install (uv's ``--compile-bytecode``, as pip does by
default) compiled 13,594 files in 52 s on a loaded 2-core machine, of which the suite ever
imports about 4,900; importing these modules compiles 4,300 of them, in about a third of the
CPU.
What a test imports beyond them is compiled by the first process that imports it (the
scripts that run the demo and the tests unset PYTHONDONTWRITEBYTECODE). Fails, naming the
module, where one does not import: the install is broken.
"""

from __future__ import annotations

import importlib
import sys

MODULES = {
    "agent": [
        "numpy",
        "torch",
        "torch.distributed",
        "torch.distributed.checkpoint",
        "torch.distributed.fsdp",
        "torch.nn.parallel",
        "torch._inductor.config",
        "sdc_agent",
    ],
    "operator": [
        "aiohttp",
        "boto3",
        "kopf",
        "kubernetes",
        "prometheus_client",
        "sdc_operator",
    ],
    "test": [
        "accelerate",
        "celpy",
        "helm_python",
        "hypothesis",
        "jsonschema",
        "kubernetes_validate",
        "pytest",
        "xdist",
        "yaml",
        "transformers",
        # transformers loads its models lazily: these are what the tests and examples use
        "transformers.models.gpt2.modeling_gpt2",
        "transformers.trainer",
    ],
    "dev": [],
}


def main() -> int:
    extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "agent").split(",") if e]
    for extra in extras:
        # an extra not listed here (pip has already refused one pyproject.toml lacks)
        # compiles nothing now: its modules compile when first imported
        for name in MODULES.get(extra, []):
            try:
                importlib.import_module(name)
            except Exception as e:  # said, and the install fails
                print(f"compile_imports: {name} (extra {extra}) does not import: {e!r}")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
