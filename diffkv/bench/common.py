"""Shared options of the `diffkv bench` commands: the DiffKV configuration, output (``--json``, ``--no-progress``)
and flag names kept for recorded commands."""

from __future__ import annotations

import argparse
import sys

from diffkv.core.config import DiffKVConfig


def add_output_arguments(p) -> None:
    """``--json`` (one JSON object on stdout) and ``--no-progress`` (no bar on stderr)."""
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_alias(p, old: str, dest: str, **kwargs) -> None:
    """Accept ``old`` as a hidden spelling of the option stored in ``dest`` (commands recorded before a rename);
    ``kwargs`` (``type``, ``choices``) as the option's."""
    p.add_argument(old, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **{"type": int, **kwargs})


def progress(args, total: int, unit: str, desc: str):
    """A tqdm bar on stderr, disabled by ``--no-progress`` or when stderr is not a terminal."""
    from tqdm import tqdm

    off = getattr(args, "no_progress", False) or not sys.stderr.isatty()
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=off, leave=False)


def add_config_arguments(p) -> None:
    p.add_argument("--alpha-high", type=float, default=1.0)
    p.add_argument("--alpha-low", type=float, default=0.02)
    p.add_argument("--profile", default=None,
                   help="calibrated profile: JSON path or shipped name (replaces --alpha-high/--alpha-low)")


def bench_config(args, model) -> DiffKVConfig:
    """The profile's configuration (checked against ``model``) if ``--profile`` is given, else the alphas'."""
    if args.profile:
        from diffkv.profile import load_profile

        return load_profile(args.profile, model).config
    return DiffKVConfig(alpha_high=args.alpha_high, alpha_low=args.alpha_low)
