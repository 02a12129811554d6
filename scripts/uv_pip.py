"""`uv pip install` with pip's configuration: the same indexes, find-links, constraints,
certificates and timeout that `pip install` would use here (uv reads no pip.conf nor PIP_*
variable).

    python scripts/uv_pip.py PIP_PYTHON UV TARGET_PYTHON [uv pip install ARGS...]

PIP_PYTHON is an interpreter with pip, whose `pip config list` is read. Exits 3, running
nothing, where pip's configuration holds a setting this does not translate (a proxy, a
client certificate...): the caller installs with pip then (scripts/bootstrap.sh, the image
recipe's test in tests/chart). Standard library only: bootstrap.sh runs it before the
project is installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

# pip settings that change nothing about what gets installed
IGNORED = {
    "disable-pip-version-check",
    "no-input",
    "progress-bar",
    "quiet",
    "verbose",
    "root-user-action",
    "require-virtualenv",
    "no-python-version-warning",
    "no-color",
    "cache-dir",
    "no-cache-dir",
    "timeout",
    "default-timeout",
    "cert",
    "no-warn-script-location",
}
REPEATED = {"find-links": "--find-links", "extra-index-url": "--extra-index-url"}


class Untranslatable(Exception):
    """pip's configuration has a setting uv would not honour the same way."""


def pip_settings(pip_python: str) -> dict[str, str]:
    """pip's settings for `pip install`: PIP_* variables over the [install] section over
    [global], as pip applies them."""
    listing = subprocess.run(
        [pip_python, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    rank = {"global": 0, "install": 1, ":env:": 2}
    settings: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section not in rank:
            continue  # another command's section ([download], [wheel]...)
        value = value.strip().strip("'\"")
        if name not in settings or settings[name][0] <= rank[section]:
            settings[name] = (rank[section], value)
    return {name: value for name, (_, value) in settings.items()}


def command(
    pip_python: str, uv: str, target: str, args: list[str]
) -> tuple[list[str], dict[str, str]]:
    """The uv command line and environment equivalent to `pip install ARGS` for TARGET."""
    settings = pip_settings(pip_python)
    argv = [uv, "pip", "install", "--python", target]
    # pip takes the best version over every index and find-links; uv, by default, the
    # first index that has the package at all
    argv += ["--index-strategy", "unsafe-best-match"]
    env = dict(os.environ)
    for name, value in sorted(settings.items()):
        if name in REPEATED:
            for item in value.split():
                argv += [REPEATED[name], item]
        elif name == "index-url":
            argv += ["--index-url", value]
        elif name == "constraint":
            for item in value.split():
                argv += ["-c", item]
        elif name == "no-index":
            if value.lower() in {"1", "true", "yes", "on"}:
                argv.append("--no-index")
        elif name == "trusted-host":
            for item in value.split():
                argv += ["--allow-insecure-host", item]
        elif name == "cert":
            env["SSL_CERT_FILE"] = value
        elif name in {"timeout", "default-timeout"}:
            env["UV_HTTP_TIMEOUT"] = value.split(".")[0]
        elif name not in IGNORED:
            raise Untranslatable(f"pip setting {name}={value!r}")
    return argv + args, env


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    pip_python, uv, target, *args = argv
    try:
        cmd, env = command(pip_python, uv, target, args)
    except Untranslatable as e:
        print(f"uv_pip: {e} has no uv equivalent here: install with pip", file=sys.stderr)
        return 3
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
