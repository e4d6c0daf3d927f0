"""Shared options of the `diffkv bench` commands that run a DiffKV cache."""

from __future__ import annotations

from diffkv.config import DiffKVConfig


def add_config_arguments(p) -> None:
    p.add_argument("--alpha-high", type=float, default=1.0)
    p.add_argument("--alpha-low", type=float, default=0.02)
    p.add_argument("--profile", default=None, help="calibrated profile JSON (replaces --alpha-high/--alpha-low)")


def bench_config(args, model) -> DiffKVConfig:
    """The profile's configuration (checked against ``model``) if ``--profile`` is given, else the alphas'."""
    if args.profile:
        from diffkv.calibration.profile import load_profile

        return load_profile(args.profile, model).config
    return DiffKVConfig(alpha_high=args.alpha_high, alpha_low=args.alpha_low)
