"""Finding the checkpoint to resume from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdc_agent.checkpoint import (
    find_checkpoints,
    load_dcp,
    mark_checkpoint,
    resume_max_step,
    save_dcp,
    select_checkpoint,
    state_digest,
)
from sdc_agent.errors import CheckpointNotFoundError, ConfigError


def dcp_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir()
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_bytes(b"")
    return path


def save_file(root: Path, name: str, step: int) -> Path:
    path = root / name
    torch.save({"step": step}, path)
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    mark_checkpoint(dcp_dir(tmp_path, "step_000100"), 100, verified=True)
    mark_checkpoint(save_file(tmp_path, "ckpt-150.pt", 150), 150, verified=True)
    mark_checkpoint(dcp_dir(tmp_path, "step_000200"), 200, verified=False)
    mark_checkpoint(dcp_dir(tmp_path, "step_000250"), 250, verified=True)
    dcp_dir(tmp_path, "step_000300")  # no marker: nothing vouches for it
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    return tmp_path


def test_finds_every_layout_in_step_order(root: Path) -> None:
    found = find_checkpoints(root)
    assert [(c.step, c.layout, c.verified) for c in found] == [
        (100, "dcp", True),
        (150, "file", True),
        (200, "dcp", False),
        (250, "dcp", True),
        (300, "dcp", None),
    ]


def test_newest_verified_at_or_before_the_step(root: Path) -> None:
    assert select_checkpoint(root, 260).step == 250
    assert select_checkpoint(root, 250).step == 250
    assert select_checkpoint(root, 249).step == 150  # 200 is not verified
    assert select_checkpoint(root, 150).path.name == "ckpt-150.pt"
    assert select_checkpoint(root, 10_000).step == 250  # 300 has no marker
    assert select_checkpoint(root, 10_000, require_verified=False).step == 300


def test_no_checkpoint_before_the_window_is_a_clear_error(root: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        select_checkpoint(root, 99)
    assert "at or before step 99" in str(info.value)
    assert "steps found: 100, 150, 200, 250, 300" in str(info.value)


def test_only_unverified_checkpoints_before_the_window(tmp_path: Path) -> None:
    mark_checkpoint(dcp_dir(tmp_path, "step_50"), 50, verified=False)
    mark_checkpoint(dcp_dir(tmp_path, "step_90"), 90, verified=True)
    with pytest.raises(CheckpointNotFoundError, match="skipped as not verified: 50"):
        select_checkpoint(tmp_path, 60)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        select_checkpoint(tmp_path / "nope", 5)


def test_the_environment_sets_the_limit(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPERPOD_SDC_RESUME_MAX_STEP", "199")
    assert resume_max_step() == 199
    assert select_checkpoint(root).step == 150
    monkeypatch.delenv("HYPERPOD_SDC_RESUME_MAX_STEP")
    assert resume_max_step() is None
    assert select_checkpoint(root).step == 250


@pytest.mark.parametrize("raw", ["soon", "-3", "1.5"])
def test_bad_resume_step_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_RESUME_MAX_STEP:"):
        resume_max_step({"HYPERPOD_SDC_RESUME_MAX_STEP": raw})


def test_a_damaged_or_mismatched_marker_vouches_for_nothing(tmp_path: Path) -> None:
    a = dcp_dir(tmp_path, "step_10")
    b = dcp_dir(tmp_path, "step_20")
    (tmp_path / "step_10.sdc.json").write_text("{broken")
    (tmp_path / "step_20.sdc.json").write_text(json.dumps({"step": 19, "verified": True}))
    assert [c.verified for c in find_checkpoints(tmp_path)] == [False, False]
    assert a.exists() and b.exists()
    with pytest.raises(CheckpointNotFoundError):
        select_checkpoint(tmp_path, 100)


def test_marking_a_missing_checkpoint_fails(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        mark_checkpoint(tmp_path / "step_5", 5, verified=True)


# DCP in one process (no process group): it says so with a UserWarning.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_checkpoint_round_trip_is_found_marked_and_restores_the_state(
    tmp_path: Path,
) -> None:
    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    model, optimizer = trained()
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = state_digest(model, optimizer)
    path = save_dcp(tmp_path / "step_3", model, optimizer)
    mark_checkpoint(path, 3, verified=True)
    chosen = select_checkpoint(tmp_path)
    assert (chosen.step, chosen.layout, chosen.path) == (3, "dcp", path)

    fresh, fresh_optimizer = trained()
    assert state_digest(fresh, fresh_optimizer) != saved
    load_dcp(chosen.path, fresh, fresh_optimizer)
    assert state_digest(fresh, fresh_optimizer) == saved
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 3


def test_loading_an_incomplete_dcp_directory_fails(tmp_path: Path) -> None:
    (tmp_path / "step_5").mkdir()  # a save that stopped before rank 0 wrote .metadata
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointNotFoundError, match="step_5: not a complete DCP checkpoint"):
        load_dcp(tmp_path / "step_5", model, torch.optim.SGD(model.parameters(), lr=0.1))
