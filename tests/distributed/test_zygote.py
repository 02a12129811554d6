"""The kubelet stand-in's workers (sdc_harness.zygote) run with one intra-op thread, as the
pod's OMP_NUM_THREADS=1 gives a fresh interpreter, whoever started the per-process fork
server first (the agent's spawn_local starts it without that variable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sdc_agent.launch import spawn_local
from sdc_harness import zygote

pytestmark = pytest.mark.distributed


def _threads(rank: int, world: int) -> int:
    import torch

    return torch.get_num_threads()


def test_a_worker_has_one_thread_after_spawn_local_started_the_fork_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert spawn_local(_threads, ["a"]) == [1]
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint('threads', torch.get_num_threads())\n")
    log = tmp_path / "worker.log"
    env = {**os.environ, "OMP_NUM_THREADS": zygote.THREADS}
    worker = zygote.start([sys.executable, str(script)], env, log)
    assert worker.wait(timeout=120) == 0, log.read_text()
    assert log.read_text().split() == ["threads", "1"]
