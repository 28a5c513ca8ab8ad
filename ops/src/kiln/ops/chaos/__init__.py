"""Chaos testing of a local run: ``monkey`` kills the platform's processes at random
moments of a run (``kiln chaos``, ``bench/chaos.py``), ``invariants`` checks afterwards,
from durable records only, that nothing was lost, duplicated, corrupted or leaked."""
