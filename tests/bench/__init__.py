"""Micro-benchmarks runnable as scripts (``python -m tests.bench.<name>``)."""
