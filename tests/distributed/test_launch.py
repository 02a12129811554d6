"""spawn_local's ranks, forked from a server that imported torch once: each has the caller's
environment and directory as they are at the call, and runs its exit handlers."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import pytest

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed


def _where(rank: int, world: int, marker: str) -> tuple[str | None, str, str | None, str]:
    # An exit handler, as the evidence bundle writer registers one: it must run.
    atexit.register(lambda: (Path(marker) / f"exited-{rank}").write_text("ok"))
    return (
        os.environ.get("HYPERPOD_SDC_TEST_LAUNCH"),
        os.getcwd(),
        os.environ.get("EXTRA"),
        os.environ["NODE_NAME"],
    )


def test_each_call_gives_the_callers_environment_and_directory_at_that_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv("HYPERPOD_SDC_TEST_LAUNCH", "first")
    monkeypatch.chdir(first)
    assert spawn_local(_where, ["a", "b"], (str(first),)) == [
        ("first", str(first), None, "a"),
        ("first", str(first), None, "b"),
    ]
    # The fork server, started by the first call, kept the first environment: a later
    # call still gives its own.
    monkeypatch.setenv("HYPERPOD_SDC_TEST_LAUNCH", "second")
    monkeypatch.chdir(second)
    assert spawn_local(_where, ["a", "b"], (str(second),), env={"EXTRA": "1"}) == [
        ("second", str(second), "1", "a"),
        ("second", str(second), "1", "b"),
    ]
    for d in (first, second):
        assert sorted(p.name for p in d.iterdir()) == ["exited-0", "exited-1"]


def _world_size(rank: int, world: int) -> int:
    import torch.distributed as dist

    return dist.get_world_size()  # the process group spawn_local's ranks start in


def test_a_port_taken_before_rank_0_listens_is_left_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """free_port() lets its port go before rank 0's store binds it; on a busy machine
    another process can take it in between (EADDRINUSE): the ranks start again on
    another port, as nothing has run yet."""
    import socket

    from sdc_agent import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
    try:
        assert spawn_local(_world_size, ["a", "b"]) == [2, 2]
    finally:
        taken.close()
