"""The no-cache prefill benchmark, run from a checkout (it is not part of the installed package):

    python3 benchmarks/bench.py --out DIR [--workloads ...] [--modes ...] [--backends ...]
    python3 benchmarks/bench.py --render DIR/bench.json --out DIR   # re-render, no GPU needed

Running this file puts ``benchmarks/`` first on ``sys.path``, so ``attn_backends_bench`` is
imported from here; ``attn_backends`` and its built-in plugins come from the installed project
(``pip install -e '.[bench]'`` adds matplotlib for the chart). ``--help`` lists the options.
"""

from __future__ import annotations

import sys

from attn_backends_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
