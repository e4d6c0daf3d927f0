"""Benchmarks run by `diffkv bench ...` (results recorded under benchmarks/)."""
