"""Benchmarks: CLI commands that time the system and write JSON."""
