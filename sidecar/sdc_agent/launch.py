"""Run a function on several local ``torch.distributed`` (gloo) processes.

For demos, drills and tests on one machine: each process gets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and a ``NODE_NAME`` of its own choosing, so one host can stand in for
several nodes. Not a replacement for ``torchrun`` on a cluster.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import SDCError

__all__ = ["free_port", "spawn_local"]


def free_port() -> int:
    """A TCP port on loopback that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What every rank imports anyway, imported once by the fork server the ranks are forked
# from instead of once per rank (about 3 s of CPU a rank: torch, and torch._dynamo, which
# DistributedDataParallel imports on construction and FSDP2 with it; the Guard and every
# module it uses, 0.1 s more where Python writes no bytecode cache); "__main__" as
# multiprocessing's default (a script's main module, so that its functions can be targets).
_PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "sdc_agent.guard",
]


def _child(
    rank: int,
    nodes: Sequence[str],
    port: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    extra_env: dict[str, str],
    results: Any,
    parent: tuple[dict[str, str], str],
) -> None:
    world = len(nodes)
    local_rank = sum(1 for n in nodes[:rank] if n == nodes[rank])
    # The environment and directory of the caller at this call, as a spawned process would
    # have them (the fork server keeps those of the first call).
    environ, cwd = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(extra_env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local_rank),
            "NODE_NAME": nodes[rank],
        }
    )
    # One pod per emulated node, as on HyperPod, unless the caller names them.
    os.environ.setdefault("POD_NAME", f"pod-{nodes[rank]}")
    # One thread per rank: with more, ranks sharing few cores slow each other down.
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        try:
            value = target(rank, world, *args)
            # Tear down together: gloo can abort a rank whose peers disconnect while it
            # is still shutting down (seen with torch 2.13).
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # A forked process ends without running the interpreter's exit handlers: run them
        # (an evidence bundle still being written is finished there, as at a normal exit).
        atexit._run_exitfuncs()


def spawn_local(
    target: Callable[..., Any],
    nodes: Sequence[str],
    args: tuple[Any, ...] = (),
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``len(nodes)`` processes.

    ``nodes[r]`` is rank ``r``'s ``NODE_NAME``. Returns each rank's return value, by
    rank. ``target`` must be importable (a module-level function) and its return value
    picklable. A failure on any rank raises :class:`SDCError` with that rank's traceback.
    """
    if not nodes:
        raise SDCError("spawn_local: nodes must name at least one node")
    # free_port() lets its port go before rank 0's store listens on it: on a busy machine
    # another process can take it in between. Nothing has run then; start again elsewhere.
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _spawn_once(target, nodes, args, env, timeout)
        except _PortTaken:
            if attempt == _PORT_ATTEMPTS - 1:
                raise SDCError(
                    f"spawn_local: rank 0's port was taken by another process "
                    f"{_PORT_ATTEMPTS} times in a row"
                ) from None
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


class _PortTaken(SDCError):
    """Rank 0 could not listen on the port free_port() found (EADDRINUSE)."""


def _spawn_once(
    target: Callable[..., Any],
    nodes: Sequence[str],
    args: tuple[Any, ...],
    env: dict[str, str] | None,
    timeout: float,
) -> list[Any]:
    # Forked from a server process that imported torch once, not from the caller (none of
    # its threads or state is inherited, as with "spawn", and no rank pays the imports).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.SimpleQueue()
    port = free_port()
    parent = (dict(os.environ), os.getcwd())
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, list(nodes), port, target, args, dict(env or {}), results, parent),
            daemon=True,
        )
        for rank in range(len(nodes))
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(values) + len(failures) < len(procs):
            if datetime.datetime.now() > deadline:
                raise SDCError(f"spawn_local: ranks did not finish within {timeout:.0f} s")
            if results.empty():
                # A rank that died before delivering its result (killed, segfault) fails
                # the run; one that delivered and then exited badly does not (torch's
                # gloo can abort at interpreter exit after all work is done).
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values
                ]
                if dead:
                    procs[dead[0]].join(timeout=1.0)
                    if results.empty():
                        codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in dead)
                        raise SDCError(f"spawn_local: rank(s) died without a result ({codes})")
                procs[0].join(timeout=0.05)
                continue
            rank, ok, value = results.get()
            if ok:
                values[rank] = value
            else:
                # The other ranks are probably stuck in a collective with the dead one.
                failures.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 10.0)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        if not values and failures[0].startswith("rank 0 failed") and "EADDRINUSE" in failures[0]:
            raise _PortTaken(failures[0])
        raise SDCError("\n".join(failures))
    return [values[r] for r in range(len(procs))]
