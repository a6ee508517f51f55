"""Benchmark of the CDC apply (issue #4): ``python -m bench.run --scale tiny|small|full``.

See ``bench/README.md`` for what is measured and how to read the figures.
"""
