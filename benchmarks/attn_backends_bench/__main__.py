"""``python3 -m attn_backends_bench``, from ``benchmarks/``: the same command as
``python3 benchmarks/bench.py``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python3 -m attn_backends_bench"))
