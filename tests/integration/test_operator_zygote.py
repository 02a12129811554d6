"""The operator zygote (scripts/sdc_harness/operator_zygote.py): a forked operator is the
process ``python -m sdc_operator`` would be, as far as a test can tell from outside: its own
env, output, exit status, session and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sdc_harness import operator_zygote
from sdc_harness.cluster import OperatorProcess


def test_a_forked_operator_reads_its_own_env_and_exits_as_python_m_would(tmp_path: Path) -> None:
    env = {**os.environ, "HYPERPOD_SDC_RESYNC_SECONDS": "nope"}
    plain = subprocess.run(
        [sys.executable, "-m", "sdc_operator"], env=env, capture_output=True, text=True
    )
    log = tmp_path / "forked.log"
    forked = operator_zygote.start(env, log)
    assert forked.wait(60) == plain.returncode == 2
    assert log.read_text() == plain.stderr
    assert "HYPERPOD_SDC_RESYNC_SECONDS: expected a number, got 'nope'" in plain.stderr
    # the zygote's own env is not the child's: the same zygote, another env
    again = operator_zygote.start({**env, "HYPERPOD_SDC_RESYNC_SECONDS": "x"}, log)
    assert again.wait(60) == 2
    assert "got 'x'" in log.read_text()


def test_a_forked_operator_has_its_own_session_and_dies_of_its_signal(
    start_operator: Callable[..., OperatorProcess],
) -> None:
    op = start_operator()
    assert isinstance(op.proc, operator_zygote.Forked)
    assert os.getsid(op.proc.pid) == op.proc.pid
    op.proc.send_signal(signal.SIGKILL)
    assert op.proc.wait(30) == -signal.SIGKILL
    # another release's code, or another PYTHONPATH, is not forked
    env = dict(os.environ)
    assert operator_zygote.forkable("sdc_operator", env)
    assert not operator_zygote.forkable("tests.integration.previous_operator", env)
    assert not operator_zygote.forkable("sdc_operator", {**env, "PYTHONPATH": "/elsewhere"})
