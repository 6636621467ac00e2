"""``python -m engine.demo [...]``: the same demo as ``kvtier demo [...]``."""

import sys

from engine.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
