"""``python -m diffkv.eval run | report | list`` (same as ``diffkv eval ...``)."""

import sys

from diffkv.cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
