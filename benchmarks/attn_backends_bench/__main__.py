"""``python -m attn_backends_bench``: the same command as ``attn-backends bench``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
