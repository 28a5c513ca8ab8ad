"""Chaos run: ``kiln run`` with its processes SIGKILLed at random moments (seeded), then
every accounting, versioning and cleanup invariant checked from durable records; prints
the kills survived, the groups lost and the wall time against an unkilled baseline.

    .venv/bin/python bench/chaos.py --config configs/smoke.toml --steps 40 --kills 10 --seed 7 --baseline

The same as ``kiln chaos``; the code is ``kiln.ops.chaos``. Exit 1 when an invariant
fails (the reasons are printed)."""

import sys

from kiln.ops.chaos.monkey import main

if __name__ == "__main__":
    sys.exit(main(prog="bench/chaos.py"))
