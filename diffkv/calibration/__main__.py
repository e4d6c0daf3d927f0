"""``python -m diffkv.calibration ...`` (same as ``diffkv calibrate``)."""

import argparse
import sys

from diffkv.calibration.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m diffkv.calibration", description="calibrate DiffKV thresholds")
add_arguments(parser)
try:
    sys.exit(run(parser.parse_args()))
except (ValueError, FileNotFoundError) as e:
    print(f"diffkv calibrate: error: {e}", file=sys.stderr)
    sys.exit(2)
