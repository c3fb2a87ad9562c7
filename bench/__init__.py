"""Benchmarks run by `make bench`; see bench/run.py."""
