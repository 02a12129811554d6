"""Nothing in the agent keeps the default process group alive past
``destroy_process_group()`` (tests/distributed/test_quickstart.py checks it end to end)."""

from __future__ import annotations

import subprocess
import sys


def test_optimizer_kinds_are_told_without_importing_torch_distributed_optim() -> None:
    # torch.distributed.optim binds the default process group into a default argument at
    # import: imported after init_process_group, it keeps the group (and gloo's threads)
    # alive past destroy_process_group(). An optimizer of its classes implies the import.
    code = (
        "import sys, torch\n"
        "from sdc_agent.weights import _is_sharded, keeps_replicas_apart\n"
        "sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
        "assert not _is_sharded(sgd) and not keeps_replicas_apart(sgd)\n"
        "assert 'torch.distributed.optim' not in sys.modules\n"
        "from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer\n"
        "class Zero(ZeroRedundancyOptimizer):\n"
        "    def __init__(self): pass\n"
        "class Local(PostLocalSGDOptimizer):\n"
        "    def __init__(self): pass\n"
        "assert _is_sharded(Zero()) and not keeps_replicas_apart(Zero())\n"
        "assert keeps_replicas_apart(Local()) and not _is_sharded(Local())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
