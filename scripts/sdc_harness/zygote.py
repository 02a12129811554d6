"""Worker processes forked from a process that imported torch once (a zygote), instead of
each ``python script.py`` (or ``python -m module``) importing it: the kubelet stand-in's
way to start a pod's workers, and the demo's confirmation pods.

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
import contextlib
import multiprocessing as mp
import os
import runpy
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

__all__ = ["PRELOAD", "Forked", "listen_port", "run_world", "start", "torchrun_env"]

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
    try:
        if argv[0] == "-m":  # python -m MODULE ...: the directory first on the path
            sys.argv = list(argv[1:])
            sys.path[0] = cwd
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = str(Path(script).resolve().parent)
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


def start(command: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> Forked:
    """``command`` (``[sys.executable, script, *args]`` or ``[sys.executable, "-m",
    module, *args]``) as a worker forked from the fork server, with ``env`` as its whole
    environment, its output appended to ``log``, in ``cwd`` (default: the caller's)."""
    if command[0] != sys.executable or not (
        command[1].endswith(".py") or (command[1] == "-m" and len(command) > 2)
    ):
        raise ValueError(
            "zygote.start: command must be [sys.executable, script.py, ...] or "
            f"[sys.executable, '-m', module, ...]: {command}"
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
    process = ctx.Process(
        target=_main, args=(command[1:], env, str(log), str(cwd or os.getcwd())), daemon=True
    )
    process.start()
    return Forked(process)


def listen_port() -> int:
    """A TCP port on loopback that nobody listens on right now, below the kernel's
    ephemeral range, for a port that is chosen here and bound only later by another
    process (a job's ``MASTER_PORT``, bound by rank 0's store once that rank has
    started). A port from ``bind(0)`` is an ephemeral one, which the kernel may hand to any
    process's next connection or ``bind(0)`` in between: under load the demo's rank 0
    found its port taken (EADDRINUSE) twice in one run. A port below the range is taken
    only by someone who asks for it by number."""
    low, _ = _ephemeral_range()
    for _ in range(100 if low > 21000 else 0):
        port = secrets.randbelow(low - 20000) + 20000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # nothing free below the range: an ephemeral one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def torchrun_env(rank: int, world: int, per_node: int, port: int) -> dict[str, str]:
    """What torchrun gives the worker of ``rank`` (rank 0's store on ``port``)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
    }


def run_world(
    command: list[str],
    env: Callable[[int], dict[str, str]],
    logs: Path,
    world: int,
    per_node: int,
    port: int,
    timeout: float = 240,
) -> list[tuple[int | None, str]]:
    """``command`` in ``world`` workers, as torchrun starts them with ``per_node`` per node
    (:func:`torchrun_env`), each forked with ``env(rank)`` on top, its output in
    ``logs/rank<r>.log``; waits up to ``timeout`` s for all. Each worker's exit code (None:
    still running at the timeout, then killed) and output."""
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):  # a worker that fails before it opens its log has one too
        (logs / f"rank{rank}.log").write_bytes(b"")
    procs = [
        start(
            command,
            {**env(rank), **torchrun_env(rank, world, per_node, port)},
            logs / f"rank{rank}.log",
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.process.kill()
    return [(p.returncode, (logs / f"rank{rank}.log").read_text()) for rank, p in enumerate(procs)]
