"""Benchmarks: each runs as a module from the repository root (``python -m ops.bench.NAME``),
and reports ratios measured in one run plus medians (docs/benchmarks.md holds the results)."""
