"""Sluice benchmarks: ``python -m bench`` (``make bench``).

Every figure is measured against a baseline taken in the same run, on the
same broker, so the ratio means something on any machine.  The registry and
the runner live in ``harness.py``; each ``bench/<area>.py`` registers its
benchmarks with ``@benchmark``.  See README.md.
"""
