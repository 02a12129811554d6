"""Agent settings: :class:`GuardConfig`, from keyword arguments and ``HYPERPOD_SDC_*``.

Precedence: keyword arguments to :meth:`GuardConfig.from_env`, then environment
variables, then the defaults below. ``GuardConfig(...)`` itself reads no environment.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sdc_common.names import (
    CA_BUNDLE_ENV,
    ENV_PREFIX,
    OPERATOR_URL_ENV,
    RESUME_MAX_STEP_ENV,
    TOKEN_FILE_ENV,
    VERDICT_URL_ENV,
)

from ._validate import require_bool, require_choice, require_int, require_number
from .bundle import BundleSettings
from .errors import ConfigError
from .faults import FaultSpec, parse_faults
from .fingerprint import FINGERPRINT_BACKENDS

__all__ = ["AGREED_FIELDS", "ENV_PREFIX", "GuardConfig", "KNOWN_ENV"]

NONFINITE_CHECK_ENV = "HYPERPOD_SDC_NONFINITE_CHECK"
WEIGHTS_EVERY_ENV = "HYPERPOD_SDC_WEIGHTS_EVERY"
WEIGHTS_OPTIMIZER_STATE_ENV = "HYPERPOD_SDC_WEIGHTS_OPTIMIZER_STATE"
UPDATE_SLICES_ENV = "HYPERPOD_SDC_UPDATE_SLICES"
FINGERPRINT_BACKEND_ENV = "HYPERPOD_SDC_FINGERPRINT_BACKEND"
FAULTS_ENV = "HYPERPOD_SDC_FAULTS"
REPLAY_EVERY_ENV = "HYPERPOD_SDC_REPLAY_EVERY"
REPLAY_PROBABILITY_ENV = "HYPERPOD_SDC_REPLAY_PROBABILITY"
REPLAY_MODE_ENV = "HYPERPOD_SDC_REPLAY_MODE"
REPLAY_MODES: tuple[str, ...] = ("audit", "calibrate")
UNREACHABLE_POLICY_ENV = "HYPERPOD_SDC_UNREACHABLE_POLICY"
REPORT_DEADLINE_ENV = "HYPERPOD_SDC_REPORT_DEADLINE_SECONDS"
HEARTBEAT_EVERY_ENV = "HYPERPOD_SDC_HEARTBEAT_EVERY"
VERDICT_REPORTERS_ENV = "HYPERPOD_SDC_VERDICT_REPORTERS"
SNAPSHOT_COPIES_ENV = "HYPERPOD_SDC_SNAPSHOT_COPIES"
SNAPSHOT_MEMORY_FRACTION_ENV = "HYPERPOD_SDC_SNAPSHOT_MEMORY_FRACTION"
SNAPSHOT_WRITE_SECONDS_ENV = "HYPERPOD_SDC_SNAPSHOT_WRITE_SECONDS"
SNAPSHOT_DIR_ENV = "HYPERPOD_SDC_SNAPSHOT_DIR"
UNREACHABLE_POLICIES: tuple[str, ...] = ("stop", "continue")
NODE_NAME_ENV = "NODE_NAME"

_ENV_OF_FIELD = {
    "nonfinite_check": NONFINITE_CHECK_ENV,
    "weights_every": WEIGHTS_EVERY_ENV,
    "weights_include_optimizer_state": WEIGHTS_OPTIMIZER_STATE_ENV,
    "update_slices": UPDATE_SLICES_ENV,
    "fingerprint_backend": FINGERPRINT_BACKEND_ENV,
    "faults": FAULTS_ENV,
    "replay_every": REPLAY_EVERY_ENV,
    "replay_probability": REPLAY_PROBABILITY_ENV,
    "replay_mode": REPLAY_MODE_ENV,
    "unreachable_policy": UNREACHABLE_POLICY_ENV,
    "report_deadline_seconds": REPORT_DEADLINE_ENV,
    "heartbeat_every": HEARTBEAT_EVERY_ENV,
    "verdict_reporters": VERDICT_REPORTERS_ENV,
    "snapshot_copies": SNAPSHOT_COPIES_ENV,
    "snapshot_memory_fraction": SNAPSHOT_MEMORY_FRACTION_ENV,
    "snapshot_write_seconds": SNAPSHOT_WRITE_SECONDS_ENV,
    "snapshot_dir": SNAPSHOT_DIR_ENV,
}

# Settings that change which collectives a rank makes, or what every rank must conclude
# alike: they must be equal on every rank of the data-parallel group (Guard creation
# compares them and names the ones that differ). The others (node_name, faults aimed at
# one rank, the reporter's deadline, the fingerprint kernel) are local.
AGREED_FIELDS: tuple[str, ...] = (
    "nonfinite_check",
    "weights_every",
    "weights_include_optimizer_state",
    "update_slices",
    "replay_every",
    "replay_probability",
    "replay_mode",
    "heartbeat_every",
    "verdict_reporters",
    "snapshot_copies",
    "snapshot_write_seconds",
)

# Every HYPERPOD_SDC_* name the agent reads, and the one the operator sets in its pods;
# anything else with the prefix in a training pod is probably a typo and draws a warning.
# (The operator's own settings, sdc_operator.settings, live in the operator's pod.)
KNOWN_ENV: frozenset[str] = frozenset(
    {
        *_ENV_OF_FIELD.values(),
        RESUME_MAX_STEP_ENV,
        OPERATOR_URL_ENV,
        VERDICT_URL_ENV,
        TOKEN_FILE_ENV,
        CA_BUNDLE_ENV,
        # Evidence bundles (sdc_agent.bundle.BundleSettings)
        "HYPERPOD_SDC_BUNDLE_DIR",
        "HYPERPOD_SDC_BUNDLE_FACTORY",
        "HYPERPOD_SDC_BUNDLE_MAX_BYTES",
    }
)


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {raw!r}")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """Settings of :class:`sdc_agent.Guard`. Intervals count optimizer steps."""

    nonfinite_check: bool = True
    """Check 1: look for NaN/Inf in every rank's gradient buckets before the all-reduce,
    every step (env ``HYPERPOD_SDC_NONFINITE_CHECK``). The check is fused into the pass
    that scales the bucket by 1/world size (which the communication hook makes anyway);
    every rank's flag travels in one message of 4 bytes per rank right behind the step's
    last bucket, and the step is held back on the device where the optimizer allows it."""

    weights_every: int = 10
    """Check 3: compare fingerprints of the parameters across data-parallel replicas every
    this many steps; 0 turns it off (env ``HYPERPOD_SDC_WEIGHTS_EVERY``). It bounds how
    far ``last_clean_step`` lags behind: only verified steps count as clean."""

    weights_include_optimizer_state: bool = True
    """Also fingerprint the optimizer's state tensors (Adam's moments), which must be
    identical across replicas too (env ``HYPERPOD_SDC_WEIGHTS_OPTIMIZER_STATE``). Roughly
    triples the check's cost with Adam."""

    update_slices: int = 4
    """Pure FSDP only (no shard has a replica, so check 3 has nothing to compare): the
    update check that stands in for it recomputes, every ``weights_every`` steps, slice
    ``(step // weights_every) % update_slices`` of every shard's optimizer update on two
    other nodes (env ``HYPERPOD_SDC_UPDATE_SLICES``; see :mod:`sdc_agent.check_update`).
    Every element is recomputed once every ``update_slices`` checks; each check copies
    ``1 / update_slices`` of the shard's parameters, gradients and optimizer state to two
    ranks and recomputes it there. ``1`` recomputes the whole update at every check."""

    fingerprint_backend: str = "auto"
    """``auto`` (a built kernel: portable C on CPU, ``torch.compile`` on CUDA; eager, with
    a WARNING log line, where building fails), ``compile`` (raise instead) or ``eager``
    (env ``HYPERPOD_SDC_FINGERPRINT_BACKEND``). All give identical fingerprints; building
    costs a fraction of a second (CPU) or seconds (CUDA) once per process, eager is three
    to five times slower per byte on CPU. Tests and the demo use ``eager``: their models
    are tiny."""

    replay_every: int = 50
    """Check 2: every this many steps each rank recomputes a partner's micro-batch on
    another node; 0 turns the scheduled audits off (env ``HYPERPOD_SDC_REPLAY_EVERY``).
    Costs about one extra forward and backward of one micro-batch per audit, so roughly
    ``1 / replay_every`` of a step's compute (see ``bench/overhead.py``). Needs the
    micro-batch and the loss function: :meth:`Guard.step`, or the phase API with
    :meth:`Guard.before_backward`. The audit learns the job's run-to-run noise by itself
    (see :attr:`Guard.gradient_tolerance`); :func:`sdc_agent.enable_determinism` makes it
    sharper."""

    replay_probability: float = 0.0
    """Also audit any other step with this probability, drawn from a seed the ranks share,
    so audits come at steps nobody can predict (env ``HYPERPOD_SDC_REPLAY_PROBABILITY``)."""

    replay_mode: str = "audit"
    """``audit`` (mismatches are verdicts and the step is not applied) or ``calibrate``
    (replay, count how often replays differ in :attr:`Guard.replay_stats`, accuse nobody,
    skip nothing): run ``calibrate`` first to see whether a model is deterministic (env
    ``HYPERPOD_SDC_REPLAY_MODE``)."""

    unreachable_policy: str = "stop"
    """What to do when a verdict cannot be delivered to the operator within
    ``report_deadline_seconds``: ``stop`` (every rank raises
    :class:`~sdc_agent.errors.OperatorUnreachableError` before applying another step) or
    ``continue`` (train on; the reporter keeps retrying). Only with a reporter (env
    ``HYPERPOD_SDC_UNREACHABLE_POLICY``)."""

    report_deadline_seconds: float = 60.0
    """See ``unreachable_policy`` (env ``HYPERPOD_SDC_REPORT_DEADLINE_SECONDS``)."""

    heartbeat_every: int = 100
    """Send a heartbeat (last verified step, time spent in each check) every this many
    steps from each node's reporting rank; 0 turns heartbeats off (env
    ``HYPERPOD_SDC_HEARTBEAT_EVERY``)."""

    verdict_reporters: int = 3
    """How many nodes report each verdict (env ``HYPERPOD_SDC_VERDICT_REPORTERS``): the
    suspect's replay partners first, then witnesses on other nodes, the suspect's own node
    last, each through its local rank 0; every rank computes the same choice. The
    operator needs two nodes to agree, so three leave one to spare. 0: every node reports
    (as agents before this setting did). Heartbeats still come from every node."""

    snapshot_copies: int = 0
    """Verified snapshots (see :mod:`sdc_agent.snapshot`): each time ``last_clean_step``
    advances, that step's state (model, optimizer, what :meth:`Guard.snapshot_state`
    registered) is copied to host memory, spread over the replicas, each slice kept by
    this many ranks on different nodes; at detection the healthy ranks write it as a
    verified ``torch.distributed.checkpoint`` so the job resumes from ``last_clean_step``,
    not from its last periodic checkpoint. 0: off (the default); 2: the intended setting
    (no node's copy is trusted alone); at most the number of nodes. Host memory per rank
    is about ``snapshot_copies / world size`` of one replica's state (env
    ``HYPERPOD_SDC_SNAPSHOT_COPIES``)."""

    snapshot_memory_fraction: float = 0.5
    """The share of a node's available host memory (``MemAvailable``) its ranks'
    snapshots may take, more than 0 and at most 1. Where ``snapshot_copies`` do not fit,
    the ranks agree on fewer (or none) and warn (env
    ``HYPERPOD_SDC_SNAPSHOT_MEMORY_FRACTION``)."""

    snapshot_write_seconds: float = 20.0
    """The deadline of the write at detection: the roll call of the ranks that write takes
    a quarter of it, a rank waits at most half of it for the plan. Keep it inside the
    pods' termination grace period (Kubernetes' default is 30 s) (env
    ``HYPERPOD_SDC_SNAPSHOT_WRITE_SECONDS``)."""

    snapshot_dir: str | None = None
    """Where a snapshot is written at detection (``<dir>/sdc-snapshot-step_<k>``, a
    directory :func:`~sdc_agent.checkpoint.select_checkpoint` finds): a shared file
    system every rank can write. Default: the directory of the last checkpoint given to
    :meth:`Guard.mark_checkpoint` (env ``HYPERPOD_SDC_SNAPSHOT_DIR``)."""

    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject, for drills and tests (env ``HYPERPOD_SDC_FAULTS``); see
    :mod:`sdc_agent.faults`. Empty in production."""

    node_name: str | None = None
    """This rank's node; ranks on one node share it. Default: env ``NODE_NAME`` (set it
    from the downward API ``spec.nodeName``), else the host name."""

    bundles: BundleSettings = field(default_factory=BundleSettings)
    """Evidence bundles (:class:`sdc_agent.bundle.BundleSettings`: ``bundle_dir``,
    ``bundle_factory``, ``bundle_max_bytes``, env ``HYPERPOD_SDC_BUNDLE_*``): on a
    localized, persistent replay verdict one healthy rank writes what recomputes the
    failing micro-batch under ``<bundle_dir>/sdc-evidence/`` (default: the directory of
    the last checkpoint given to :meth:`Guard.mark_checkpoint`), and the verdict names
    it. :meth:`from_env` takes the three as keyword arguments too
    (``GuardConfig.from_env(bundle_dir="/fsx/ckpt/run1")``)."""

    def __post_init__(self) -> None:
        require_bool("nonfinite_check", self.nonfinite_check)
        require_int("weights_every", self.weights_every, minimum=0, hint=" (0 turns it off)")
        require_bool("weights_include_optimizer_state", self.weights_include_optimizer_state)
        require_int("update_slices", self.update_slices, minimum=1, hint=" (1: the whole update)")
        require_int("replay_every", self.replay_every, minimum=0, hint=" (0 turns it off)")
        require_number("replay_probability", self.replay_probability, minimum=0, maximum=1)
        require_choice("replay_mode", self.replay_mode, REPLAY_MODES)
        require_choice("unreachable_policy", self.unreachable_policy, UNREACHABLE_POLICIES)
        require_number(
            "report_deadline_seconds",
            self.report_deadline_seconds,
            minimum=0,
            exclusive_minimum=True,
        )
        require_int("heartbeat_every", self.heartbeat_every, minimum=0, hint=" (0 turns it off)")
        require_int("verdict_reporters", self.verdict_reporters, minimum=0, hint=" (0: every node)")
        require_choice("fingerprint_backend", self.fingerprint_backend, FINGERPRINT_BACKENDS)
        require_int("snapshot_copies", self.snapshot_copies, minimum=0, hint=" (0 turns it off)")
        require_number(
            "snapshot_memory_fraction",
            self.snapshot_memory_fraction,
            minimum=0,
            maximum=1,
            exclusive_minimum=True,
        )
        require_number(
            "snapshot_write_seconds",
            self.snapshot_write_seconds,
            minimum=0,
            exclusive_minimum=True,
        )
        if self.snapshot_dir is not None and (
            not isinstance(self.snapshot_dir, str) or not self.snapshot_dir
        ):
            raise ConfigError(f"snapshot_dir: must be a non-empty path, got {self.snapshot_dir!r}")
        if not isinstance(self.faults, tuple) or not all(
            isinstance(f, FaultSpec) for f in self.faults
        ):
            raise ConfigError("faults: must be a tuple of sdc_agent.FaultSpec")
        if self.node_name is not None and (
            not isinstance(self.node_name, str) or not self.node_name
        ):
            raise ConfigError(f"node_name: must be a non-empty string, got {self.node_name!r}")
        if not isinstance(self.bundles, BundleSettings):
            raise ConfigError(
                f"bundles: must be a sdc_agent.bundle.BundleSettings, got {self.bundles!r}"
            )

    @property
    def replay_enabled(self) -> bool:
        return self.replay_every > 0 or self.replay_probability > 0

    def agreed(self) -> dict[str, Any]:
        """The settings every rank must share (:data:`AGREED_FIELDS`), by name."""
        return {name: getattr(self, name) for name in AGREED_FIELDS}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GuardConfig:
        """Settings from ``HYPERPOD_SDC_*`` variables, overridden by keyword arguments.

        Unknown keyword arguments raise :class:`ConfigError`; unknown ``HYPERPOD_SDC_*``
        variables draw a warning (they are probably typos, and ignoring them silently
        would leave a check configured differently than intended).
        """
        env = os.environ if env is None else env
        bundle_fields = {f.name for f in fields(BundleSettings)}
        known = {f.name for f in fields(cls)} | bundle_fields
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)}: unknown setting; known: {', '.join(sorted(known))}"
            )
        for name in sorted(env):
            if name.startswith(ENV_PREFIX) and name not in KNOWN_ENV:
                warnings.warn(
                    f"{name}: unknown hyperpod-sdc environment variable, ignored",
                    RuntimeWarning,
                    stacklevel=2,
                )
        values: dict[str, Any] = {}
        if (raw := env.get(NONFINITE_CHECK_ENV)) is not None:
            values["nonfinite_check"] = _parse_bool(NONFINITE_CHECK_ENV, raw)
        if (raw := env.get(WEIGHTS_EVERY_ENV)) is not None:
            values["weights_every"] = _parse_int(WEIGHTS_EVERY_ENV, raw)
        if (raw := env.get(WEIGHTS_OPTIMIZER_STATE_ENV)) is not None:
            values["weights_include_optimizer_state"] = _parse_bool(
                WEIGHTS_OPTIMIZER_STATE_ENV, raw
            )
        if (raw := env.get(UPDATE_SLICES_ENV)) is not None:
            values["update_slices"] = _parse_int(UPDATE_SLICES_ENV, raw)
        if (raw := env.get(REPLAY_EVERY_ENV)) is not None:
            values["replay_every"] = _parse_int(REPLAY_EVERY_ENV, raw)
        if (raw := env.get(REPLAY_PROBABILITY_ENV)) is not None:
            try:
                values["replay_probability"] = float(raw)
            except ValueError:
                raise ConfigError(
                    f"{REPLAY_PROBABILITY_ENV}: expected a number, got {raw!r}"
                ) from None
        if (raw := env.get(REPLAY_MODE_ENV)) is not None:
            values["replay_mode"] = raw.strip()
        if (raw := env.get(UNREACHABLE_POLICY_ENV)) is not None:
            values["unreachable_policy"] = raw.strip()
        if (raw := env.get(REPORT_DEADLINE_ENV)) is not None:
            try:
                values["report_deadline_seconds"] = float(raw)
            except ValueError:
                raise ConfigError(
                    f"{REPORT_DEADLINE_ENV}: expected a number, got {raw!r}"
                ) from None
        if (raw := env.get(HEARTBEAT_EVERY_ENV)) is not None:
            values["heartbeat_every"] = _parse_int(HEARTBEAT_EVERY_ENV, raw)
        if (raw := env.get(VERDICT_REPORTERS_ENV)) is not None:
            values["verdict_reporters"] = _parse_int(VERDICT_REPORTERS_ENV, raw)
        if (raw := env.get(SNAPSHOT_COPIES_ENV)) is not None:
            values["snapshot_copies"] = _parse_int(SNAPSHOT_COPIES_ENV, raw)
        for name, var in (
            ("snapshot_memory_fraction", SNAPSHOT_MEMORY_FRACTION_ENV),
            ("snapshot_write_seconds", SNAPSHOT_WRITE_SECONDS_ENV),
        ):
            if (raw := env.get(var)) is not None:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ConfigError(f"{var}: expected a number, got {raw!r}") from None
        if (raw := env.get(SNAPSHOT_DIR_ENV)) is not None and raw.strip():
            values["snapshot_dir"] = raw.strip()
        if (raw := env.get(FINGERPRINT_BACKEND_ENV)) is not None:
            values["fingerprint_backend"] = raw.strip()
        if (raw := env.get(FAULTS_ENV)) is not None:
            try:
                values["faults"] = parse_faults(raw)
            except ConfigError as exc:
                raise ConfigError(f"{FAULTS_ENV}: {exc}") from None
        if (raw := env.get(NODE_NAME_ENV)) is not None and raw.strip():
            values["node_name"] = raw.strip()
        bundle_overrides = {k: overrides.pop(k) for k in sorted(bundle_fields & set(overrides))}
        if "bundles" in overrides and bundle_overrides:
            raise ConfigError(
                f"bundles: give either bundles= or {', '.join(bundle_overrides)}, not both"
            )
        if "bundles" not in overrides:
            values["bundles"] = BundleSettings.from_env(env, **bundle_overrides)
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            # Name the variable too when the bad value came from the environment.
            field_name = str(exc).split(":", 1)[0]
            env_name = _ENV_OF_FIELD.get(field_name)
            if env_name is not None and field_name not in overrides and env_name in env:
                raise ConfigError(f"{env_name}: {exc}") from None
            raise
