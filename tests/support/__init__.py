"""Helpers that tests (and benchmarks) use: an in-process transport and a test DNS server."""
