"""Checks for settings: each raises ConfigError naming the setting. Torch-free."""

from __future__ import annotations

from collections.abc import Collection

from .errors import ConfigError


def require_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None, hint: str = ""
) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum  # type: ignore[operator]
    if not ok:
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(f"{name}: must be an integer {bounds}{hint}, got {value!r}")


def require_number(
    name: str,
    value: object,
    *,
    minimum: float,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > minimum if exclusive_minimum else v >= minimum) and (
            maximum is None or v <= maximum
        )
    if not ok:
        low = f"> {minimum:g}" if exclusive_minimum else f">= {minimum:g}"
        bounds = low if maximum is None else f"{low} and <= {maximum:g}"
        raise ConfigError(f"{name}: must be a number {bounds}, got {value!r}")


def require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be true or false, got {value!r}")


def require_choice(name: str, value: object, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")
