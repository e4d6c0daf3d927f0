"""Triton @jit kernels (no launchers here; see diffkv.ops and diffkv.memory.ring_launch)."""
