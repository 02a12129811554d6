"""Where bundles go and how they are bounded: :class:`BundleSettings`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._validate import require_int
from ..errors import ConfigError
from .format import (
    _FACTORY,
    BUNDLE_DIR_ENV,
    BUNDLE_FACTORY_ENV,
    BUNDLE_MAX_BYTES_ENV,
    DEFAULT_MAX_BYTES,
)

__all__ = ["BundleSettings"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BundleSettings:
    """Where bundles go and how they are bounded (keyword arguments override env)."""

    bundle_dir: str | None = None
    """Directory under which ``sdc-evidence/`` is created, normally the job's checkpoint
    directory on a volume every node mounts (env ``HYPERPOD_SDC_BUNDLE_DIR``; a path
    object is taken as its string). ``None``: the Guard uses the directory holding the
    last checkpoint given to :meth:`Guard.mark_checkpoint`, and writes no bundle until
    one was given."""

    bundle_factory: str | None = None
    """``"pkg.mod:build"``: a function of no arguments that returns ``(module, loss_fn)``,
    for models that do not pickle (env ``HYPERPOD_SDC_BUNDLE_FACTORY``). ``None``: pickle
    the module's structure and record the loss function by reference."""

    bundle_max_bytes: int = DEFAULT_MAX_BYTES
    """Most bytes of ``.pt`` files one bundle may hold (env
    ``HYPERPOD_SDC_BUNDLE_MAX_BYTES``); what does not fit is left out and the manifest
    says so. 0 keeps only the manifest (the reference bits, no data or weights)."""

    def __post_init__(self) -> None:
        if isinstance(self.bundle_dir, os.PathLike):
            object.__setattr__(self, "bundle_dir", os.fspath(self.bundle_dir))
        if self.bundle_dir is not None and (
            not isinstance(self.bundle_dir, str) or not self.bundle_dir
        ):
            raise ConfigError(f"bundle_dir: must be a non-empty path, got {self.bundle_dir!r}")
        if self.bundle_factory is not None and (
            not isinstance(self.bundle_factory, str) or not _FACTORY.match(self.bundle_factory)
        ):
            raise ConfigError(
                "bundle_factory: must be 'module:function' (e.g. 'mypkg.model:build'), "
                f"got {self.bundle_factory!r}"
            )
        require_int("bundle_max_bytes", self.bundle_max_bytes, minimum=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> BundleSettings:
        env = os.environ if env is None else env
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)}: unknown setting; known: {sorted(known)}")
        values: dict[str, Any] = {}
        if raw := env.get(BUNDLE_DIR_ENV, "").strip():
            values["bundle_dir"] = raw
        if raw := env.get(BUNDLE_FACTORY_ENV, "").strip():
            values["bundle_factory"] = raw
        if (max_bytes := env.get(BUNDLE_MAX_BYTES_ENV)) is not None:
            try:
                values["bundle_max_bytes"] = int(max_bytes.strip())
            except ValueError:
                raise ConfigError(
                    f"{BUNDLE_MAX_BYTES_ENV}: expected a number of bytes, got {max_bytes!r}"
                ) from None
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            name = str(exc).split(":", 1)[0]
            env_name = {
                "bundle_dir": BUNDLE_DIR_ENV,
                "bundle_factory": BUNDLE_FACTORY_ENV,
                "bundle_max_bytes": BUNDLE_MAX_BYTES_ENV,
            }.get(name)
            if env_name is not None and name not in overrides and env_name in env:
                raise ConfigError(f"{env_name}: {exc}") from None
            raise
