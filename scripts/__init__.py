"""Benchmark and tooling scripts, run as `python scripts/<name>.py`; a package so that they import scripts/common.py."""
