"""Benchmarks of compatflow; each script writes a table under benchmarks/results/."""
