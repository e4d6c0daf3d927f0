"""``python -m diffkv.eval run | report | list``."""

import sys

from diffkv.eval.cli import main

sys.exit(main())
