"""Operator processes forked from a process that imported the operator's dependencies once
(a zygote), instead of each ``python -m sdc_operator`` importing them: the tests' way to
start the many operators they need (tests/integration/conftest.py ``start_operator``).

Each operator is still a process of its own, in its own session, with exactly the env,
log and working directory :class:`sdc_harness.cluster.OperatorProcess` gives it, running
``sdc_operator``'s ``__main__`` from the start: its settings checked, its handlers
registered, kopf started. Only the third-party imports in :data:`PRELOAD` (about 1.2 s of
CPU of the 1.4 s an operator's imports cost on the 2-core machine) are inherited; the
project's own modules are imported in the child, after its env is set; it ends as the
interpreter would, its non-daemon threads joined before the atexit handlers. An operator
with another ``PYTHONPATH`` (another release's code), hash seed or other ``PYTHON*``
variable than the zygote started with is not forked: :func:`forkable` says which.

The zygote is a child of the test process (its stdin closing ends it); it forks on request,
reaps its children and reports each one's exit status, so the caller's :class:`Forked` has
what :class:`subprocess.Popen` offers: ``pid``, ``poll``, ``wait``, ``terminate``,
``kill``, ``returncode`` (negative for a signal).

    python scripts/sdc_harness/operator_zygote.py      # the zygote (started by start())
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

PRELOAD = [
    "kopf",
    "aiohttp.web",
    "kubernetes",
    "kubernetes_validate",
    "boto3",
    "botocore.session",
    "prometheus_client",
    "yaml",
    "jsonschema",
    "jsonpatch",
    "requests",
]
"""What the zygote imports: the operator's third-party dependencies, none of its own modules
(they are another release's where a test runs one, and read their env as they start)."""
MODULE = "sdc_operator"
_INHERITED = (
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "AIOHTTP_NO_EXTENSIONS",
    "AIOHTTP_NOSENDFILE",
    "MULTIDICT_NO_EXTENSIONS",
    "YARL_NO_EXTENSIONS",
    "PROMETHEUS_MULTIPROC_DIR",
    "prometheus_multiproc_dir",
)
"""Env read as :data:`PRELOAD` is imported, and kept: a child must have the zygote's (as it
must every ``PYTHON*`` variable, read as the interpreter starts: :func:`forkable`)."""
_READ_AT_IMPORT = {
    "kubernetes.config.kube_config": (
        "KUBE_CONFIG_DEFAULT_LOCATION",
        "KUBECONFIG",
        "~/.kube/config",
    )
}
"""The other env :data:`PRELOAD` reads as it is imported: module -> (its global, the
variable, the default), read again in each child from the child's env."""


# -- the zygote --------------------------------------------------------------------------


def _child(request: dict[str, Any], reply_fd: int) -> None:
    """In the forked child: its session, log, env and working directory, then the module
    as ``__main__``; never returns."""
    code = 1
    try:
        os.setsid()
        stdin = os.open(os.devnull, os.O_RDONLY)
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(stdin, 0)
        os.dup2(fd, 1)  # the reply pipe was fd 1: replaced, not closed and reused
        os.dup2(fd, 2)
        for extra in {stdin, fd, reply_fd} - {0, 1, 2}:
            os.close(extra)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for module, (name, variable, default) in _READ_AT_IMPORT.items():
            if module in sys.modules:
                setattr(sys.modules[module], name, os.environ.get(variable, default))
        sys.path.insert(0, request["cwd"])  # as `python -m` has it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()  # before the threads are joined, as the interpreter does
            code = 1
        finally:
            import atexit

            # as the interpreter ends: its non-daemon threads joined (the executors'
            # workers, a SageMaker call still in flight), then the atexit handlers
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # nothing is left to tell
                stream.flush()
        os._exit(code)


def serve() -> None:
    """The zygote's loop: a JSON request per line on stdin, ``pid N`` or ``exit N CODE``
    lines on stdout; ends when stdin closes (its children are theirs to stop)."""
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # this file's folder: its modules are not the dependencies'
    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout.fileno()
    os.write(reply, b"ready\n")
    requests = sys.stdin.fileno()
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([requests], [], [], 0.1)
        if readable:
            data = os.read(requests, 65536)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(line), reply)
                children.add(pid)
                os.write(reply, f"pid {pid}\n".encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                os.write(reply, f"exit {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


# -- the caller's side -------------------------------------------------------------------


class _Zygote:
    def __init__(self) -> None:
        self.env = dict(os.environ)
        """The env the zygote started with (its interpreter's and its imports')."""
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = self.proc.stdout
        if self._out.readline() != b"ready\n":
            raise RuntimeError(f"the operator zygote did not start (exit {self.proc.wait()})")
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Ends the zygote (its children are theirs to stop) and its pipes."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self._reader.join(30)
        self._out.close()

    def _read(self) -> None:
        for line in self._out:
            kind, *values = line.decode().split()
            with self.changed:
                if kind == "pid":
                    self.pids.append(int(values[0]))
                elif kind == "exit":
                    self.exits[int(values[0])] = int(values[1])
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: nothing will be reported any more
            self.changed.notify_all()

    def fork(self, request: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        with self.lock, self.changed:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: self.pids or self.proc.poll() is not None, 60):
                raise RuntimeError("the operator zygote did not fork within 60 s")
            if not self.pids:
                raise RuntimeError(f"the operator zygote exited ({self.proc.returncode})")
            return self.pids.pop(0)


_zygote: _Zygote | None = None
_started = threading.Lock()


def forkable(module: str, env: dict[str, str]) -> bool:
    """Whether the operator ``python -m module`` with ``env`` can be forked: this project's
    operator, with the start-up env of the zygote (the env it started with, or this
    process's where none is running): the same :data:`_INHERITED` and ``PYTHON*``
    variables (``PYTHONWARNINGS``, ``PYTHONDEVMODE``, ... are read as the interpreter
    starts, so a forked child would silently ignore its own)."""
    zygote = _zygote
    started = zygote.env if zygote is not None and zygote.proc.poll() is None else os.environ
    names = {*_INHERITED, *(k for k in (*env, *started) if k.startswith("PYTHON"))}
    return module == MODULE and all(env.get(k) == started.get(k) for k in names)


class Forked:
    """What :class:`subprocess.Popen` offers :class:`~sdc_harness.cluster.OperatorProcess`
    and the tests, for an operator the zygote forked."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._zygote.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"operator {self.pid}", timeout or 0.0)
                if self._zygote.proc.poll() is not None:
                    raise RuntimeError("the operator zygote exited before its child")
                self._zygote.changed.wait(0.5 if left is None else min(left, 0.5))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(env: dict[str, str], log: Path, module: str = MODULE) -> Forked:
    """``python -m module`` with ``env`` as its whole environment and its output appended
    to ``log``, forked from this process's zygote (started on first use)."""
    if not forkable(module, env):
        raise ValueError(f"operator_zygote.start: {module} with this env cannot be forked")
    global _zygote
    with _started:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        zygote = _zygote
    request = {"module": module, "env": env, "log": str(log), "cwd": os.getcwd()}
    return Forked(zygote, zygote.fork(request))


if __name__ == "__main__":
    serve()
