"""``python -m diffkv.calibration ...`` (same as ``diffkv calibrate ...``)."""

import sys

from diffkv.cli import main

sys.exit(main(["calibrate", *sys.argv[1:]]))
