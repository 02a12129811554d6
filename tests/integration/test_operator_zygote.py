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

import pytest

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
    start_operator: Callable[..., OperatorProcess], monkeypatch: pytest.MonkeyPatch
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
    # nor is one with a PYTHON* variable the zygote's interpreter did not start with (read
    # as an interpreter starts: a forked child would silently ignore it) ...
    assert not operator_zygote.forkable("sdc_operator", {**env, "PYTHONWARNINGS": "error"})
    assert not operator_zygote.forkable("sdc_operator", {**env, "PYTHONDEVMODE": "1"})
    # ... judged by the env the running zygote started with, not this process's env now
    assert operator_zygote._zygote is not None and operator_zygote._zygote.proc.poll() is None
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")
    assert not operator_zygote.forkable("sdc_operator", dict(os.environ))
    monkeypatch.delenv("PYTHONASYNCIODEBUG")
    monkeypatch.setenv("HYPERPOD_SDC_SOMETHING", "1")  # the child's own env: forkable
    assert operator_zygote.forkable("sdc_operator", dict(os.environ))


EXITS_LATE = """
import threading

def call():  # a call still in flight as the main module returns (a SageMaker call)
    threading.main_thread().join()  # returns once the interpreter is ending
    print("the call in flight returned", flush=True)

threading.Thread(target=call).start()
print("the main module returned", flush=True)
"""


def test_a_forked_child_waits_for_its_threads_as_python_m_would(tmp_path: Path) -> None:
    """The interpreter joins non-daemon threads (the executors' workers) as it ends, before
    the atexit handlers: so does a forked child, rather than ending with the call."""
    (tmp_path / "exits_late.py").write_text(EXITS_LATE)
    plain = subprocess.run(
        [sys.executable, "-m", "exits_late"], cwd=tmp_path, capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == "the main module returned\nthe call in flight returned\n"
    zygote = operator_zygote._Zygote()  # start() forks only the operator
    try:
        log = tmp_path / "forked.log"
        request = {"module": "exits_late", "env": dict(os.environ), "log": str(log)}
        pid = zygote.fork({**request, "cwd": str(tmp_path)})
        assert operator_zygote.Forked(zygote, pid).wait(60) == 0
        assert log.read_text() == plain.stdout
    finally:
        zygote.close()
