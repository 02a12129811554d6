"""``python -m bench.profiled_operator``: the operator (``python -m sdc_operator``) under
:mod:`cProfile`, its event loop's thread profiled, the statistics written to the file
``SDC_BENCH_PROFILE`` names when it stops (SIGTERM). ``bench/operator_scale.py --profile``
runs it; read the file with ``python -m pstats``. cProfile slows what it profiles
(about 1.5-2x): its times say where the operator's CPU goes, not how fast it is."""

from __future__ import annotations

import cProfile
import os
import sys

from sdc_operator.__main__ import main

if __name__ == "__main__":
    profile = cProfile.Profile()
    profile.enable()
    try:
        code = main()
    finally:
        profile.disable()
        profile.dump_stats(os.environ["SDC_BENCH_PROFILE"])
    sys.exit(code)
