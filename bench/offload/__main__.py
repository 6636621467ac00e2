"""``python -m bench.offload [...]``: the KV offload benchmark (bench/offload/main.py)."""

import sys

from bench.offload.main import main

sys.exit(main())
