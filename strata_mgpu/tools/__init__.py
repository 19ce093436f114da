"""Benchmark and sweep tools: importable modules the CLI calls."""
