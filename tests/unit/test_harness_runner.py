"""The demo's training-operator stand-in (sdc_harness.training): the port its job's rank 0
binds, and how it stops a worker that has no session of its own yet."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

from sdc_harness.training import _signal
from sdc_harness.zygote import listen_port


def test_the_jobs_port_is_below_the_ephemeral_range_and_free() -> None:
    """A port the kernel hands out to connections and bind(0) can be taken between the
    choice and rank 0's bind (EADDRINUSE); one below the range only by number."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = listen_port()
        if low > 21000:
            assert 20000 <= port < low
        else:  # no room below the range: an ephemeral port, as documented
            assert port >= low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody listens on it


def test_a_worker_without_a_session_of_its_own_is_still_signalled() -> None:
    """A worker forked a moment ago may not have called setsid() yet: no process group
    has its id, and killpg fails (ProcessLookupError); the worker itself gets the signal."""
    proc = subprocess.Popen(["sleep", "60"])  # in this process's group, not its own
    try:
        _signal(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
