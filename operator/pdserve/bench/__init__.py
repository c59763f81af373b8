"""Benchmarks that print numbers measured side by side (never timing assertions in tests)."""
