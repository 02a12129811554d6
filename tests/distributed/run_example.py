"""Runs an example as ``__main__`` (under torchrun), then exits 3 if any of gloo's threads
outlived its teardown: the example's ``destroy_process_group()`` must really end the group,
or those threads are still running when the interpreter exits, where torch 2.13 sometimes
aborts the process ("terminate called without an active exception").

    python -m torch.distributed.run ... tests/distributed/run_example.py examples/quickstart.py
"""

from __future__ import annotations

import os
import runpy
import sys


def thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    # As `python script.py` does: the script's folder first on the path (examples import
    # each other).
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    left = [name for name in thread_names() if "gloo" in name]
    if left:
        print(f"gloo threads left after the example's teardown: {left}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
