"""Worker processes forked from a process that imported torch once (a zygote), instead of
each ``python script.py`` importing it: the kubelet stand-in's way to start a pod's
workers.

A worker is still a process of its own, in its own session, with exactly the env, argv,
``sys.path[0]`` and log the kubelet gives it; only the imports in :data:`PRELOAD` (about 4 s
of CPU per process on the 2-core machine, and as much again for Inductor's config, which
DistributedDataParallel imports; 18 worker start-ups per demo) are inherited from
the fork server (multiprocessing's "forkserver": none of the caller's threads or state).
Each worker's ``OMP_NUM_THREADS`` must be the fork server's (the OpenMP runtime reads it
when torch is imported): :func:`start` refuses another value.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path

__all__ = ["PRELOAD", "Forked", "start"]

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    # DistributedDataParallel imports Inductor's config as it wraps a model: about as
    # long as torch's own import
    "torch._inductor.config",
    "torch.distributed.fsdp",  # examples/train_fsdp.py
    "torch.distributed.checkpoint",  # the verified snapshot, DCP
]
"""What the fork server imports: torch, not the agent (it reads its env when a rank starts)."""
THREADS = "1"
"""The fork server's ``OMP_NUM_THREADS``, and every worker's."""


def _main(argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked worker: its session, log, env and argv, then the script as
    ``__main__`` (its SystemExit is the process's exit status)."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # The fork server is the caller's one per process: another user of it (the agent's
    # spawn_local) may have started it first, without OMP_NUM_THREADS=1 (then 2 threads on
    # the 2-core machine, whose MKL may pick a different kernel mid-run under load).
    import torch  # preloaded: nothing to import here

    torch.set_num_threads(int(THREADS))
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # A forked process ends without the interpreter's exit handlers: run them (an
        # evidence bundle still being written is finished there, as at a normal exit).
        atexit._run_exitfuncs()


class Forked:
    """What :class:`subprocess.Popen` offers the runner: ``pid``, ``poll``, ``wait``,
    ``returncode`` (negative for a signal, as Popen)."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        self.pid: int = process.pid or 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self.process.is_alive():
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def start(command: list[str], env: dict[str, str], log: Path) -> Forked:
    """``command`` (``[sys.executable, script, *args]``) as a worker forked from the fork
    server, with ``env`` as its whole environment and its output appended to ``log``."""
    if command[0] != sys.executable or not command[1].endswith(".py"):
        raise ValueError(
            f"zygote.start: command must be [sys.executable, script.py, ...]: {command}"
        )
    if env.get("OMP_NUM_THREADS") != THREADS:
        raise ValueError(f"zygote.start: OMP_NUM_THREADS must be {THREADS} (the fork server's)")
    # The fork server inherits this process's env when it starts (once): OMP_NUM_THREADS
    # as every worker's, read by the OpenMP runtime as torch is imported there.
    os.environ["OMP_NUM_THREADS"] = THREADS
    ctx = mp.get_context("forkserver")
    # '__main__' too: a forked child does not import the caller's main module again
    ctx.set_forkserver_preload(["__main__", *PRELOAD])
    # daemon: ended with the caller if it exits without stopping them (as its session would)
    process = ctx.Process(target=_main, args=(command[1:], env, str(log), os.getcwd()), daemon=True)
    process.start()
    return Forked(process)
