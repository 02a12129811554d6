"""Settings: defaults, environment, keyword overrides and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdc_agent import ConfigError, FaultSpec, Guard, GuardConfig


def test_defaults() -> None:
    c = GuardConfig()
    assert (c.nonfinite_check, c.weights_every, c.fingerprint_backend, c.faults) == (
        True,
        10,
        "auto",
        (),
    )


def test_env_then_keywords() -> None:
    env = {
        "HYPERPOD_SDC_WEIGHTS_EVERY": "5",
        "HYPERPOD_SDC_NONFINITE_CHECK": "false",
        "HYPERPOD_SDC_FINGERPRINT_BACKEND": "eager",
        "HYPERPOD_SDC_FAULTS": "rank=1,step=2,site=weights,kind=nan",
        "NODE_NAME": "hyperpod-i-0123",
    }
    c = GuardConfig.from_env(env)
    assert c.weights_every == 5 and c.nonfinite_check is False
    assert c.fingerprint_backend == "eager" and c.node_name == "hyperpod-i-0123"
    assert c.faults == (FaultSpec(rank=1, step=2, site="weights", kind="nan"),)
    assert GuardConfig.from_env(env, weights_every=7).weights_every == 7
    assert GuardConfig().update_slices == 4
    assert GuardConfig.from_env({"HYPERPOD_SDC_UPDATE_SLICES": "2"}).update_slices == 2
    assert (
        GuardConfig.from_env({"HYPERPOD_SDC_UPDATE_SLICES": "2"}, update_slices=1).update_slices
        == 1
    )


def test_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match="weights_evry: unknown setting"):
        GuardConfig.from_env({}, weights_evry=3)
    with pytest.raises(TypeError, match="weights_evry"):
        GuardConfig(weights_evry=3)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"weights_every": -1}, "weights_every"),
        ({"weights_every": 2.5}, "weights_every"),
        ({"weights_every": True}, "weights_every"),
        ({"nonfinite_check": "yes"}, "nonfinite_check"),
        ({"fingerprint_backend": "fast"}, "fingerprint_backend"),
        ({"faults": ["rank=1"]}, "faults"),
        ({"node_name": ""}, "node_name"),
        ({"update_slices": 0}, "update_slices"),
        ({"update_slices": 1.5}, "update_slices"),
    ],
)
def test_bad_values_name_the_setting(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        GuardConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"HYPERPOD_SDC_WEIGHTS_EVERY": "ten"}, "HYPERPOD_SDC_WEIGHTS_EVERY"),
        ({"HYPERPOD_SDC_WEIGHTS_EVERY": "-3"}, "HYPERPOD_SDC_WEIGHTS_EVERY"),
        ({"HYPERPOD_SDC_NONFINITE_CHECK": "perhaps"}, "HYPERPOD_SDC_NONFINITE_CHECK"),
        ({"HYPERPOD_SDC_FINGERPRINT_BACKEND": "gpu"}, "HYPERPOD_SDC_FINGERPRINT_BACKEND"),
        ({"HYPERPOD_SDC_FAULTS": "rank=1"}, "HYPERPOD_SDC_FAULTS"),
        ({"HYPERPOD_SDC_UPDATE_SLICES": "four"}, "HYPERPOD_SDC_UPDATE_SLICES"),
        ({"HYPERPOD_SDC_UPDATE_SLICES": "0"}, "HYPERPOD_SDC_UPDATE_SLICES"),
    ],
)
def test_bad_environment_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}:"):
        GuardConfig.from_env(env)


def test_unknown_environment_variable_warns() -> None:
    with pytest.warns(RuntimeWarning, match="HYPERPOD_SDC_WEIGTHS_EVERY"):
        GuardConfig.from_env({"HYPERPOD_SDC_WEIGTHS_EVERY": "3"})


def test_guard_rejects_a_model_that_is_not_ddp() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="^model: must be wrapped in .*DistributedDataParallel"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, b: m(b).sum())


def test_replay_settings() -> None:
    c = GuardConfig.from_env(
        {
            "HYPERPOD_SDC_REPLAY_EVERY": "25",
            "HYPERPOD_SDC_REPLAY_PROBABILITY": "0.01",
            "HYPERPOD_SDC_REPLAY_MODE": "calibrate",
        }
    )
    assert (c.replay_every, c.replay_probability, c.replay_mode) == (25, 0.01, "calibrate")
    assert GuardConfig().replay_every == 50
    for kw, field in (
        ({"replay_every": -5}, "replay_every"),
        ({"replay_probability": 1.5}, "replay_probability"),
        ({"replay_mode": "accuse"}, "replay_mode"),
    ):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            GuardConfig(**kw)
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_REPLAY_PROBABILITY:"):
        GuardConfig.from_env({"HYPERPOD_SDC_REPLAY_PROBABILITY": "often"})


def test_enable_determinism_sets_what_it_says() -> None:
    import os

    from sdc_agent import enable_determinism

    before = torch.are_deterministic_algorithms_enabled()
    try:
        done = enable_determinism()
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == done["CUBLAS_WORKSPACE_CONFIG"]
        assert torch.backends.cudnn.deterministic is True
    finally:
        torch.use_deterministic_algorithms(before)
